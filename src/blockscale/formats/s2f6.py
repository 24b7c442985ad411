"""S2F6 element codec: int8 two's complement x 2**-6, values -2.0 ... 127/64 (the OCP MXINT8 grid).

RNE (or stochastic) on the magnitude, then saturation to ±127/64 (symmetric: -128 is never
produced, as MX emulators do).
"""
from __future__ import annotations

import torch

from .minifloat import round_integer, sign_bit

S2F6_MAX = 127.0 / 64.0
S2F6_MAX_CODE = 127


def encode_s2f6(
    x: torch.Tensor, rounding: str = "nearest", rand: torch.Tensor | None = None, sr_mode: str = "hardware"
) -> torch.Tensor:
    """Finite FP32 ``x`` -> int8 codes ``round(x * 64)`` saturated to ±127."""
    r = round_integer(torch.abs(x) * 64.0, rounding, rand, sr_mode)
    r = torch.clamp(r, max=float(S2F6_MAX_CODE))
    return torch.where(sign_bit(x), -r, r).to(torch.int8)


def decode_s2f6(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -> FP32 values code / 64."""
    return codes.to(torch.float32) * (1.0 / 64.0)
