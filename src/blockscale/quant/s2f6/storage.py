"""What an S2F6 QuantizedTensor stores: int8 codes, UE8M0 scales, and the rotation signs."""
from __future__ import annotations

import torch

from ..layout import check_tensor, padded_blocks
from .quantize import BLOCK


def s2f6_layout(spec, shape: tuple) -> dict:
    """codes lead + (Kp,) int8, scales lead + (Kp/32,) uint8 (UE8M0)."""
    lead, Kp = padded_blocks(shape, -1, BLOCK)
    return {"codes": (lead + (Kp,), torch.int8), "scales": (lead + (Kp // BLOCK,), torch.uint8)}


def check_s2f6_fields(q) -> None:
    """ValueError unless q.signs is the (32,) rotation signs with hadamard=True and None without."""
    if q.spec.hadamard and q.signs is None:
        raise ValueError("q.signs is missing: S2F6(hadamard=True) needs the 32 rotation signs to undo the rotation")
    if not q.spec.hadamard and q.signs is not None:
        raise ValueError("q.signs is set but the spec has hadamard=False: expected None (no rotation to undo)")
    if q.signs is not None:
        check_tensor(q.signs, "q.signs")
        if tuple(q.signs.shape) != (BLOCK,):
            raise ValueError(f"q.signs has shape {tuple(q.signs.shape)}; expected ({BLOCK},)")


__all__ = ["check_s2f6_fields", "s2f6_layout"]
