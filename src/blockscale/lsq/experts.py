"""Scale learning on fused MoE experts (``NVFP4Experts``): per-expert trainable block amaxes.

For each projection P (gate_up: W [E, 2I, H]; down: W [E, H, I]) one learner holds the latent FP32 weights
W [E, N, K], the fixed per-expert outer encode scales S [E] (gate and up of an expert keep sharing theirs)
and the block amaxes [E, N, K/16] (tied: ``amax``; dual: ``amax_pre`` / ``amax_post``). Expert e's weight is
``lsq_fake_quantize(W[e], amax[e], S[e])`` (the NVFP4ScaleLearner formulas, all experts in one broadcast
call). The forward is ``NVFP4Experts.forward_with`` on those weights, so with the stored scales and the
dequantized weights as latent weights the step-0 output equals the PTQ model's bit for bit; W4A4 input
scales stay fixed (inputs quantized as the PTQ model does, gradients passed straight through).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..formats.e2m1 import pack_nibbles
from ..nn.nvfp4_experts import NVFP4Experts
from ..quant.dispatch import quantize
from ..quant.nvfp4 import NVFP4, e2m1_codes
from .latent_weight import LatentWeight
from .parameterisation import BlockAmaxes
from .quantizer import (BLOCK, LSQ_INITS, LSQ_MODES, _INIT_RULE, _amax_for_scales, _inv, _LSQFn, _signed,
                        block_scales)

EXPERT_PROJECTIONS = ("gate_up", "down")


class NVFP4ExpertsScaleLearner(BlockAmaxes, LatentWeight, nn.Module):
    """A learnable NVFP4 fake quantizer of stacked expert weights W [E, N, K] (K a multiple of 16).

    weight: FP32 ``nn.Parameter`` [E, N, K] (requires_grad = ``train_weight``); ``encode_scale`` S [E]
    (buffer, fixed); tied: ``amax`` [E, N, K/16]; dual: ``amax_pre`` / ``amax_post``. init "6": the block
    amax; "4over6" / "sweep" ("mse") / "4": the amax of the E4M3 scales ``quantize(W[e], NVFP4(scale_rule),
    encode_scale=S[e])`` chooses, per expert. forward() = the fake-quantized W [E, N, K] FP32.
    """

    def __init__(self, weight: torch.Tensor, encode_scale: torch.Tensor, mode: str = "tied", init: str = "6",
                 grad_scale: float = 1.0, train_weight: bool = False, param: str = "amax", dual_form: str = "pair"):
        super().__init__()
        if mode not in LSQ_MODES:
            raise ValueError(f"mode={mode!r}; allowed values: {', '.join(LSQ_MODES)}")
        if init not in LSQ_INITS:
            raise ValueError(f"init={init!r}; allowed values: {', '.join(LSQ_INITS)}")
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 3:
            raise ValueError(f"weight must be a floating-point [E, N, K] tensor, got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        E, N, K = weight.shape
        if K % BLOCK:
            raise ValueError(f"weight shape {tuple(weight.shape)}: K={K} must be a multiple of 16")
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("weight contains NaN/inf values")
        S = encode_scale.detach().to(device=weight.device, dtype=torch.float32).reshape(-1)
        if S.numel() != E or not bool((torch.isfinite(S) & (S >= 2.0 ** -126)).all()):
            raise ValueError(f"encode_scale must hold {E} positive, normal, finite FP32 outer scales (one per expert)")
        if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale)):
            raise ValueError(f"grad_scale={grad_scale!r}: expected a finite float")
        self.init, self.grad_scale = init, float(grad_scale)
        self.spec = NVFP4(scale_rule=_INIT_RULE[init])
        w = weight.detach().to(torch.float32).clone()
        self.init_latent_weight(w, train_weight)
        self.register_buffer("encode_scale", S.clone())
        if init == "6":
            amax = w.abs().reshape(E, N, K // BLOCK, BLOCK).amax(-1)
        else:
            s_e = torch.stack([quantize(w[e], self.spec, encode_scale=S[e]).scales.to(torch.float32)
                               for e in range(E)])
            amax = _amax_for_scales(s_e, self._S())
        self.init_amaxes(amax, mode, param, dual_form)

    def _S(self) -> torch.Tensor:
        """S as [E, 1, 1]: broadcasting against the amaxes [E, N, K/16]."""
        return self.encode_scale.reshape(-1, 1, 1)

    @torch.no_grad()
    def set_scales(self, scales: torch.Tensor) -> None:
        """Set every amax so that the block scales are exactly ``scales`` [E, N, K/16] (E4M3 values)."""
        self.set_amax(_amax_for_scales(scales.to(torch.float32), self._S()))

    def forward(self) -> torch.Tensor:
        pre, post = self.amaxes()
        return _LSQFn.apply(self.latent_weight(), pre, post, self._S(), self.grad_scale)

    @torch.no_grad()
    def block_scale(self) -> torch.Tensor:
        """The (pre) block scales in real units, stored E4M3 scale / S [E, N, K/16] (the codes' grid)."""
        return block_scales(self.amaxes()[0], self._S()) / self._S()

    @torch.no_grad()
    def codes_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes uint8 [E, N, K/2], block scales float8_e4m3fn [E, N, K/16]): codes from s_pre, scales
        s_post, so that the stored expert dequantizes to forward()[e] exactly."""
        pre, post = self.amaxes()
        S = self._S()
        w = self.latent_weight().detach()
        E, N, K = w.shape
        s_pre = block_scales(pre, S)
        s_post = s_pre if post is None else block_scales(post, S)
        xb = w.reshape(E, N, K // BLOCK, BLOCK)
        _, _, neg, v = _signed(xb, s_pre.unsqueeze(-1), _inv(S).unsqueeze(-1))
        return pack_nibbles(e2m1_codes(neg, v).reshape(E, N, K)), s_post.to(torch.float8_e4m3fn)

    def extra_repr(self) -> str:
        return (f"shape={tuple(self.weight_parameter().shape)}, {self.amax_repr()}, init={self.init!r}, "
                f"grad_scale={self.grad_scale}" + (", weight_units='block'" if self.weight_units == "block" else ""))


class _StraightThroughExpertInput(torch.autograd.Function):
    """W4A4 expert inputs: forward ``base.quantize_input(x, proj, e)`` (bit for bit), backward the identity."""

    @staticmethod
    def forward(ctx, x, base, proj, e):
        return base.quantize_input(x, proj, e)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class LSQExperts(nn.Module):
    """An ``NVFP4Experts`` (``base``: outer scales, W4A4 input scales, the routing forward) whose expert weights
    are re-quantized from latent FP32 weights with trainable block scales (``gate_up`` / ``down`` learners).
    Same forward signature as the replaced module: (hidden_states, top_k_index, top_k_weights)."""

    def __init__(self, base: NVFP4Experts, gate_up: NVFP4ExpertsScaleLearner, down: NVFP4ExpertsScaleLearner):
        super().__init__()
        self.base, self.gate_up, self.down = base, gate_up, down

    def learners(self) -> dict:
        return {"gate_up": self.gate_up, "down": self.down}

    def _quantize_input(self, x, proj, e):
        return _StraightThroughExpertInput.apply(x, self.base, proj, e)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        dtype = self.base.weight_dtype
        gu, dn = self.gate_up().to(dtype), self.down().to(dtype)
        qi = None if self.base.input_scale_rule is None else self._quantize_input
        return self.base.forward_with(hidden_states, top_k_index, top_k_weights, gu, dn, qi)

    @torch.no_grad()
    def to_nvfp4_experts(self) -> NVFP4Experts:
        """The NVFP4Experts with the learned codes and scales (outer and input scales unchanged)."""
        for p, learner in self.learners().items():
            codes, scales = learner.codes_and_scales()
            getattr(self.base, f"{p}_weight_packed").copy_(codes)
            getattr(self.base, f"{p}_weight_scale").copy_(scales)
        return self.base


def latent_expert_weights(name: str, m: NVFP4Experts, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) FP32 latent weights of the experts module ``name``: from
    ``weights`` (a module with the same names holding the fused experts' ``gate_up_proj`` / ``down_proj``, or
    a dict with the keys ``name + ".gate_up_proj"`` / ``name + ".down_proj"``), or the dequantized weights."""
    if weights is None:
        return m.dequantized(torch.float32)
    out = []
    for key, proj in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        if isinstance(weights, nn.Module):
            w = getattr(weights.get_submodule(name), key, None)
        else:
            w = weights.get(f"{name}.{key}")
        packed = getattr(m, f"{proj}_weight_packed")
        want = (packed.shape[0], packed.shape[1], 2 * packed.shape[2])
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != want:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name}.{key}: latent weight {got}, the quantized experts {want}")
        out.append(w.detach().float())
    return out[0], out[1]


