"""One weight's quantization grid for AutoRound: from its start quantization (the scale rule's round to
nearest), a fake quantization differentiable in per-element rounding offsets V and per-scale clip factors
alpha whose forward values are bit for bit what the final codes dequantize to, and those final codes.

For a weight W [N, K] and its start ``q0`` (a QuantizedTensor: NVFP4, FP8 or MX)::

    latent = W + V * g        V in [-0.5, 0.5] per element; elements with V = 0 are W itself (signed zeros too)
    g      = spacing(W / d0) * d0    the element grid's spacing at the start value, in weight units: |V| = 0.5
                                     moves an element by half a grid step whatever its binade
    s      = NVFP4: E4M3_RNE(s0 * alpha), at least the smallest E4M3 subnormal where s0 > 0
             FP8 per channel / block: s0 * alpha (FP32 scales)
             FP8 per tensor (shared by the fused group) and MX (powers of two): s0
    values = the format's own encoder applied to (latent, s)  (``quant.nvfp4.reconstruct_blocks``,
             ``quant.fp8.encode_with_scale``, ``quant.mx.encode_elements``)

d0 / d are the decode steps of one element (NVFP4 ``s * (1/S)``, FP8 ``s``, MX ``2**k``). The gradient is
that of the surrogate ``R(y) * d`` with ``y = clamp(latent / d, -max, max)`` and the rounding R passing the
gradient straight through (as AutoRound and LSQ do): d(out)/d(latent) = 1 inside the range, and
d(out)/d(d) = R(y) - y inside (the rounding error in grid units), R(y) outside; the E4M3 rounding of
``s0 * alpha`` passes the gradient straight through too. With V = 0 and alpha = 1 the final codes and
scales are ``q0``'s, bit for bit.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ....formats.constants import element_format
from ....formats.e2m1 import pack_nibbles
from ....formats.fp8 import FP8_DTYPES
from ....formats.minifloat import E2M1, E4M3, FloatFormat, mul_pow2
from ....formats.ue8m0 import decode_ue8m0
from ....nn.straight_through import straight_through as straight_through_fn
from ....quant import FP8, MX, NVFP4, QuantizedTensor
from ....quant.fp8 import encode_with_scale, geometry
from ....quant.mx import BLOCK as MX_BLOCK
from ....quant.mx import element_limit, encode_elements, stored_codes
from ....quant.nvfp4 import BLOCK, e4m3_scale, encode_blocks, reconstruct_blocks

E4M3_MIN_SUBNORMAL = E4M3.min_subnormal


def spacing(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The spacing of ``fmt``'s grid at |x| (its binade's step; the subnormal step below the normals)."""
    _, e = torch.frexp(x.abs())
    e = torch.clamp(e - 1, fmt.emin, fmt.emax)
    return torch.ldexp(torch.ones_like(x), e - fmt.mbits)


