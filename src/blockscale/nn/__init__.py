"""Quantized layers and model conversion."""
from .convert import ConversionReport, convert, find_blocks, unconvert
from .gemm import Operand, prepare_operand, register_gemm_backend, set_gemm_backend
from .linear import QuantizedLinear, quantized_linear
from .moe import GroupedExperts, MoE, MoEConfig, Router, RoutingPlan
from .nvfp4_linear import NVFP4Linear

__all__ = ["ConversionReport", "GroupedExperts", "MoE", "MoEConfig", "NVFP4Linear", "Operand", "QuantizedLinear",
           "Router", "RoutingPlan", "convert", "find_blocks", "prepare_operand", "quantized_linear",
           "register_gemm_backend", "set_gemm_backend", "unconvert"]
