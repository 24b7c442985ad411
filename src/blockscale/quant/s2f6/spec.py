"""The S2F6 spec: a frozen dataclass saying how a tensor is quantized to S2F6."""
from __future__ import annotations

from dataclasses import dataclass

from ..spec_checks import check_choice as _check, check_rounding as _check_rounding
from ..mx.spec import MX_SCALE_RULES


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


__all__ = ["S2F6"]
