"""What an MX QuantizedTensor stores (codes and scales with ``spec.dim`` moved last)."""
from __future__ import annotations

import torch

from ...formats.constants import code_width
from ..layout import padded_blocks
from .scales import BLOCK

CODE_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.uint8}


def mx_layout(spec, shape: tuple) -> dict:
    """codes lead + (Kp,) float8 (E4M3 / E5M2) or lead + (Kp/2,) uint8 (E2M1), scales lead + (Kp/32,) uint8."""
    lead, Kp = padded_blocks(shape, spec.dim, BLOCK)
    return {"codes": (lead + (code_width(spec.element, Kp),), CODE_DTYPES[spec.element]),
            "scales": (lead + (Kp // BLOCK,), torch.uint8)}


__all__ = ["CODE_DTYPES", "mx_layout"]
