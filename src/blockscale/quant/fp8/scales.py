"""FP8 numerics, one implementation each (FP32, elementwise; used by every path):

    s  = amax / max_elem             (448 E4M3, 57344 E5M2); s = 1 where that is 0 (a zero amax, or
                                     amax < max_elem * 2**-150, where the quotient underflows)
    q  = round(clamp(x / s, -max_elem, max_elem))     RNE or stochastic onto the element grid
    x^ = q * s

``x / s`` is a true FP32 division, as compressed-tensors' ``_quantize`` computes it (``scaled = x /
scale``), not ``x * (1/s)`` (which changes rare ties by one code). The clamp comes before rounding:
torch's E5M2 cast does not saturate (61440 -> inf), and ``round_fp8`` saturates as well.
"""
from __future__ import annotations

import torch

from ...formats.fp8 import FP8_FORMATS, round_fp8
from .spec import FP8_MAX


def scale_from_amax(amax: torch.Tensor, element: str) -> torch.Tensor:
    """FP32 dequantization scale ``s = amax / max_elem`` (1 where it is 0)."""
    s = amax.to(torch.float32) / FP8_MAX[element]
    return torch.where(s == 0, torch.ones_like(s), s)


def encode_with_scale(x: torch.Tensor, s: torch.Tensor, element: str, rounding: str = "nearest",
                      rand: torch.Tensor | None = None, sr_mode: str = "hardware") -> torch.Tensor:
    """FP32 element values ``round(clamp(x / s, -max_elem, max_elem))`` (exactly representable in the
    element's torch float8 dtype) for finite ``x`` and FP32 scales ``s`` broadcasting to it.
    ``rand``: stochastic rounding's random numbers (see ``formats.minifloat.round_magnitude``)."""
    m = FP8_MAX[element]
    y = torch.clamp(x.to(torch.float32) / s, -m, m)
    return round_fp8(y, FP8_FORMATS[element], rounding, rand, sr_mode)


def dequantize_values(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x^ = q * s`` in FP32 (``v``: element values or float8 codes; ``s`` broadcasting to them)."""
    return v.to(torch.float32) * s


__all__ = ["dequantize_values", "encode_with_scale", "scale_from_amax"]
