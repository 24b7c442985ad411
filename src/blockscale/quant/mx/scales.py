"""MX block scales: the UE8M0 exponent of a block from its amax, and the element limit near FLT_MAX.

    k     = ceil(log2(block_amax / max_elem))      "ceil"
          = floor(log2(block_amax)) - emax_elem     "floor"
    v_lim = min(max_elem, (2 - 2**-m) * 2**(127 - k))
"""
from __future__ import annotations

import torch

from ...formats.constants import MX_BLOCK, element_format
from ...formats.minifloat import pow2
from ...formats.ue8m0 import scale_exponent_ceil, scale_exponent_floor

BLOCK = MX_BLOCK


def block_exponent(amax: torch.Tensor, rule: str, max_elem: float, emax_elem: int) -> torch.Tensor:
    """Unbiased UE8M0 exponent k (int32) of each block from its amax, by ``rule`` ("ceil" | "floor")."""
    if rule == "ceil":
        return scale_exponent_ceil(amax, max_elem)
    return scale_exponent_floor(amax, emax_elem)


def element_limit(k: torch.Tensor, element: str) -> torch.Tensor:
    """v_lim(k) = min(max_elem, (2 - 2**-m) * 2**min(127 - k, emax_elem)) (FP32, k's shape): the
    largest element v with v * 2**k <= FLT_MAX = (2 - 2**-23) * 2**127, for k in [-127, 127].

    (2 - 2**-m) * 2**e is the top of binade e (a full binade below emax_elem); for k <= 127 -
    emax_elem it is >= max_elem, so v_lim = max_elem there. Built exactly as 2**(e+1) - 2**(e-m).
    """
    fmt = element_format(element)
    e = torch.clamp(127 - k, max=fmt.emax)
    m = fmt.mbits
    return torch.clamp(pow2(e + 1) - pow2(e - m), max=fmt.max)


__all__ = ["BLOCK", "block_exponent", "element_limit"]
