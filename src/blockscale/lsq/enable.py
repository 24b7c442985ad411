"""Learnable NVFP4 block scales on a PTQ model: ``enable`` swaps every ``NVFP4Linear`` for an
``LSQLinear`` (latent FP32 weight + trainable block amax) and every ``NVFP4Experts`` for an ``LSQExperts``
(``lsq.experts``: per-expert amaxes), ``freeze`` swaps them back with the learned scales (tied: standard
NVFP4; dual: codes from s_pre, stored scales s_post: the exact export).

    bs.lsq.enable(model, mode="dual")          # step-0 logits == the PTQ model's, bit for bit
    ... train bs.lsq.scale_parameters(model) ...
    bs.lsq.freeze(model); bs.export_checkpoint(model, "out", "compressed-tensors")
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.nvfp4_experts import NVFP4Experts
from ..nn.nvfp4_linear import NVFP4Linear
from .experts import LSQExperts, enable_experts, freeze_experts
from .quantizer import LSQ_INITS, LSQ_MODES, NVFP4ScaleLearner, _amax_for_scales

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
    the input quantizer passes gradients straight through."""

    def __init__(self, base: NVFP4Linear, learner: NVFP4ScaleLearner):
        super().__init__()
        self.base, self.learner = base, learner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.base.bias is None else self.base.bias.to(x.dtype)
        xq = x if self.base.input_global_scale is None else _StraightThroughInput.apply(x, self.base)
        return F.linear(xq, self.learner().to(x.dtype), b)

    @torch.no_grad()
    def to_nvfp4_linear(self) -> NVFP4Linear:
        """The NVFP4Linear with the learned codes and scales (its dequantized weight == learner())."""
        q = self.learner.to_quantized()
        self.base.weight_packed.copy_(q.codes)
        self.base.weight_scale.copy_(q.scales)
        self.base.weight_global_scale.copy_(q.outer_scale.reshape(1))
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
           train_weights: bool = False) -> list[str]:
    """Make the block scales of every ``NVFP4Linear`` and ``NVFP4Experts`` (fused MoE experts) in ``model``
    trainable (in place); returns the names (Linears first, then the experts modules).

    mode: "tied" (one amax per block) or "dual" (amax_pre for the codes, amax_post for the value).
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
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    if not targets and not any(isinstance(m, NVFP4Experts) for m in model.modules()):
        raise ValueError("model has no NVFP4Linear layers or NVFP4Experts: quantize it first (blockscale quantize / "
                         "quantize_model)")
    for name, m in targets:
        w = _latent_weight(name, m, weights).to(m.weight_packed.device)
        S = m.weight_global_scale.reshape(())
        learner = NVFP4ScaleLearner(w, S, mode=mode, init="6" if init == "stored" else init,
                                    grad_scale=grad_scale, train_weight=train_weights)
        if init == "stored":
            amax = _amax_for_scales(m.weight_scale.to(torch.float32), S)
            for p in ([learner.amax] if mode == "tied" else [learner.amax_pre, learner.amax_post]):
                p.data.copy_(amax)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, LSQLinear(m, learner))
    return [n for n, _ in targets] + enable_experts(model, mode, init, weights, grad_scale, train_weights)


def freeze(model: nn.Module) -> list[str]:
    """Replace every ``LSQLinear`` by its ``NVFP4Linear`` and every ``LSQExperts`` by its ``NVFP4Experts``, with
    the learned scales (ready to export); returns the names."""
    names = [n for n, m in model.named_modules() if isinstance(m, LSQLinear)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, getattr(owner, child).to_nvfp4_linear())
    return names + freeze_experts(model)


def scale_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable block-amax parameters (1/16 of the quantized weights' element count per mode tensor)."""
    return [p for n, p in model.named_parameters() if n.rpartition(".")[2] in ("amax", "amax_pre", "amax_post")]


def weight_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The latent FP32 weights of the LSQ layers (trainable only with ``train_weights=True``)."""
    out = []
    for m in model.modules():
        if isinstance(m, LSQLinear):
            out.append(m.learner.weight)
        elif isinstance(m, LSQExperts):
            out += [learner.weight for learner in m.learners().values()]
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


__all__ = ["ENABLE_INITS", "LSQLinear", "enable", "freeze", "learner_modules", "lsq_layers", "scale_parameters", "weight_parameters"]
