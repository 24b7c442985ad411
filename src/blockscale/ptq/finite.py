"""Finite parameters: PTQ refuses NaN/inf in a decoder layer (before calibrating, and after smoothing
folded scales into it), with an error naming the module and parameter."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import QuantizationError

# parameters checked for NaN/inf (float8 scales of layers that are already NVFP4 are checked on load)
_CHECKED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_finite_parameters(layers: nn.ModuleList, prefix: str) -> None:
    """QuantizationError naming the module and parameter when a decoder-layer parameter is NaN/inf."""
    for i, layer in enumerate(layers):
        for mname, m in layer.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if p.dtype in _CHECKED_DTYPES and not bool(torch.isfinite(p.detach()).all()):
                    raise non_finite_error(f"{prefix}.{i}" + (f".{mname}" if mname else ""), pname, p)


def non_finite_error(module: str, param: str, p: torch.Tensor, when: str = "") -> QuantizationError:
    bad = int((~torch.isfinite(p.detach())).sum())
    return QuantizationError(f"{module}: {param} contains NaN/inf{when} ({bad} of {p.numel()} values); PTQ needs "
                             "finite parameters: repair the checkpoint, or keep the module out of PTQ with "
                             "exclude=[...] if it is a Linear")


__all__ = ["check_finite_parameters", "non_finite_error"]
