"""Every number that defines an element format or a block geometry, in one table.

Element formats (``minifloat.FloatFormat``: mantissa bits, smallest normal exponent, largest value;
``emax``, ``ebits`` and ``bits`` derived from them):

    e2m1  mbits 1  emin 0    max 6      emax 2   4 bits (two per byte)
    e4m3  mbits 3  emin -6   max 448    emax 8   8 bits (torch.float8_e4m3fn)
    e5m2  mbits 2  emin -14  max 57344  emax 15  8 bits (torch.float8_e5m2)

Block geometry: NVFP4 one E4M3 scale per 16 values; MX and S2F6 one UE8M0 scale per 32.
"""
from __future__ import annotations

from .minifloat import E2M1, E4M3, E5M2, FloatFormat

ELEMENT_FORMATS: dict[str, FloatFormat] = {"e2m1": E2M1, "e4m3": E4M3, "e5m2": E5M2}
NVFP4_BLOCK = 16
MX_BLOCK = 32
S2F6_BLOCK = 32


def element_format(element: str) -> FloatFormat:
    """The FloatFormat named ``element``; ValueError naming the known elements otherwise."""
    try:
        return ELEMENT_FORMATS[element]
    except KeyError:
        raise ValueError(f"element={element!r}; allowed values: {', '.join(map(repr, ELEMENT_FORMATS))}") from None


def code_width(element: str, n: int) -> int:
    """Storage units (bytes) of ``n`` codes of ``element``: n/2 for 4-bit elements (two per byte), else n."""
    return n // 2 if element_format(element).bits == 4 else n


__all__ = ["ELEMENT_FORMATS", "MX_BLOCK", "NVFP4_BLOCK", "S2F6_BLOCK", "code_width", "element_format"]
