"""Learnable NVFP4 block scales on a PTQ model: ``enable`` swaps every ``NVFP4Linear`` for an
``LSQLinear`` (latent FP32 weight + trainable block amax) and every ``NVFP4Experts`` for an ``LSQExperts``
(``lsq.experts``: per-expert amaxes), ``freeze`` swaps them back with the learned scales (tied: standard
NVFP4; dual: codes from s_pre, stored scales s_post: the exact export).

    bs.lsq.enable(model, mode="dual")          # step-0 logits == the PTQ model's, bit for bit
    ... train bs.lsq.scale_parameters(model) ...
    bs.lsq.freeze(model); bs.export_checkpoint(model, "out", "compressed-tensors")
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.fused import fused_groups
from ..nn.input_rotation import carry_input_rotation
from ..nn.nvfp4_experts import NVFP4Experts
from ..nn.nvfp4_linear import NVFP4Linear
from .experts import LSQExperts, NVFP4ExpertsScaleLearner, enable_experts, freeze_experts
from .latent_weight import check_weight_units
from .parameterisation import SCALE_PARAMETER_NAMES, check_parameterisation
from .input_scale import learned_input_quantize, learned_input_scale
from .quantizer import LSQ_INITS, LSQ_MODES, NVFP4ScaleLearner

ENABLE_INITS = ("stored",) + LSQ_INITS


class _StraightThroughInput(torch.autograd.Function):
    """W4A4 activations: forward ``base.quantize_input(x)`` (bit for bit), backward the identity, so
    gradients reach the Linears before this one (a plain fake_quantize has no gradient)."""

    @staticmethod
    def forward(ctx, x, base):
        return base.quantize_input(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class LSQLinear(nn.Module):
    """``y = quantize_input(x) @ learner()^T + b``: an NVFP4Linear whose weight is re-quantized from a
    latent FP32 weight with trainable block scales. ``base`` keeps the bias and the W4A4 input scale;
    the input quantizer passes gradients straight through. log_input_amax (W4A4, activation rule "6"): a
    trainable scalar (``lsq.input_scale``: the activation clipping level, 0 = calibrated), one Parameter shared
    by the Linears of a fused group (q/k/v, gate/up keep one input scale)."""

    def __init__(self, base: NVFP4Linear, learner: NVFP4ScaleLearner, log_input_amax: Optional[nn.Parameter] = None):
        super().__init__()
        self.base, self.learner = base, learner
        if log_input_amax is not None and (base.input_global_scale is None or base.input_scale_rule != "6"):
            raise ValueError("learn_input_scales needs W4A4 Linears with the activation scale rule '6' (got "
                             f"{'W4A16' if base.input_global_scale is None else repr(base.input_scale_rule)})")
        self.log_input_amax = log_input_amax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.base.bias is None else self.base.bias.to(x.dtype)
        if self.base.input_global_scale is None:
            xq = x
        elif self.log_input_amax is not None:
            xq = learned_input_quantize(x, self.log_input_amax, self.base.input_global_scale, self.base.input_error)
        else:
            xq = _StraightThroughInput.apply(x, self.base)
        return F.linear(xq, self.learner().to(x.dtype), b)

    @torch.no_grad()
    def to_nvfp4_linear(self) -> NVFP4Linear:
        """The NVFP4Linear with the learned codes and scales (its dequantized weight == learner()) and, with a
        learned input scale, that outer scale."""
        q = self.learner.to_quantized()
        self.base.weight_packed.copy_(q.codes)
        self.base.weight_scale.copy_(q.scales)
        self.base.weight_global_scale.copy_(q.outer_scale.reshape(1))
        if self.log_input_amax is not None:
            self.base.input_global_scale.copy_(learned_input_scale(self.base.input_global_scale, self.log_input_amax))
        return self.base


def _latent_weight(name: str, m: NVFP4Linear, weights) -> torch.Tensor:
    if weights is None:
        return m.dequantized_weight(torch.float32)
    w = weights.get_submodule(name).weight if isinstance(weights, nn.Module) else weights[name]
    if tuple(w.shape) != (m.out_features, m.in_features):
        raise ValueError(f"{name}: latent weight has shape {tuple(w.shape)}, the quantized layer "
                         f"{(m.out_features, m.in_features)}")
    return w.detach().float()


def enable(model: nn.Module, mode: str = "tied", init: str = "stored",
           weights: Union[nn.Module, dict, None] = None, grad_scale: float = 1.0,
           train_weights: bool = False, param: str = "amax", dual_form: str = "pair",
           learn_input_scales: bool = False, weight_units: str = "raw") -> list[str]:
    """Make the block scales of every ``NVFP4Linear`` and ``NVFP4Experts`` (fused MoE experts) in ``model``
    trainable (in place); returns the names (Linears first, then the experts modules).

    mode: "tied" (one amax per block) or "dual" (amax_pre for the codes, amax_post for the value).
    param: the units the amaxes train in: "amax" (the raw amax, the write-up's) or "log" (log of the amax
      relative to its initial value: one lr is the same relative step on every model); dual_form: "pair"
      (independent pre / post, the write-up's) or "ratio" (post = pre * a learned ratio). See
      ``lsq.parameterisation``; every choice gives the same step-0 forward bit for bit.
    weight_units: the units the latent weights train in (``train_weights``): "raw" or "block" (relative to each
      block's scale at the start: one lr is the same share of a quantization step on every model; see
      ``lsq.latent_weight``); step 0 is the same either way, bit for bit.
    learn_input_scales: W4A4 Linears (activation rule "6") also learn their activation outer scale
      (``lsq.input_scale``: the clipping level, log units); fused experts' input scales stay fixed.
    init: "stored" (the PTQ model's E4M3 scales) or a scale rule "6" / "4over6" / "sweep" ("mse") /
      "4" applied to the latent weight with the layer's outer scale S (kept fixed: fused groups keep
      sharing it).
    weights: the latent FP32 weights: a module with the same names (e.g. the full-precision model of an
      RTN-quantized one) or a {name: tensor} dict (experts: keys ``name.gate_up_proj`` / ``name.down_proj``);
      None: the PTQ model's dequantized weights.
    Experts (``lsq.experts``): per expert and projection block amaxes [E, rows, inputs/16], the per-expert
      outer scales fixed (gate and up keep sharing theirs), W4A4 input scales fixed.
    With init "stored" and no ``weights`` the step-0 forward equals the PTQ model's bit for bit (for
    any PTQ method); so does init=rule with the full-precision weights of a model quantized by RTN with
    that rule (without smoothing).
    """
    if mode not in LSQ_MODES:
        raise ValueError(f"mode={mode!r}; allowed values: {', '.join(LSQ_MODES)}")
    if init not in ENABLE_INITS:
        raise ValueError(f"init={init!r}; allowed values: {', '.join(ENABLE_INITS)}")
    check_parameterisation(mode, param, dual_form)
    check_weight_units(weight_units)
    if learn_input_scales:
        bad = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)
               and (m.input_global_scale is None or m.input_scale_rule != "6")]
        if bad:
            raise ValueError(f"learn_input_scales: {bad[0]} (and {len(bad) - 1} more) is not a W4A4 Linear with the "
                             "activation scale rule '6'; allowed: models quantized with activations='w4a4', "
                             "act_scale_rule='6'")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    if not targets and not any(isinstance(m, NVFP4Experts) for m in model.modules()):
        raise ValueError("model has no NVFP4Linear layers or NVFP4Experts: quantize it first (blockscale quantize / "
                         "quantize_model)")
    input_params = {}
    if learn_input_scales:  # one learned input scale per fused group (they share one calibrated scale)
        for group in fused_groups([n for n, _ in targets]):
            p = nn.Parameter(torch.zeros((), device=dict(targets)[group[0]].input_global_scale.device))
            input_params.update({n: p for n in group})
    for name, m in targets:
        w = _latent_weight(name, m, weights).to(m.weight_packed.device)
        S = m.weight_global_scale.reshape(())
        learner = NVFP4ScaleLearner(w, S, mode=mode, init="6" if init == "stored" else init,
                                    grad_scale=grad_scale, train_weight=train_weights, param=param,
                                    dual_form=dual_form)
        if init == "stored":
            learner.set_scales(m.weight_scale)
        if weight_units == "block":
            learner.use_block_units(learner.block_scale())
        parent, _, child = name.rpartition(".")
        new = LSQLinear(m, learner, input_params.get(name))
        carry_input_rotation(m, new)  # a rotated PTQ start (--rotate): the online rotation stays fixed
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return [n for n, _ in targets] + enable_experts(model, mode, init, weights, grad_scale, train_weights, param,
                                                    dual_form, weight_units)


@torch.no_grad()
def exact_latent_weights(model: nn.Module, candidates: dict) -> tuple[dict, list[str]]:
    """Latent weights for ``enable(model, init="stored", weights=...)`` that keep step 0 the PTQ model bit for bit:
    for every ``NVFP4Linear`` of ``model``, ``candidates[name]`` (e.g. the full-precision weights PTQ quantized:
    ``quantize_model(..., latent_weights=d)``) when rounding it with the layer's stored block scales and outer
    scale reproduces the stored codes exactly (RTN-like methods: RTN, AWQ, SmoothQuant, any scale rule), else
    the layer's dequantized weight (GPTQ, whose codes are not a rounding of one weight; a missing name).
    Fused experts (``NVFP4Experts`` NAME): the same for the keys ``NAME.gate_up_proj`` / ``NAME.down_proj`` (e.g. the
    full-precision model's fused expert weights), as ``enable`` reads them.
    Returns ({name: FP32 weight}, the names that took the dequantized weight)."""
    if not isinstance(candidates, dict):
        raise TypeError(f"candidates must be a dict of {{name: weight}}, got {type(candidates).__name__}")
    out, fallback = {}, []
    for name, m in model.named_modules():
        if not isinstance(m, NVFP4Linear):
            continue
        w = candidates.get(name)
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (m.out_features, m.in_features) \
                and bool(torch.isfinite(w).all()):
            S = m.weight_global_scale.reshape(()).float()
            learner = NVFP4ScaleLearner(w.to(m.weight_packed.device).float(), S)
            learner.set_scales(m.weight_scale)
            if torch.equal(learner.to_quantized().codes, m.weight_packed):
                out[name] = w.detach().float()
                continue
        out[name] = m.dequantized_weight(torch.float32)
        fallback.append(name)
    for name, m in model.named_modules():  # fused experts: keys NAME.gate_up_proj / NAME.down_proj
        if not isinstance(m, NVFP4Experts):
            continue
        deq = m.dequantized(torch.float32)
        for (key, proj), d in zip((("gate_up_proj", "gate_up"), ("down_proj", "down")), deq):
            w = candidates.get(f"{name}.{key}")
            if isinstance(w, torch.Tensor) and w.shape == d.shape and bool(torch.isfinite(w).all()):
                S = getattr(m, f"{proj}_weight_global_scale")
                learner = NVFP4ExpertsScaleLearner(w.to(S.device).float(), S)
                learner.set_scales(getattr(m, f"{proj}_weight_scale"))
                if torch.equal(learner.codes_and_scales()[0], getattr(m, f"{proj}_weight_packed")):
                    out[f"{name}.{key}"] = w.detach().float()
                    continue
            out[f"{name}.{key}"] = d
            fallback.append(f"{name}.{key}")
    return out, fallback


def freeze(model: nn.Module) -> list[str]:
    """Replace every ``LSQLinear`` by its ``NVFP4Linear`` and every ``LSQExperts`` by its ``NVFP4Experts``, with
    the learned scales (ready to export); returns the names."""
    names = [n for n, m in model.named_modules() if isinstance(m, LSQLinear)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old = getattr(owner, child)
        new = old.to_nvfp4_linear()
        carry_input_rotation(old, new)
        setattr(owner, child, new)
    return names + freeze_experts(model)


def scale_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable block-scale parameters (1/16 of the quantized weights' element count per mode tensor): the
    amaxes, or their logs / ratios (``lsq.parameterisation.SCALE_PARAMETER_NAMES``)."""
    return [p for n, p in model.named_parameters() if n.rpartition(".")[2] in SCALE_PARAMETER_NAMES]


def weight_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The latent FP32 weights of the LSQ layers (trainable only with ``train_weights=True``)."""
    out = []
    for m in model.modules():
        if isinstance(m, LSQLinear):
            out.append(m.learner.weight_parameter())
        elif isinstance(m, LSQExperts):
            out += [learner.weight_parameter() for learner in m.learners().values()]
    return out


def learner_modules(model: nn.Module) -> list[nn.Module]:
    """The scale learners of ``model`` (``NVFP4ScaleLearner`` of each LSQLinear, the experts' learners of
    each LSQExperts), in model order: the modules holding the latent weights and the block amaxes."""
    out = []
    for m in model.modules():
        if isinstance(m, LSQLinear):
            out.append(m.learner)
        elif isinstance(m, LSQExperts):
            out += list(m.learners().values())
    return out


def lsq_layers(model: nn.Module) -> dict[str, Union[LSQLinear, LSQExperts]]:
    """The scale-learning modules of ``model`` by name: LSQLinear layers and LSQExperts (fused MoE experts)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (LSQLinear, LSQExperts))}


__all__ = ["ENABLE_INITS", "LSQLinear", "enable", "exact_latent_weights", "freeze", "learner_modules", "lsq_layers", "scale_parameters", "weight_parameters"]