def straight_through(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """``value`` exactly in the forward (signed zeros too, which ``value + (s - s.detach())`` would turn into
    +0), the gradient of ``surrogate`` (same shape) in the backward (``nn.straight_through``)."""
    value = value.detach()
    return straight_through_fn(surrogate, lambda _s: value.clone())


class Grid:
    """The grid of one weight (see the module docstring); subclasses per format."""

    fmt: FloatFormat  # the element format (its max bounds the surrogate's clamp)
    alpha_shape: Optional[tuple] = None  # the clip factors' shape; None: the scales stay at the start

    def __init__(self, weight: torch.Tensor, q0: QuantizedTensor):
        self.q0 = q0
        self.W = weight.detach().to(torch.float32)
        self.N, self.K = self.W.shape
        d0 = self.step(self.start_scales())
        x0 = torch.where(d0 > 0, self.W / torch.where(d0 > 0, d0, torch.ones_like(d0)), torch.zeros_like(d0))
        self.g = spacing(x0, self.fmt) * d0

    # -- per format
    def start_scales(self) -> torch.Tensor:
        raise NotImplementedError

    def clipped(self, alpha: torch.Tensor) -> torch.Tensor:
        """The scales for clip factors ``alpha`` (differentiable)."""
        raise NotImplementedError

    def step(self, s: torch.Tensor) -> torch.Tensor:
        """Decode step of every element [N, K] for scales ``s``."""
        raise NotImplementedError

    def values(self, latent: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """What the codes of ``latent`` with scales ``s`` dequantize to (FP32 [N, K])."""
        raise NotImplementedError

    def quantized(self, latent: torch.Tensor, s: torch.Tensor) -> QuantizedTensor:
        raise NotImplementedError

    # -- shared
    def scales(self, alpha: Optional[torch.Tensor]) -> torch.Tensor:
        return self.start_scales() if alpha is None or self.alpha_shape is None else self.clipped(alpha)

    def latent(self, V: torch.Tensor) -> torch.Tensor:
        """W + V * g, with W itself where V = 0; differentiable in V."""
        shift = V * self.g
        with torch.no_grad():
            value = torch.where(V == 0, self.W, self.W + shift)
        return straight_through(value, shift)

    def fake(self, V: torch.Tensor, alpha: Optional[torch.Tensor]) -> torch.Tensor:
        """The dequantized weight for (V, alpha): exact values, straight-through gradients."""
        s = self.scales(alpha)
        latent = self.latent(V)
        with torch.no_grad():
            exact = self.values(latent.detach(), s.detach())
        d = self.step(s)
        live = d > 0
        safe = torch.where(live, d, torch.ones_like(d))
        rounded = straight_through(exact / safe, torch.clamp(latent / safe, -self.fmt.max, self.fmt.max))
        return straight_through(exact, torch.where(live, rounded * d, torch.zeros_like(d)))

    @torch.no_grad()
    def final(self, V: torch.Tensor, alpha: Optional[torch.Tensor]) -> tuple[QuantizedTensor, torch.Tensor]:
        """(the QuantizedTensor, the latent FP32 weight whose rounding with its scales gives its codes)."""
        s = self.scales(alpha).detach()
        latent = self.latent(V).detach()
        return self.quantized(latent, s), latent


class NVFP4Grid(Grid):
    fmt = E2M1

    def __init__(self, weight, q0):
        N, K = weight.shape
        self.s0 = q0.scales.to(torch.float32).reshape(N, K // BLOCK)
        self.S = q0.outer_scale.to(torch.float32)
        self.inv_S = 1.0 / self.S
        self.alpha_shape = tuple(self.s0.shape)
        super().__init__(weight, q0)

    def start_scales(self):
        return self.s0

    def clipped(self, alpha):
        t = self.s0 * alpha
        with torch.no_grad():
            r = e4m3_scale(t)
            r = torch.where(self.s0 > 0, torch.clamp(r, min=E4M3_MIN_SUBNORMAL), torch.zeros_like(r))
        return straight_through(r, t)

    def step(self, s):
        return (s * self.inv_S).repeat_interleave(BLOCK, dim=1)

    def _blocks(self, latent, s):
        return latent.reshape(self.N, -1, BLOCK), s.reshape(self.N, -1, 1)

    def values(self, latent, s):
        return reconstruct_blocks(*self._blocks(latent, s), self.inv_S).reshape(self.N, self.K)

    def quantized(self, latent, s):
        codes = encode_blocks(*self._blocks(latent, s), self.inv_S).reshape(self.N, self.K)
        return dataclasses.replace(self.q0, codes=pack_nibbles(codes), scales=s.to(torch.float8_e4m3fn))


class FP8Grid(Grid):
    def __init__(self, weight, q0):
        spec = q0.spec
        self.element = spec.element
        self.fmt = element_format(spec.element)
        self.s0 = q0.scales.to(torch.float32)
        _, _, _, self.gm, self.gk = geometry(spec, tuple(weight.shape))
        self.alpha_shape = None if self.s0.dim() == 0 else tuple(self.s0.shape)
        super().__init__(weight, q0)

    def start_scales(self):
        return self.s0

    def clipped(self, alpha):
        return self.s0 * alpha

    def step(self, s):
        if s.dim() == 0:
            return s.expand(self.N, self.K)
        s2 = s.reshape(-(-self.N // self.gm), -(-self.K // self.gk))
        return s2.repeat_interleave(self.gm, 0)[:self.N].repeat_interleave(self.gk, 1)[:, :self.K]

    def values(self, latent, s):
        d = self.step(s)
        return encode_with_scale(latent, d, self.element) * d

    def quantized(self, latent, s):
        codes = encode_with_scale(latent, self.step(s), self.element).to(FP8_DTYPES[self.element])
        return dataclasses.replace(self.q0, codes=codes, scales=s.clone().reshape(self.q0.scales.shape))


class MXGrid(Grid):
    def __init__(self, weight, q0):
        spec = q0.spec
        N, K = weight.shape
        self.element, self.rule = spec.element, spec.scale_rule
        self.fmt = element_format(spec.element)
        self.group = MX_BLOCK
        self.k = (q0.scales.to(torch.int32) - 127).reshape(N, K // self.group)
        self.pow = decode_ue8m0(q0.scales.reshape(N, K // self.group)).to(torch.float32)
        super().__init__(weight, q0)

    def start_scales(self):
        return self.pow

    def step(self, s):
        return s.repeat_interleave(self.group, dim=1)

    def _encode(self, latent):
        k = self.k.unsqueeze(-1)
        scaled = mul_pow2(latent.reshape(self.N, -1, self.group), -k)
        limit = element_limit(k, self.element) if self.rule == "ceil" else None
        return encode_elements(scaled, self.element, "nearest", None, "hardware", limit)

    def values(self, latent, s):
        _, v = self._encode(latent)
        return (v * self.pow.unsqueeze(-1)).reshape(self.N, self.K)

    def quantized(self, latent, s):
        c, _ = self._encode(latent)
        return dataclasses.replace(self.q0, codes=stored_codes(c.reshape(self.N, self.K), self.element))


def make_grid(weight: torch.Tensor, q0: QuantizedTensor) -> Grid:
    """The grid of ``weight`` [N, K] around its start quantization ``q0`` (NVFP4 1x16 blocks, FP8, MX along
    the input features); ValueError for anything else."""
    spec = q0.spec
    if weight.dim() != 2:
        raise ValueError(f"AutoRound quantizes 2-D weights, got shape {tuple(weight.shape)}")
    if isinstance(spec, NVFP4) and not spec.block_2d and q0.outer_scale is not None \
            and q0.outer_scale.numel() == 1 and weight.shape[1] % BLOCK == 0:
        return NVFP4Grid(weight, q0)
    if isinstance(spec, FP8) and spec.granularity != "token":
        return FP8Grid(weight, q0)
    if isinstance(spec, MX) and spec.dim in (-1, 1) and weight.shape[1] % MX_BLOCK == 0:
        return MXGrid(weight, q0)
    raise ValueError(f"AutoRound has no grid for {spec!r} on a weight of shape {tuple(weight.shape)}")


__all__ = ["E4M3_MIN_SUBNORMAL", "FP8Grid", "Grid", "MXGrid", "NVFP4Grid", "make_grid", "spacing", "straight_through"]
