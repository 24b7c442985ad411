"""The calibrated activation (input) encode scale of an NVFP4 W4A4 layer, and the fixed point it is snapped to."""
from __future__ import annotations

import torch

from .scales import outer_scale
from .spec import NVFP4

INPUT_SCALE_RULES = ("6", "4over6")


def reciprocal_fixed_point(scale: torch.Tensor) -> torch.Tensor:
    """The FP32 scale S' = 1/(1/S) (each division rounded), a value with 1/(1/S') == S' bit for bit.

    A checkpoint may store an encode scale S (compressed-tensors) or its reciprocal (ModelOpt);
    calibrated activation scales are snapped to such a fixed point so both formats reload to the
    same S. (fl(1/fl(1/fl(1/x)))) == fl(1/x) for every positive finite FP32 x.)
    """
    s = scale.to(torch.float32)
    return 1.0 / (1.0 / s)


def input_encode_scale(input_amax: float, scale_rule: str = "6") -> torch.Tensor:
    """Calibrated activation encode scale: S = bound*6/amax (bound 448, or 256 for 4/6), snapped by
    ``reciprocal_fixed_point``; shape [1] FP32."""
    if scale_rule not in INPUT_SCALE_RULES:
        raise ValueError(f"input scale_rule={scale_rule!r}; allowed values: {', '.join(INPUT_SCALE_RULES)}")
    amax = torch.tensor([float(input_amax)], dtype=torch.float32)
    if not (torch.isfinite(amax).all() and float(amax) >= 0):
        raise ValueError(f"input_amax={input_amax!r}: must be a finite value >= 0")
    bound = NVFP4(scale_rule=scale_rule).outer_bound
    return reciprocal_fixed_point(outer_scale(amax, bound))


__all__ = ["INPUT_SCALE_RULES", "input_encode_scale", "reciprocal_fixed_point"]
