"""Quantized layers and model conversion."""
from .convert import ConversionReport, convert, find_blocks, unconvert
from .gemm import Operand, gemm, prepare_operand, register_gemm_backend, set_gemm_backend
from .linear import QuantizedLinear, quantized_linear

__all__ = ["ConversionReport", "Operand", "QuantizedLinear", "convert", "find_blocks", "gemm", "prepare_operand",
           "quantized_linear", "register_gemm_backend", "set_gemm_backend", "unconvert"]
