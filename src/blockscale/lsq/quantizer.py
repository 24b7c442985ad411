"""NVFP4 scale learning: learned step size quantization (Esser et al. 2020) of the E4M3 block scales.

Each block scale is parameterised by an FP32 per-block amax (scale = amax/6, the "6" convention).
With W [N, K] (K a multiple of 16), S the fixed FP32 outer encode scale and amax [N, K/16]:

    s_e = e4m3_rne(min(max(amax, 0) * (S * (1/6)), 448))      stored block scale (library order)
    e   = min(1 / (s_e * (1/S)), FLT_MAX)   (0 where s_e = 0)
    q   = e2m1_rne(clamp(x * e, -6, 6))                        codes
    x~  = (q * s_e) * (1/S)                                    exactly ``fake_quantize`` / dequantize

"tied": one amax per block for codes and value. "dual": codes from amax_pre, value from amax_post
(x~ = (q_pre * s_e_post) * (1/S)). Backward is a straight-through estimator in real units
s = s_e/S (the E4M3 rounding of the scale passed straight through, ds/damax = 1/6), with
u = x * e and inside = |u| <= 6 (and s > 0):

    tied:  dL/dx = dL/dx~ * inside;  dL/ds = sum_block dL/dx~ * (q - u * inside)
           (q - u inside; +-6 outside, since q saturates at +-6)
    dual:  dL/ds_post = sum dL/dx~ * q;  dL/ds_pre = sum dL/dx~ * (-(s_post/s_pre) * u) * inside;
           dL/dx = dL/dx~ * (s_post/s_pre) * inside
    dL/damax = dL/ds / 6 * grad_scale

There is no lower floor on amax: E4M3 subnormal block scales are legal; only a block whose scale is 0
(amax <= 0, or so small that e4m3 rounds it to 0) reconstructs as 0, with zero gradients.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..formats.e2m1 import pack_nibbles
from ..quant.backend import want_compiled
from ..quant.fast_kernel import fast_kernel
from ..quant.dispatch import quantize
from ..quant.nvfp4 import (NVFP4, amax_of_outer_scale, block_scales as nvfp4_block_scales, e2m1_codes,
                           encode_multiplier, encode_scale_tensor, rounded_magnitudes)
from ..quant.tensor import QuantizedTensor
from .latent_weight import LatentWeight
from .parameterisation import BlockAmaxes

BLOCK = 16
LSQ_MODES = ("tied", "dual")
LSQ_INITS = ("6", "4over6", "sweep", "4", "mse")
_INIT_RULE = {"6": "6", "4over6": "4over6", "sweep": "sweep", "4": "4", "mse": "sweep"}


def _inv(S: torch.Tensor) -> torch.Tensor:
    return 1.0 / S  # a true FP32 division, as quantize_nvfp4 computes 1/S


def block_scales(amax: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Stored E4M3 block scales (as FP32 values) of FP32 amax [...]: e4m3_rne(min(amax*(S*(1/6)), 448));
    amax <= 0 gives 0."""
    return nvfp4_block_scales(torch.clamp(amax.detach().float(), min=0.0), S, 6)


def _signed(xb, s_e, inv_s):
    """(u = x*e, signed E2M1 values q, neg) for blocks xb [N, nb, 16] with scales s_e [N, nb, 1]."""
    neg, v = rounded_magnitudes(xb, s_e, inv_s, None, "nearest", "hardware")
    return xb * encode_multiplier(s_e, inv_s), torch.where(neg, -v, v), neg, v


