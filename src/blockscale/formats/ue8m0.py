"""UE8M0 (E8M0) scale codec: value 2**(b - 127), b in 0..254; 0xFF is NaN. No zero, no sign.

Exponents are computed with integer / bit operations: torch's cast to float8_e8m0fnu rounds half
up and maps overflow to NaN.
"""
from __future__ import annotations

import torch

from .minifloat import fp32_exponent, pow2

UE8M0_NAN = 255
_POW2_M127 = 2.0**-127  # b = 0 is an FP32 subnormal, outside ``pow2``'s range


def decode_ue8m0(b: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> FP32 scales 2**(b-127) (255 -> NaN)."""
    bi = b.to(torch.int32)
    v = torch.where(bi == 0, torch.full_like(bi, 1 << 22), bi << 23).view(torch.float32)
    return torch.where(bi == UE8M0_NAN, torch.full_like(v, float("nan")), v)


def ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) for positive normal FP32 ``a``: exponent field, +1 if the mantissa is non-zero."""
    bits = a.view(torch.int32)
    return fp32_exponent(a) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for positive FP32 ``a`` (subnormals give -127 or less: clamp afterwards)."""
    return fp32_exponent(a)


def _times_pow2(c: float, k: torch.Tensor) -> torch.Tensor:
    """c * 2**k in FP32 for k in [-127, 127] (exact for the element maxima used here)."""
    p = torch.where(k > -127, pow2(torch.clamp(k, min=-126)), torch.full(k.shape, _POW2_M127, device=k.device))
    return c * p


def scale_exponent_ceil(amax: torch.Tensor, max_elem: float) -> torch.Tensor:
    """Unbiased k = clamp(ceil(log2(amax / max_elem)), -127, 127) (int32), exact.

    Equivalently the smallest k in [-127, 127] with ``max_elem * 2**k >= amax``, so no element
    saturates. The ratio is formed in FP32 and its exponent read from bits (exponent field, +1 if
    the mantissa is non-zero); exact comparisons then fix the two cases the bit trick alone gets
    wrong: a ratio below the FP32 normal range, and (defensively) a ratio rounded onto a power of two.
    Zero amax gives -127.
    """
    ratio = torch.clamp(amax / max_elem, min=2.0**-126)
    k = torch.clamp(ceil_log2(ratio), -127, 127)
    k = torch.where((amax > _times_pow2(max_elem, k)) & (k < 127), k + 1, k)
    k = torch.where((k > -127) & (amax <= _times_pow2(max_elem, k - 1)), k - 1, k)
    return k


def scale_exponent_floor(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """Unbiased k = clamp(floor(log2(amax)) - emax_elem, -127, 127) (OCP MX v1.0); zero amax -> -127."""
    safe = torch.clamp(amax, min=2.0**-126)
    k = floor_log2(safe) - emax_elem
    k = torch.where(amax < 2.0**-126, torch.full_like(k, -127), k)
    return torch.clamp(k, -127, 127)


def encode_ue8m0(k: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent in [-127, 127] -> uint8 code b = k + 127."""
    return (k + 127).to(torch.uint8)
