"""``method="rtn"``: round to nearest with the scale rule; no statistics, no transform (calibration only
for W4A4's activation outer scale)."""
from __future__ import annotations

from dataclasses import dataclass

from ..protocol import PTQMethod


@dataclass(frozen=True)
class RTNOptions:
    """RTN has no options of its own (the scale rule is ``PTQConfig.scale_rule``)."""


class RTN(PTQMethod):
    """Every step is the protocol's default: record nothing, leave the layer, ``quantize``."""

    name = "rtn"
    Options = RTNOptions
    flag_prefix = "rtn"
    calibrates = False
    quantizes_fused_experts = True


__all__ = ["RTN", "RTNOptions"]
