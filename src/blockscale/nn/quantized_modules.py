"""The quantized inference Linears a PTQ model / checkpoint holds (one per weight format)."""
from __future__ import annotations

from torch import nn

from .fp8_linear import FP8Linear
from .mx_linear import MXLinear
from .nvfp4_linear import NVFP4Linear

#: every quantized Linear type: each has in_features / out_features / bias, from_quantized,
#: quantized_weight(), dequantized_weight(dtype), quantize_input(x) and scheme_name
QUANTIZED_LINEAR_TYPES = (NVFP4Linear, FP8Linear, MXLinear)


def is_quantized_linear(m: nn.Module) -> bool:
    """True for an NVFP4Linear, FP8Linear or MXLinear."""
    return isinstance(m, QUANTIZED_LINEAR_TYPES)


__all__ = ["QUANTIZED_LINEAR_TYPES", "is_quantized_linear"]
