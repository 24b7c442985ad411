"""Format specs: frozen dataclasses saying how a tensor is quantized (the building blocks of recipes)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from ..formats.minifloat import ROUNDING_MODES, SR_MODES


def _check(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


def _check_rounding(rounding: str, sr_mode: str) -> None:
    _check("rounding", rounding, ROUNDING_MODES)
    _check("sr_mode", sr_mode, SR_MODES)


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


MX_ELEMENTS = ("e4m3", "e5m2", "e2m1")
MX_SCALE_RULES = ("ceil", "floor")


@dataclass(frozen=True)
class MX:
    """MX (OCP microscaling): one UE8M0 scale per 32 values along ``dim``.

    element: "e4m3" / "e5m2" (MXFP8) or "e2m1" (MXFP4).
    scale_rule: "ceil" (TE / cuBLAS, torchao RCEIL: 2**ceil(log2(amax/max_elem)), saturating only
      near FLT_MAX: an element is at most the largest v with v * scale <= FLT_MAX, so x^ stays finite)
      or "floor" (OCP v1.0: 2**(floor(log2 amax) - emax_elem), elements saturate).
    """

    element: str = "e4m3"
    scale_rule: str = "ceil"
    rounding: str = "nearest"
    sr_mode: str = "hardware"
    dim: int = -1

    block_size = 32

    def __post_init__(self):
        _check("element", self.element, MX_ELEMENTS)
        _check("scale_rule", self.scale_rule, MX_SCALE_RULES)
        _check_rounding(self.rounding, self.sr_mode)
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ValueError(f"dim={self.dim!r}: expected an int")


@dataclass(frozen=True)
class S2F6:
    """S2F6: int8 x 2**-6 values in blocks of 32 with one UE8M0 scale, optionally after a 32-point
    random Hadamard rotation (signs drawn from ``seed``) that dequantize undoes.

    scale_rule: "ceil" (default, 2**ceil(log2(amax / (127/64))), saturating only blocks with amax
      above 127/64 * 2**127, where the exponent reaches its cap 127) or "floor"
      (OCP MXINT8: 2**floor(log2 amax), values saturate at ±127/64).
    seed: an int in [-2**63, 2**64 - 1] (``torch.Generator.manual_seed``'s range).
    """

    hadamard: bool = True
    seed: int = 0
    scale_rule: str = "ceil"
    rounding: str = "nearest"
    sr_mode: str = "hardware"

    block_size = 32

    def __post_init__(self):
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"hadamard={self.hadamard!r}: expected True or False")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: expected an int")
        if not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError(f"seed={self.seed}: expected an int in [-2**63, 2**64 - 1] "
                             "(the seeds torch.Generator.manual_seed accepts)")
        _check("scale_rule", self.scale_rule, MX_SCALE_RULES)
        _check_rounding(self.rounding, self.sr_mode)


FormatSpec = Union[NVFP4, MX, S2F6]