def lsq_forward(w: torch.Tensor, amax_pre: torch.Tensor, amax_post, S: torch.Tensor) -> torch.Tensor:
    """The LSQ forward x~ = (q(x, s_pre) * s_e_post) * (1/S) of FP32 ``w`` [..., N, K] (tied: ``amax_post``
    None), as FP32 [..., N, K]. The eager specification; ``lsq_forward_fast`` is this compiled."""
    *lead, N, K = w.shape
    xb = w.reshape(*lead, N, K // BLOCK, BLOCK)
    inv_s = _inv(S)
    inv_b = inv_s.unsqueeze(-1) if inv_s.dim() else inv_s  # against the blocks [..., N, nb, 16]
    s_pre = block_scales(amax_pre, S).unsqueeze(-1)
    s_post = s_pre if amax_post is None else block_scales(amax_post, S).unsqueeze(-1)
    _, q, _, _ = _signed(xb, s_pre, inv_b)
    return ((q * s_post) * inv_b).reshape(*lead, N, K)


def lsq_backward_terms(g: torch.Tensor, w: torch.Tensor, amax_pre: torch.Tensor, amax_post, S: torch.Tensor,
                       need_dw: bool):
    """The elementwise part of the STE backward (module docstring) for the output gradient ``g`` [..., N, K]:
    (dL/dw [..., N, K] or None, per-element terms [..., N, nb, 16] whose block sums are dL/ds_pre (tied: dL/ds)
    and dL/ds_post (tied: None)). u and q are recomputed from ``w`` exactly as the forward computed them.
    The block sums stay outside (``_LSQFn.backward``: one eager ``sum(-1)``), so the compiled form of this
    function (``lsq_backward_terms_fast``) gives the same gradients bit for bit."""
    *lead, N, K = w.shape
    xb = w.reshape(*lead, N, K // BLOCK, BLOCK)
    inv_s = _inv(S)
    inv_b = inv_s.unsqueeze(-1) if inv_s.dim() else inv_s
    s_pre = block_scales(amax_pre, S).unsqueeze(-1)
    u, q, _, _ = _signed(xb, s_pre, inv_b)
    gb = g.float().reshape(*lead, N, K // BLOCK, BLOCK)
    inside = (u.abs() <= 6.0) & (s_pre > 0)
    zero = torch.zeros_like(u)
    if amax_post is None:
        t_s = gb * (q - torch.where(inside, u, zero))
        dw = torch.where(inside, gb, zero).reshape(*lead, N, K) if need_dw else None
        return dw, t_s, None
    s_post = block_scales(amax_post, S).unsqueeze(-1)
    ratio = torch.where(s_pre > 0, s_post / torch.where(s_pre > 0, s_pre, torch.ones_like(s_pre)),
                        torch.zeros_like(s_pre))
    t_post = gb * q
    t_pre = gb * torch.where(inside, -ratio * u, zero)
    dw = torch.where(inside, gb * ratio, zero).reshape(*lead, N, K) if need_dw else None
    return dw, t_pre, t_post


# "auto" compiles from this size on: the LSQ kernels run at every training step, so a weight of 64K elements
# (SmolLM2-135M's smallest, 192 x 576, has 110K) pays for the one-off compile within a few steps
LSQ_COMPILE_MIN_NUMEL = 1 << 16
lsq_forward_fast = fast_kernel(lsq_forward)
lsq_backward_terms_fast = fast_kernel(lsq_backward_terms)


class _LSQFn(torch.autograd.Function):
    """x~ = (q(x, s_pre) * s_e_post) * (1/S) with the STE backward above (tied: amax_post is None). Large
    weights (``quant.backend.want_compiled``) run the compiled kernels, bit for bit the eager ones; the
    backward recomputes the codes instead of keeping them."""

    @staticmethod
    def forward(ctx, w, amax_pre, amax_post, S, grad_scale):
        # w [..., N, K], amax [..., N, K/16], S broadcasting against amax ([] or e.g. [E, 1, 1] per expert)
        w32 = w.detach().float()
        pre = amax_pre.detach()
        post = None if amax_post is None else amax_post.detach()
        ctx.fast = want_compiled(w32.numel(), lsq_forward_fast, lsq_backward_terms_fast,
                                 min_numel=LSQ_COMPILE_MIN_NUMEL)
        out = (lsq_forward_fast if ctx.fast else lsq_forward_fast.eager)(w32, pre, post, S)
        ctx.save_for_backward(w32, pre, post, S)
        ctx.grad_scale = grad_scale
        return out

    @staticmethod
    def backward(ctx, gout):
        w32, pre, post, S = ctx.saved_tensors
        terms = lsq_backward_terms_fast if ctx.fast else lsq_backward_terms_fast.eager
        dw, t_pre, t_post = terms(gout.contiguous(), w32, pre, post, S, bool(ctx.needs_input_grad[0]))
        k = ctx.grad_scale / 6.0
        d_pre = t_pre.sum(-1) * k
        d_post = None if t_post is None else t_post.sum(-1) * k
        return dw, d_pre, d_post, None, None


def lsq_fake_quantize(w: torch.Tensor, amax: torch.Tensor, encode_scale: torch.Tensor,
                      amax_post: torch.Tensor | None = None, grad_scale: float = 1.0) -> torch.Tensor:
    """Functional form: the LSQ fake-quantized FP32 ``w`` [..., N, K] (tied if ``amax_post`` is None, else
    dual with ``amax`` as amax_pre), differentiable w.r.t. ``w`` and the amax tensor(s) [..., N, K/16];
    ``encode_scale`` broadcasts against the amaxes (one scalar, or e.g. [E, 1, 1]: one per expert)."""
    return _LSQFn.apply(w, amax, amax_post, encode_scale, float(grad_scale))


def _amax_for_scales(s_e: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """An FP32 amax with block_scales(amax, S) == s_e exactly (s_e on the E4M3 grid)."""
    amax = (s_e * 6.0) / S
    for _ in range(64):
        got = block_scales(amax, S)
        lo, hi = got < s_e, got > s_e
        if not bool((lo | hi).any()):
            return amax
        amax = torch.where(lo, torch.nextafter(amax, torch.full_like(amax, math.inf)), amax)
        amax = torch.where(hi, torch.nextafter(amax, torch.zeros_like(amax)), amax)
    raise RuntimeError("could not find an amax reproducing the chosen E4M3 block scales")  # pragma: no cover


def ignore_fsdp_view_warning() -> None:
    """FSDP2 warns when a unit returns a view (an in-place op on it would skip its hooks). A sharded scale
    learner returns the fake-quantized weight as a reshape (a view), which its consumers (``LSQLinear``,
    ``LSQExperts``) only read out of place: that one warning is silenced, for the learner classes only."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w*ScaleLearner\) returned a view tensor")


class NVFP4ScaleLearner(BlockAmaxes, LatentWeight, nn.Module):
    """A learnable NVFP4 fake quantizer of one weight [N, K] (K a multiple of 16).

    weight: an FP32 ``nn.Parameter`` (requires_grad = ``train_weight``; ``use_block_units`` re-expresses it in
    units of each block's scale: ``lsq.latent_weight``). Tied mode: ``amax`` [N, K/16];
    dual mode: ``amax_pre`` (codes) and ``amax_post`` (value scale). param / dual_form: the units the
    amaxes train in (``lsq.parameterisation``: "amax" raw, or "log": ``log_amax`` relative to the initial
    amax; dual "pair" or "ratio"). ``encode_scale`` S (buffer, FP32 [])
    stays fixed. init: "6" (the block amax), or "4over6" / "sweep" ("mse") / "4": the amax that maps
    to the E4M3 scale ``quantize(weight, NVFP4(scale_rule=init), encode_scale=S)`` chose.
    grad_scale: the LSQ gradient-scale factor multiplying the amax gradients.
    """

    def __init__(self, weight: torch.Tensor, encode_scale, mode: str = "tied", init: str = "6",
                 grad_scale: float = 1.0, train_weight: bool = False, param: str = "amax", dual_form: str = "pair"):
        super().__init__()
        if mode not in LSQ_MODES:
            raise ValueError(f"mode={mode!r}; allowed values: {', '.join(LSQ_MODES)}")
        if init not in LSQ_INITS:
            raise ValueError(f"init={init!r}; allowed values: {', '.join(LSQ_INITS)}")
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError("weight must be a floating-point torch.Tensor")
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        if weight.shape[1] % BLOCK:
            raise ValueError(f"weight shape {tuple(weight.shape)}: K={weight.shape[1]} must be a multiple of 16")
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("weight contains NaN/inf values")
        if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale)):
            raise ValueError(f"grad_scale={grad_scale!r}: expected a finite float")
        S = encode_scale_tensor(encode_scale, weight.device)
        self.init, self.grad_scale = init, float(grad_scale)
        self.spec = NVFP4(scale_rule=_INIT_RULE[init])
        w = weight.detach().to(torch.float32).clone()
        self.init_latent_weight(w, train_weight)
        self.register_buffer("encode_scale", S.clone())
        N, K = w.shape
        if init == "6":
            amax = w.abs().reshape(N, K // BLOCK, BLOCK).amax(-1)
        else:
            s_e = quantize(w, self.spec, encode_scale=S).scales.to(torch.float32)
            amax = _amax_for_scales(s_e, S)
        self.init_amaxes(amax, mode, param, dual_form)

    @torch.no_grad()
    def set_scales(self, scales: torch.Tensor) -> None:
        """Set the amaxes so that the block scales are exactly ``scales`` [N, K/16] (E4M3 values)."""
        self.set_amax(_amax_for_scales(scales.to(torch.float32), self.encode_scale))

    def forward(self) -> torch.Tensor:
        """The fake-quantized weight x~ [N, K] FP32."""
        pre, post = self.amaxes()
        return _LSQFn.apply(self.latent_weight(), pre, post, self.encode_scale, self.grad_scale)

    @torch.no_grad()
    def block_scale(self) -> torch.Tensor:
        """The (pre) block scales in real units, stored E4M3 scale / S [N, K/16] (the codes' grid)."""
        return block_scales(self.amaxes()[0], self.encode_scale) / self.encode_scale

    @torch.no_grad()
    def to_quantized(self) -> QuantizedTensor:
        """NVFP4 export: codes from s_pre (tied: s), E4M3 scales s_e_post; dequantize() == forward()."""
        pre, post = self.amaxes()
        S = self.encode_scale
        w = self.latent_weight().detach()
        N, K = w.shape
        xb = w.reshape(N, K // BLOCK, BLOCK)
        s_pre = block_scales(pre, S)
        s_post = s_pre if post is None else block_scales(post, S)
        _, _, neg, v = _signed(xb, s_pre.unsqueeze(-1), _inv(S))
        codes = e2m1_codes(neg, v).reshape(N, K)
        amax_st = amax_of_outer_scale(S, self.spec.outer_bound)
        return QuantizedTensor(spec=self.spec, codes=pack_nibbles(codes), scales=s_post.to(torch.float8_e4m3fn),
                               shape=torch.Size((N, K)), dtype=torch.float32, outer_scale=S.clone(), amax=amax_st)

    def extra_repr(self) -> str:
        return (f"shape={tuple(self.weight_parameter().shape)}, {self.amax_repr()}, init={self.init!r}, "
                f"grad_scale={self.grad_scale}" + (", weight_units='block'" if self.weight_units == "block" else ""))
