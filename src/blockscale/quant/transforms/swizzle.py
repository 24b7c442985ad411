"""cuBLAS / CUTLASS block-scaling layout for scale factors ("128x4" swizzle).

Pad rows to 128 and scale columns to 4 (with zeros), then
``view(M/128, 4, 32, K/4, 4).permute(0, 3, 2, 1, 4)``: 128x4 tiles in row-major tile order, and
inside a tile row r, column c sits at offset ``(r % 32) * 16 + (r // 32) * 4 + c``.
Tensors with more than 2 dims are swizzled per leading index (e.g. per expert).
"""
from __future__ import annotations

import torch

from ..blocking import pad_dim


def _tile_perm(n_lead: int) -> list[int]:
    """permute(0, 3, 2, 1, 4) after ``n_lead`` leading dims (it is its own inverse)."""
    return list(range(n_lead)) + [n_lead + i for i in (0, 3, 2, 1, 4)]


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[..., M, K] scales -> [..., ceil(M/128)*128 * ceil(K/4)*4] flat swizzled (same dtype)."""
    if scales.dim() < 2:
        raise ValueError(f"swizzle_scales needs a [..., rows, cols] tensor, got shape {tuple(scales.shape)}")
    raw = scales.view(torch.uint8) if scales.dtype.itemsize == 1 and scales.dtype != torch.uint8 else scales
    p = pad_dim(pad_dim(raw, -2, 128), -1, 4)
    *lead, m, k = p.shape
    out = p.reshape(*lead, m // 128, 4, 32, k // 4, 4).permute(*_tile_perm(len(lead))).reshape(*lead, m * k)
    return out.view(scales.dtype) if raw is not scales else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales``: [..., Mp*Kp] -> [..., rows, cols] (padding dropped)."""
    mp, kp = -(-rows // 128) * 128, -(-cols // 4) * 4
    if swizzled.shape[-1] != mp * kp:
        raise ValueError(f"unswizzle_scales: last dim {swizzled.shape[-1]} != {mp}*{kp} for rows={rows}, cols={cols}")
    raw = swizzled.view(torch.uint8) if swizzled.dtype.itemsize == 1 and swizzled.dtype != torch.uint8 else swizzled
    lead = raw.shape[:-1]
    t = raw.reshape(*lead, mp // 128, kp // 4, 32, 4, 4).permute(*_tile_perm(len(lead)))
    out = t.reshape(*lead, mp, kp)[..., :rows, :cols].contiguous()
    return out.view(swizzled.dtype) if raw is not swizzled else out
