"""The inference module that replaces a quantized nn.Linear, per PTQ scheme family: ``NVFP4Linear``
(nvfp4-*), ``FP8Linear`` (fp8-w8a8 / fp8-block), ``MXLinear`` (mxfp8 / mxfp4 / mxfp4-w4a16)."""
from __future__ import annotations

import torch
from torch import nn

from ..nn.fp8_linear import FP8Linear
from ..nn.mx_linear import MXLinear
from ..nn.nvfp4_linear import NVFP4Linear
from ..quant import QuantizedTensor
from ..quant.fp8 import scale_from_amax
from ..quant.nvfp4 import input_encode_scale


def build_linear(q: QuantizedTensor, bias, scheme, in_amax: float, dtype: torch.dtype) -> nn.Module:
    """The inference module for quantized weight ``q`` under ``scheme`` (static input scale from
    ``in_amax``, the group's calibrated input amax)."""
    fam = scheme.family
    if fam == "nvfp4":
        kw = {}
        if scheme.name == "nvfp4-w4a4":
            kw = dict(input_global_scale=input_encode_scale(in_amax, scheme.act_scale_rule),
                      input_scale_rule=scheme.act_scale_rule, input_error=scheme.error)
        return NVFP4Linear.from_quantized(q, bias, dtype=dtype, **kw)
    if fam == "fp8":
        g = scheme.stored[2]
        s_in = None
        if g == "tensor":
            s_in = scale_from_amax(torch.tensor([float(in_amax)], dtype=torch.float32), "e4m3")
        return FP8Linear.from_quantized(q, bias, input_granularity=g, input_scale=s_in, dtype=dtype)
    if fam == "mx":
        input_element = q.spec.element if scheme.quantizes_activations else None
        return MXLinear.from_quantized(q, bias, input_element=input_element, dtype=dtype)
    raise ValueError(f"scheme {scheme.name!r} keeps the Linear in high precision; there is no module to build")


__all__ = ["build_linear"]
