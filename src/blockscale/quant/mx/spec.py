"""The MX spec: a frozen dataclass saying how a tensor is quantized to MX (OCP microscaling)."""
from __future__ import annotations

from dataclasses import dataclass

from ..spec_checks import check_choice as _check, check_rounding as _check_rounding


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


__all__ = ["MX", "MX_ELEMENTS", "MX_SCALE_RULES"]
