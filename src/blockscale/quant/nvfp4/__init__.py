"""NVFP4: E2M1 values, one E4M3 scale per 16 values along the last dim, an FP32 outer scale.

    spec.py         NVFP4 (the frozen spec) and its allowed values
    scales.py       outer scale <-> amax, shared / group outer scales, encode-scale validation, block scales
    encode.py       encode with given scales (RNE / SR), reconstruct, per-block error of a candidate, 4-over-6
    sweep.py        the "sweep" rule (reference loop and all-candidates-at-once)
    weighted.py     Hessian-aware block scales (d-weighted sweep / 4-over-6; the pruned exact sweep)
    input_scale.py  the calibrated activation encode scale
    quantize.py     quantize_nvfp4 / dequantize_nvfp4: reference (eager), compiled and Triton paths
    storage.py      the QuantizedTensor layout
"""
from ..registry import Format, register
from .encode import (block_outputs, candidate_error, choose_4over6, e2m1_codes, encode_blocks, encode_multiplier,
                     reconstruct_blocks, rounded_magnitudes)
from .input_scale import INPUT_SCALE_RULES, input_encode_scale, reciprocal_fixed_point
from .quantize import dequantize_nvfp4, outer_scales, quantize_nvfp4, triton_supports
from .scales import (BLOCK, FLT_MAX, FLT_MIN_NORMAL, amax_of_outer_scale, block_amax, block_scales,
                     e4m3_positive_values, e4m3_scale, encode_scale_tensor, group_amax, outer_scale,
                     shared_outer_scale)
from .spec import NVFP4, NVFP4_ERRORS, NVFP4_OUTERS, NVFP4_SCALE_RULES
from .storage import check_nvfp4_fields, nvfp4_layout
from .sweep import sweep_block_scales, sweep_blocks, sweep_finish, sweep_init, sweep_step
from .weighted import WEIGHTED_RULES, check_channel_weights, quantize_weighted, weighted_block_scales

NVFP4_FORMAT = register(Format(
    name="nvfp4",
    spec_type=NVFP4,
    quantize=quantize_nvfp4,
    dequantize=dequantize_nvfp4,
    layout=nvfp4_layout,
    block_size=lambda spec: BLOCK,
    check_extra=check_nvfp4_fields,
    fields=("outer_scale", "amax"),
    accepts_encode_scale=True,
    description="E2M1 values, an E4M3 scale per 16, an FP32 outer scale",
))

__all__ = [
    "BLOCK", "FLT_MAX", "FLT_MIN_NORMAL", "INPUT_SCALE_RULES", "NVFP4", "NVFP4_ERRORS", "NVFP4_FORMAT",
    "NVFP4_OUTERS", "NVFP4_SCALE_RULES", "amax_of_outer_scale", "block_amax", "block_outputs", "block_scales",
    "candidate_error", "check_nvfp4_fields", "choose_4over6", "dequantize_nvfp4", "e2m1_codes",
    "e4m3_positive_values", "e4m3_scale", "encode_blocks", "encode_multiplier", "encode_scale_tensor",
    "group_amax", "input_encode_scale", "nvfp4_layout", "outer_scale", "outer_scales", "quantize_nvfp4", "reciprocal_fixed_point",
    "reconstruct_blocks", "rounded_magnitudes", "shared_outer_scale", "sweep_block_scales", "sweep_blocks",
    "sweep_finish", "sweep_init", "sweep_step", "triton_supports", "WEIGHTED_RULES", "check_channel_weights",
    "quantize_weighted", "weighted_block_scales",
]
