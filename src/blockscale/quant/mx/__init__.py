"""MX (OCP microscaling): MXFP8 (E4M3 / E5M2) or MXFP4 (E2M1) elements, one UE8M0 scale per 32 values.

    spec.py      MX (the frozen spec) and its allowed values
    scales.py    block exponent per rule ("ceil" / "floor"), element limit near FLT_MAX
    quantize.py  quantize_mx / dequantize_mx: reference (eager), compiled and Triton paths
    storage.py   the QuantizedTensor layout
"""
from ...formats.fp8 import FP8_DTYPES, FP8_FORMATS
from ..registry import Format, register
from .quantize import dequantize_mx, encode_elements, quantize_mx, quantize_mx_blocks, stored_codes
from .scales import BLOCK, block_exponent, element_limit
from .spec import MX, MX_ELEMENTS, MX_SCALE_RULES
from .storage import CODE_DTYPES, mx_layout


def _quantize(x, spec, generator=None, outputs="codes", encode_scale=None):
    return quantize_mx(x, spec, generator, outputs)


MX_FORMAT = register(Format(
    name="mx",
    spec_type=MX,
    quantize=_quantize,
    dequantize=dequantize_mx,
    layout=mx_layout,
    block_size=lambda spec: BLOCK,
    blocked_dim=lambda spec: spec.dim,
    blocks_along_any_dim=True,
    description="MXFP8 / MXFP4 elements, a UE8M0 scale per 32",
))

__all__ = ["BLOCK", "CODE_DTYPES", "FP8_DTYPES", "FP8_FORMATS", "MX", "MX_ELEMENTS", "MX_FORMAT", "MX_SCALE_RULES",
           "block_exponent", "dequantize_mx", "element_limit", "encode_elements", "mx_layout", "quantize_mx",
           "quantize_mx_blocks", "stored_codes"]
