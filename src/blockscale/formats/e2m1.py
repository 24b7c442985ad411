"""E2M1 (FP4) element codec: values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, code = sign<<3 | index.

Two codes share a byte along the last dim: element 2i in the low nibble, 2i+1 in the high one
([1.0, 6.0] packs to 0x72).
"""
from __future__ import annotations

import torch

from .minifloat import E2M1, round_magnitude, sign_bit

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_LUT = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 decoded values indexed by code (code 8 is -0.0)."""
    return _LUT.to(device)


def e2m1_index(v: torch.Tensor) -> torch.Tensor:
    """Index 0..7 of a magnitude already on the E2M1 grid (uint8)."""
    idx = torch.where(v < 2.0, v * 2.0, torch.where(v < 4.0, v + 2.0, v * 0.5 + 4.0))
    return idx.to(torch.uint8)


def encode_e2m1(
    x: torch.Tensor, rounding: str = "nearest", rand: torch.Tensor | None = None, sr_mode: str = "hardware",
    limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP32 ``x`` -> E2M1 codes (uint8, unpacked). Rounds as ``round_magnitude``; saturates at ±6
    (or at ±``limit``, E2M1 grid values)."""
    v = round_magnitude(torch.abs(x), E2M1, rounding, rand, sr_mode, limit)
    return e2m1_index(v) | (sign_bit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> FP32 values."""
    return e2m1_lut(codes.device)[(codes & 0xF).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] 4-bit codes -> [..., n] bytes, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] 4-bit codes (inverse of ``pack_nibbles``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
