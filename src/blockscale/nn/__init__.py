"""Quantized layers and model conversion."""
from .convert import EXPERTS_ONLY_EXCLUDE, ConversionReport, convert, experts_only, find_blocks, unconvert
from .fp8_linear import FP8Linear
from .gemm import Operand, prepare_operand, register_gemm_backend, set_gemm_backend
from .hf_experts import QuantizedFusedExperts, QuantizedGptOssExperts
from .kv_cache import (KV_FORMATS, KVAmaxObserver, attach_key_rotation, attention_modules, fp8_kv_fake_quantize,
                       key_rotation, key_rotations, kv_format, kv_scale_from_amax, kv_scales, nvfp4_kv_fake_quantize,
                       observe_kv, remove_kv_quantization, set_kv_scales)
from .linear import QuantizedLinear, quantized_linear
from .moe import GroupedExperts, MoE, MoEConfig, Router, RoutingPlan
from .mx_linear import MXLinear
from .nvfp4_experts import NVFP4Experts
from .nvfp4_gpt_oss_experts import NVFP4GptOssExperts
from .nvfp4_linear import NVFP4Linear
from .quantized_experts import QuantizedExperts
from .quantized_modules import QUANTIZED_LINEAR_TYPES, is_quantized_linear
from .scheme_experts import SchemeExperts

__all__ = ["EXPERTS_ONLY_EXCLUDE", "KV_FORMATS", "ConversionReport", "FP8Linear", "GroupedExperts", "KVAmaxObserver", "MXLinear",
           "MoE", "MoEConfig", "NVFP4Experts", "NVFP4GptOssExperts", "NVFP4Linear", "Operand", "QUANTIZED_LINEAR_TYPES",
           "QuantizedExperts", "QuantizedFusedExperts", "QuantizedGptOssExperts", "QuantizedLinear", "Router", "RoutingPlan",
           "SchemeExperts", "attach_key_rotation", "attention_modules", "convert",
           "experts_only", "find_blocks", "fp8_kv_fake_quantize", "is_quantized_linear", "key_rotation",
           "key_rotations", "kv_format", "kv_scale_from_amax",
           "kv_scales", "nvfp4_kv_fake_quantize", "observe_kv", "prepare_operand", "quantized_linear", "register_gemm_backend",
           "remove_kv_quantization", "set_gemm_backend", "set_kv_scales", "unconvert"]
