"""S2F6: int8 x 2**-6 values in blocks of 32 with one UE8M0 scale, optionally after a 32-point random
Hadamard rotation that dequantize undoes.

    spec.py      S2F6 (the frozen spec)
    quantize.py  quantize_s2f6 / dequantize_s2f6: reference (eager), compiled and Triton paths
    storage.py   the QuantizedTensor layout and its rotation signs
"""
import torch

from ..registry import Format, register
from .quantize import BLOCK, dequantize_s2f6, quantize_s2f6
from .spec import S2F6
from .storage import check_s2f6_fields, s2f6_layout


def _quantize(x, spec, generator=None, outputs="codes", encode_scale=None):
    """The rotation is undone on dequantize: values come from dequantizing the codes (no fused path)."""
    q = quantize_s2f6(x, spec, generator)
    if outputs == "codes":
        return q
    values = dequantize_s2f6(q, torch.float32)
    return values if outputs == "values" else (q, values)


S2F6_FORMAT = register(Format(
    name="s2f6",
    spec_type=S2F6,
    quantize=_quantize,
    dequantize=dequantize_s2f6,
    layout=s2f6_layout,
    block_size=lambda spec: BLOCK,
    check_extra=check_s2f6_fields,
    fields=("signs",),
    description="int8 x 2**-6 values, a UE8M0 scale per 32, optional Hadamard rotation",
))

__all__ = ["BLOCK", "S2F6", "S2F6_FORMAT", "check_s2f6_fields", "dequantize_s2f6", "quantize_s2f6", "s2f6_layout"]
