"""What an NVFP4 QuantizedTensor stores: its layout and the check of its outer scale."""
from __future__ import annotations

import torch

from ..layout import block_dims, check_tensor, padded_blocks
from .scales import BLOCK


def nvfp4_layout(spec, shape: tuple) -> dict:
    """codes lead + (Kp/2,) uint8 (two E2M1 per byte), scales lead + (Kp/16,) float8_e4m3fn."""
    lead, Kp = padded_blocks(shape, -1, BLOCK)
    return {"codes": (lead + (Kp // 2,), torch.uint8), "scales": (lead + (Kp // BLOCK,), torch.float8_e4m3fn)}


def check_nvfp4_fields(q) -> None:
    """ValueError unless q.outer_scale is a tensor broadcastable to lead + (1,)."""
    shape = tuple(q.shape)
    if q.outer_scale is None:
        raise ValueError(f"q.outer_scale is missing: an NVFP4 tensor needs its FP32 outer scale (shape {shape})")
    check_tensor(q.outer_scale, "q.outer_scale")
    want = block_dims(shape)[0] + (1,)
    try:
        fits = torch.broadcast_shapes(tuple(q.outer_scale.shape), want) == want
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"q.outer_scale has shape {tuple(q.outer_scale.shape)}; expected a shape that "
                         f"broadcasts to {want} for an NVFP4 tensor of shape {shape}")


__all__ = ["check_nvfp4_fields", "nvfp4_layout"]
