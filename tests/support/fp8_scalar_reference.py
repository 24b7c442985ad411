"""An independent scalar FP8 reference in pure Python floats (no torch): codes decoded from their bit
layout, RNE by an exhaustive nearest-with-ties-to-even search over the code table, and FP8
quantization with FP32 scales (s = amax / max_elem, q = RNE(clamp(x / s)), x^ = q * s).

FP32 arithmetic is emulated by rounding each double result to FP32 (``f32``): for one +, -, *, /
of FP32 operands the double result rounded to FP32 is the correctly rounded FP32 result.
"""
from __future__ import annotations

import math
import struct

BITS = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}  # exponent bits, mantissa bits, bias


def f32(v: float) -> float:
    """``v`` rounded to the nearest FP32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def decode(code: int, element: str) -> float:
    """The value of an 8-bit code: sign | exponent | mantissa (E4M3: no inf, NaN = S.1111.111)."""
    eb, mb, bias = BITS[element]
    sign = -1.0 if code >> 7 else 1.0
    e, m = (code >> mb) & ((1 << eb) - 1), code & ((1 << mb) - 1)
    if element == "e4m3" and e == 15 and m == 7:
        return math.nan
    if element == "e5m2" and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mb)
    return sign * (1 + m / 2**mb) * 2.0 ** (e - bias)


def magnitudes(element: str) -> list[tuple[int, float]]:
    """(code, value) of every finite non-negative code, in increasing order."""
    return [(c, decode(c, element)) for c in range(128) if math.isfinite(decode(c, element))]


def max_elem(element: str) -> float:
    return magnitudes(element)[-1][1]


def _sign(y: float) -> int:
    return 0x80 if math.copysign(1.0, y) < 0 else 0


def rne_code(y: float, element: str) -> int:
    """Saturating RNE: the code nearest to finite ``y`` (ties: the even code), |y| > max -> ±max."""
    a = abs(y)
    table = magnitudes(element)
    if a >= table[-1][1]:
        return _sign(y) | table[-1][0]
    best = min(table, key=lambda cv: (abs(cv[1] - a), cv[0] & 1))
    return _sign(y) | best[0]


def neighbours(y: float, element: str) -> tuple[float, float]:
    """The grid values just below and just above |y| (equal when |y| is on the grid), signed like y."""
    a, table = abs(y), magnitudes(element)
    lo = max(v for _, v in table if v <= a)
    hi = min((v for _, v in table if v >= a), default=table[-1][1])
    s = -1.0 if _sign(y) else 1.0
    return s * lo, s * hi


def group_of(i: int, j: int, granularity: str, block_shape=(128, 128)):
    if granularity == "tensor":
        return ()
    if granularity in ("channel", "token"):
        return (i,)
    return (i // block_shape[0], j // block_shape[1])


def quantize_matrix(x: list[list[float]], element: str, granularity: str, block_shape=(128, 128)):
    """FP8-quantize a matrix of FP32 values: ({group: scale}, codes [N][K], dequantized [N][K])."""
    m = max_elem(element)
    amax: dict = {}
    for i, row in enumerate(x):
        for j, v in enumerate(row):
            g = group_of(i, j, granularity, block_shape)
            amax[g] = max(amax.get(g, 0.0), abs(v))
    scales = {g: (f32(a / m) or 1.0) for g, a in amax.items()}
    codes, values = [], []
    for i, row in enumerate(x):
        crow, vrow = [], []
        for j, v in enumerate(row):
            s = scales[group_of(i, j, granularity, block_shape)]
            y = min(m, max(-m, f32(v / s)))
            c = rne_code(y, element)
            crow.append(c)
            vrow.append(f32(decode(c, element) * s))
        codes.append(crow)
        values.append(vrow)
    return scales, codes, values


def f32_step(v: float, up: bool) -> float:
    """The FP32 neighbour of positive FP32 ``v`` above (``up``) or below it."""
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    return struct.unpack("<f", struct.pack("<I", bits + (1 if up else -1)))[0]
