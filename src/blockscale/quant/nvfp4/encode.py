"""NVFP4 elements with given scales: E2M1 codes, reconstructed values and the per-block error of a
candidate block scale, one implementation of each formula.

For blocks xb [..., 16] (FP32), block scales s [..., 1] and inv_s = 1/S (a true FP32 division):

    e  = min(1 / (s * inv_s), FLT_MAX)      0 where s = 0               encode_multiplier
    v  = e2m1(|clamp(xb * e, -6, 6)|)        RNE or stochastic           rounded_magnitudes
    c  = e2m1_index(v) | sign << 3           unpacked 4-bit codes        e2m1_codes / encode_blocks
    x^ = (+-v * s) * inv_s                                               reconstruct_blocks

``rand`` holds the stochastic-rounding randoms (None for "nearest", see ``blocking.draw_random``).
"""
from __future__ import annotations

import torch

from ...formats.e2m1 import e2m1_index
from ...formats.minifloat import E2M1, round_magnitude, sign_bit
from ..block_error import block_error_terms, tile_error
from .scales import BLOCK, FLT_MAX


def encode_multiplier(s: torch.Tensor, inv_s: torch.Tensor) -> torch.Tensor:
    """e = min(1 / (s * inv_s), FLT_MAX), and 0 where the block scale s is 0."""
    e = torch.clamp(1.0 / (s * inv_s), max=FLT_MAX)
    return torch.where(s == 0, torch.zeros_like(e), e)


def rounded_magnitudes(xb, s, inv_s, rand=None, rounding: str = "nearest", sr_mode: str = "hardware"):
    """(neg, v): the sign bits of ``xb`` and the rounded E2M1 magnitudes v = e2m1(|clamp(xb*e, -6, 6)|)."""
    e = encode_multiplier(s, inv_s)
    v = round_magnitude(torch.abs(torch.clamp(xb * e, -6.0, 6.0)), E2M1, rounding, rand, sr_mode)
    return sign_bit(xb), v


def e2m1_codes(neg: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unpacked 4-bit E2M1 codes (uint8): the magnitude index of v with the sign in bit 3."""
    return e2m1_index(v) | (neg.to(torch.uint8) << 3)


def encode_blocks(xb, s, inv_s, rand=None, rounding: str = "nearest", sr_mode: str = "hardware"):
    """E2M1 codes (uint8, unpacked, xb's shape) of blocks ``xb`` [..., 16] with block scales ``s`` [..., 1]."""
    return e2m1_codes(*rounded_magnitudes(xb, s, inv_s, rand, rounding, sr_mode))


def reconstruct_blocks(xb, s, inv_s, rand=None, rounding: str = "nearest", sr_mode: str = "hardware"):
    """Dequantized values x^ = (q * s) * (1/S) of blocks ``xb`` with block scales ``s``."""
    neg, v = rounded_magnitudes(xb, s, inv_s, rand, rounding, sr_mode)
    return (torch.where(neg, -v, v) * s) * inv_s


def candidate_error(xb, s, inv_s, rand=None, rounding: str = "nearest", sr_mode: str = "hardware",
                    error: str = "mse", block_2d: bool = False):
    """Per-block error [..., R, nb] of quantizing blocks ``xb`` [R, nb, 16] with scales ``s`` [..., R, nb, 1]
    (leading dims of ``s`` = several candidates at once).

    1D: position by position (``block_error_terms``); 2D: per 16x16 tile (``tile_error``),
    broadcast back to the tile's 16 rows.
    """
    if not block_2d:
        rs = [None] * BLOCK if rand is None else rand.unbind(-1)
        sq, inv = s.squeeze(-1), inv_s.squeeze(-1)
        ds = [reconstruct_blocks(c, sq, inv, r, rounding, sr_mode) - c for c, r in zip(xb.unbind(-1), rs)]
        return block_error_terms(ds, error)
    d = reconstruct_blocks(xb, s, inv_s, rand, rounding, sr_mode) - xb
    *c, r, nb, _ = d.shape
    tiles = d.view(*c, r // BLOCK, BLOCK, nb, BLOCK).transpose(-3, -2)
    err = tile_error(tiles, error)  # [..., r/16, nb]
    return err.unsqueeze(-2).expand(*c, r // BLOCK, BLOCK, nb).reshape(*c, r, nb)


def choose_4over6(xb, s6, s4, inv_s, rand=None, rounding: str = "nearest", sr_mode: str = "hardware",
                  error: str = "mse", block_2d: bool = False):
    """Rule "4over6": per block, s4 where its error is strictly lower than s6's, else s6 (ties keep 6)."""
    # both candidates in one broadcast pass: [2, R, nb, 1] scales -> [2, R, nb] errors
    err = candidate_error(xb, torch.stack((s6, s4)), inv_s, rand, rounding, sr_mode, error, block_2d)
    return torch.where((err[1] < err[0]).unsqueeze(-1), s4, s6)


def block_outputs(xb, s, inv_s, rand, rounding: str, sr_mode: str, outputs: str):
    """(unpacked codes [R, nb*16] or None, scales [R, nb], values [R, nb*16] or None) of blocks
    ``xb`` [R, nb, 16] with chosen scales ``s`` [R, nb, 1]; ``outputs`` is "codes", "values" or "both"."""
    r = xb.shape[0]
    codes = encode_blocks(xb, s, inv_s, rand, rounding, sr_mode).reshape(r, -1) if outputs != "values" else None
    xhat = reconstruct_blocks(xb, s, inv_s, rand, rounding, sr_mode).reshape(r, -1) if outputs != "codes" else None
    return codes, s.squeeze(-1), xhat


__all__ = ["block_outputs", "candidate_error", "choose_4over6", "e2m1_codes", "encode_blocks", "encode_multiplier",
           "reconstruct_blocks", "rounded_magnitudes"]
