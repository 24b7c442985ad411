"""Quantized layers and model conversion."""
from .convert import ConversionReport, convert, find_blocks, unconvert
from .gemm import Operand, prepare_operand, register_gemm_backend, set_gemm_backend
from .linear import QuantizedLinear, quantized_linear

__all__ = ["ConversionReport", "Operand", "QuantizedLinear", "convert", "find_blocks", "prepare_operand",
           "quantized_linear", "register_gemm_backend", "set_gemm_backend", "unconvert"]
