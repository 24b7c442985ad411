"""Block quantizers (pure functions), the format registry and the QuantizedTensor container.

Each format is one sub-package that registers itself (``registry.register``) when imported here.
"""
from typing import Union

from . import nvfp4, mx, s2f6, fp8  # noqa: F401,I001  each registers its Format (this order); a new format: add it here
from .backend import get_backend, set_backend, use_backend
from .dispatch import dequantize, fake_quantize, quantize
from .transforms.hadamard import TE_SIGNS_16, hadamard, hadamard_matrix, inverse_hadamard, random_signs
from .fp8 import FP8
from .mx import MX
from .nvfp4 import NVFP4
from .registry import Format, format_named, format_of, formats, is_spec, register, spec_types
from .schemes import RECIPE_SCHEME_NAMES, SCHEME_TABLE, SchemeRow, scheme_row, stored_scheme_name
from .s2f6 import S2F6
from .transforms.swizzle import swizzle_scales, unswizzle_scales
from .tensor import QuantizedTensor
from .transforms.wire import WIRE_PAYLOADS, decode_rows, emulate, encode_rows, row_bytes, wire_spec

FormatSpec = Union[spec_types()]  # every registered spec type (for annotations and isinstance via is_spec)

__all__ = [
    "FP8", "MX", "NVFP4", "S2F6", "Format", "FormatSpec", "QuantizedTensor", "TE_SIGNS_16", "dequantize", "fake_quantize",
    "format_named", "format_of", "formats", "get_backend", "hadamard", "hadamard_matrix", "inverse_hadamard",
    "is_spec", "quantize", "random_signs", "register", "set_backend", "spec_types", "swizzle_scales",
    "unswizzle_scales", "use_backend",
    "RECIPE_SCHEME_NAMES", "SCHEME_TABLE", "SchemeRow", "scheme_row", "stored_scheme_name",
    "WIRE_PAYLOADS", "decode_rows", "emulate", "encode_rows", "row_bytes", "wire_spec",
]
