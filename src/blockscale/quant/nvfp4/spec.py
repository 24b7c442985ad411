"""The NVFP4 spec: a frozen dataclass saying how a tensor is quantized to NVFP4."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from ..spec_checks import check_choice as _check, check_rounding as _check_rounding


NVFP4_SCALE_RULES = ("6", "4over6", "4", "sweep")
NVFP4_ERRORS = ("mse", "mae", "maxabs")
NVFP4_OUTERS = ("tensor", "row", "group")


@dataclass(frozen=True)
class NVFP4:
    """NVFP4: E2M1 values, one E4M3 scale per 16 values along the last dim, an FP32 outer scale.

    scale_rule: "6" (block amax maps to 6, outer bound 448), "4over6" (per block, the scale-to-4 or
      scale-to-6 candidate with the lower ``error``; outer bound 256), "4" (always the scale-to-4
      candidate of 4/6), "sweep" (all 126 positive E4M3 block scales, least squared error, outer
      bound 448).
    error: the 4/6 block error: "mse" (sum d^2), "mae" (sum |d|), "maxabs" (max |d|).
    outer: "tensor" (one amax), "row" (per token: one per row of the last dim), "group" (one per
      slice of dim 0, e.g. per expert), or a positive float: a calibrated amax.
    block_2d: 16x16 tiles over the last two dims (weights), so dequantize(W).T == that of W.T.
    rounding / sr_mode: element rounding ("nearest" = RNE, or "stochastic"); block scales are RNE.
    """

    scale_rule: str = "6"
    error: str = "mse"
    outer: Union[str, float] = "tensor"
    block_2d: bool = False
    rounding: str = "nearest"
    sr_mode: str = "hardware"

    block_size = 16  # class constant, not a field

    def __post_init__(self):
        _check("scale_rule", self.scale_rule, NVFP4_SCALE_RULES)
        _check("error", self.error, NVFP4_ERRORS)
        if isinstance(self.outer, str):
            _check("outer", self.outer, NVFP4_OUTERS)
        elif isinstance(self.outer, bool) or not isinstance(self.outer, (int, float)):
            raise ValueError(f"outer={self.outer!r}: expected 'tensor', 'row', 'group' or a positive float amax")
        elif not (math.isfinite(self.outer) and self.outer > 0):
            raise ValueError(f"outer={self.outer!r}: a calibrated amax must be a positive finite float")
        if not isinstance(self.block_2d, bool):
            raise ValueError(f"block_2d={self.block_2d!r}: expected True or False")
        if self.block_2d and self.outer == "row":
            raise ValueError("block_2d=True needs one outer scale per 16x16 tile: use outer='tensor', "
                             "'group' or a float, not 'row'")
        _check_rounding(self.rounding, self.sr_mode)
        if self.scale_rule == "sweep" and self.rounding != "nearest":
            raise ValueError("scale_rule='sweep' is a least-squares search and needs rounding='nearest'")

    @property
    def outer_bound(self) -> float:
        """Largest block scale the outer scale maps the tensor amax to: 256 for 4/6 and 4, else 448."""
        return 256.0 if self.scale_rule in ("4over6", "4") else 448.0


__all__ = ["NVFP4", "NVFP4_ERRORS", "NVFP4_OUTERS", "NVFP4_SCALE_RULES"]
