"""Element codecs, bit-exact: E2M1, E4M3, E5M2, UE8M0, S2F6 (encode, decode, RNE and stochastic rounding)."""
from .e2m1 import E2M1_VALUES, decode_e2m1, e2m1_index, encode_e2m1, pack_nibbles, unpack_nibbles
from .fp8 import FP8_DTYPES, FP8_FORMATS, decode_fp8, encode_fp8, round_fp8
from .minifloat import E2M1, E4M3, E5M2, ROUNDING_MODES, SR_MODES, FloatFormat, round_magnitude, round_to_format
from .s2f6 import S2F6_MAX, decode_s2f6, encode_s2f6
from .ue8m0 import decode_ue8m0, encode_ue8m0, scale_exponent_ceil, scale_exponent_floor

__all__ = [
    "E2M1", "E4M3", "E5M2", "E2M1_VALUES", "FP8_DTYPES", "FP8_FORMATS", "FloatFormat", "ROUNDING_MODES",
    "SR_MODES", "S2F6_MAX", "decode_e2m1", "decode_fp8", "decode_s2f6", "decode_ue8m0", "e2m1_index",
    "encode_e2m1", "encode_fp8", "encode_s2f6", "encode_ue8m0", "pack_nibbles", "round_fp8",
    "round_magnitude", "round_to_format", "scale_exponent_ceil", "scale_exponent_floor", "unpack_nibbles",
]
