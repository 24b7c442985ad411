"""Block quantizers (pure functions) and the QuantizedTensor container."""
from .backend import get_backend, set_backend, use_backend
from .dispatch import dequantize, fake_quantize, quantize
from .hadamard import TE_SIGNS_16, hadamard, hadamard_matrix, inverse_hadamard, random_signs
from .specs import MX, NVFP4, S2F6
from .swizzle import swizzle_scales, unswizzle_scales
from .tensor import QuantizedTensor
from .wire import WIRE_PAYLOADS, decode_rows, emulate, encode_rows, row_bytes, wire_spec

__all__ = [
    "MX", "NVFP4", "S2F6", "QuantizedTensor", "TE_SIGNS_16", "dequantize", "fake_quantize", "get_backend",
    "hadamard", "hadamard_matrix", "inverse_hadamard", "quantize", "random_signs", "set_backend",
    "swizzle_scales", "unswizzle_scales", "use_backend",
    "WIRE_PAYLOADS", "decode_rows", "emulate", "encode_rows", "row_bytes", "wire_spec",
]
