"""E4M3 (float8_e4m3fn) and E5M2 element codecs.

Rounding is done by ``round_magnitude`` (bit arithmetic), never by torch's casts: torch's E5M2
cast overflows to inf instead of saturating. The rounded FP32 value is exactly representable, so
the final cast to the torch float8 dtype is exact.
"""
from __future__ import annotations

import torch

from .minifloat import E4M3, E5M2, FloatFormat, round_to_format

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def round_fp8(
    x: torch.Tensor, fmt: FloatFormat, rounding: str = "nearest", rand: torch.Tensor | None = None,
    sr_mode: str = "hardware", limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Finite FP32 ``x`` rounded onto the E4M3 / E5M2 grid (FP32 result, saturating at ``fmt.max``,
    or at ``limit``: see ``minifloat.round_magnitude``)."""
    return round_to_format(x, fmt, rounding, rand, sr_mode, limit)


def encode_fp8(x: torch.Tensor, element: str, rounding: str = "nearest", rand=None, sr_mode="hardware"):
    """Finite FP32 ``x`` -> torch float8 tensor (``element`` is "e4m3" or "e5m2")."""
    return round_fp8(x, FP8_FORMATS[element], rounding, rand, sr_mode).to(FP8_DTYPES[element])


def decode_fp8(codes: torch.Tensor) -> torch.Tensor:
    """torch float8 tensor (or its uint8 bit view with ``dtype``) -> FP32."""
    return codes.to(torch.float32)