def enable_experts(model: nn.Module, mode: str, init: str, weights, grad_scale: float,
                   train_weights: bool, param: str = "amax", dual_form: str = "pair",
                   weight_units: str = "raw") -> list[str]:
    """Replace every ``NVFP4Experts`` of ``model`` by an ``LSQExperts`` (see ``lsq.enable``); returns the names."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Experts)]
    for name, m in targets:
        latent = latent_expert_weights(name, m, weights)
        learners = []
        for p, w in zip(EXPERT_PROJECTIONS, latent):
            S = getattr(m, f"{p}_weight_global_scale")
            learner = NVFP4ExpertsScaleLearner(w.to(S.device), S, mode=mode, init="6" if init == "stored" else init,
                                               grad_scale=grad_scale, train_weight=train_weights, param=param,
                                               dual_form=dual_form)
            if init == "stored":
                learner.set_scales(getattr(m, f"{p}_weight_scale"))
            if weight_units == "block":
                learner.use_block_units(learner.block_scale())
            learners.append(learner)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, LSQExperts(m, *learners))
    return [n for n, _ in targets]


def freeze_experts(model: nn.Module) -> list[str]:
    """Replace every ``LSQExperts`` by its ``NVFP4Experts`` with the learned scales."""
    names = [n for n, m in model.named_modules() if isinstance(m, LSQExperts)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, getattr(owner, child).to_nvfp4_experts())
    return names


__all__ = ["EXPERT_PROJECTIONS", "LSQExperts", "NVFP4ExpertsScaleLearner", "enable_experts", "freeze_experts",
           "latent_expert_weights"]
