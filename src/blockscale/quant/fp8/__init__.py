"""FP8 (E4M3 / E5M2 with FP32 scales per tensor, channel, token or 128x128 / 1x128 block): a format
added through the registry only (spec, layout, scales, kernels, quantize / dequantize, this file)."""
from ..registry import Format, register
from .layout import check_layout, check_no_extra, geometry, layout, scales_shape
from .quantize import dequantize_fp8, quantize_fp8
from .scales import dequantize_values, encode_with_scale, scale_from_amax
from .spec import FP8, FP8_BLOCK_SHAPES, FP8_ELEMENTS, FP8_GRANULARITIES, FP8_MAX


def block_size(spec: FP8) -> int:
    """Elements per scale along the last dim: 128 for blocks, 0 (the whole dim / tensor) otherwise."""
    return spec.block_shape[1] if spec.granularity == "block" else 0


def scale_rows(spec: FP8) -> int:
    """Rows one row of a 2-D weight's scales covers: 0 per tensor (no row dim), 1 per channel / token /
    1x128, 128 for 128x128 tiles."""
    return 0 if spec.group_shape is None else spec.group_shape[0]


FORMAT = register(Format(
    name="fp8",
    spec_type=FP8,
    quantize=quantize_fp8,
    dequantize=dequantize_fp8,
    layout=layout,
    block_size=block_size,
    scale_rows=scale_rows,
    check_extra=check_no_extra,
    description="E4M3 / E5M2 codes, FP32 scale amax/max per tensor, channel, token or 128x128 / 1x128 block",
))

__all__ = [
    "FORMAT", "FP8", "FP8_BLOCK_SHAPES", "FP8_ELEMENTS", "FP8_GRANULARITIES", "FP8_MAX", "check_layout",
    "check_no_extra", "dequantize_fp8", "dequantize_values", "encode_with_scale", "geometry", "layout",
    "quantize_fp8", "scale_from_amax", "scales_shape",
]
