"""The inference module that replaces a quantized nn.Linear under its PTQ scheme: the quantized Linear
class of the scheme's stored kind (``nn.QuantizedInferenceLinear.class_for``: ``NVFP4Linear``,
``FP8Linear``, ``MXLinear``), built by its ``from_scheme``."""
from __future__ import annotations

import torch
from torch import nn

from ..nn.quantized_linear import QuantizedInferenceLinear
from ..nn.quantized_modules import QUANTIZED_LINEAR_TYPES  # noqa: F401  (every class registers its kind)
from ..quant import QuantizedTensor


def build_linear(q: QuantizedTensor, bias, scheme, in_amax: float, dtype: torch.dtype) -> nn.Module:
    """The inference module for quantized weight ``q`` under ``scheme`` (static input scale from
    ``in_amax``, the group's calibrated input amax)."""
    if scheme.stored is None:
        raise ValueError(f"scheme {scheme.name!r} keeps the Linear in high precision; there is no module to build")
    return QuantizedInferenceLinear.class_for(scheme.stored[0]).from_scheme(q, bias, scheme, in_amax, dtype)


__all__ = ["build_linear"]
