"""Rounding FP32 values onto a small floating-point grid (E2M1, E4M3, E5M2), bit-exact.

One routine serves every minifloat: for a magnitude ``a`` with FP32 exponent ``e`` the grid
spacing (quantum) is ``q = 2**(max(e, emin) - mbits)``; ``t = a / q`` is exact (a power-of-two
scaling) and the rounded value is ``round(t) * q`` (exact again). Rounding happens on ``t``:

* ``"nearest"``: ``torch.round`` = round half to even on the integer ``t`` = RNE on the mantissa;
  a carry into the next binade is automatic.
* ``"stochastic"``, mode ``"hardware"``: exact emulation of PTX ``cvt.rs``. 8 random bits ``r``
  are added to the top 8 discarded bits, then truncated: round away from zero iff
  ``floor(256 * frac(t)) + r >= 256``.
* ``"stochastic"``, mode ``"exact"``: round away from zero iff ``u < frac(t)`` with a 24-bit
  uniform ``u`` in [0, 1) (unbiased to 2**-24 of a quantum).

Saturation to ``max`` happens after rounding. Only bit operations, floor/round, compares and
power-of-two multiplies are used, so eager and compiled code give identical bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A sign-magnitude minifloat: ``mbits`` mantissa bits, smallest normal ``2**emin``, largest ``max``."""

    name: str
    mbits: int
    emin: int
    max: float

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def emax(self) -> int:
        """Exponent of the top binade: max = m * 2**emax with 1 <= m < 2 (E2M1 2, E4M3 8, E5M2 15)."""
        return math.floor(math.log2(self.max))

    @property
    def ebits(self) -> int:
        """Exponent field width (the bias is 1 - emin = 2**(ebits-1) - 1)."""
        return int(math.log2(2 - self.emin)) + 1

    @property
    def bits(self) -> int:
        """Bits of one element: sign + exponent + mantissa (E2M1 4, E4M3 / E5M2 8)."""
        return 1 + self.ebits + self.mbits


E2M1 = FloatFormat("e2m1", mbits=1, emin=0, max=6.0)
E4M3 = FloatFormat("e4m3", mbits=3, emin=-6, max=448.0)
E5M2 = FloatFormat("e5m2", mbits=2, emin=-14, max=57344.0)

ROUNDING_MODES = ("nearest", "stochastic")
SR_MODES = ("hardware", "exact")


def pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0**k`` as FP32 for integer tensor ``k`` in [-126, 127], built from the bit pattern."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def mul_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2**k`` for integer ``k`` in [-254, 254], as two exact power-of-two multiplies (exact
    unless the result is an FP32 subnormal); covers k = ±127, where ``pow2`` alone cannot."""
    h = torch.div(k, 2, rounding_mode="floor")
    return x * pow2(h) * pow2(k - h)


def fp32_exponent(a: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of FP32 ``a`` (int32); subnormals and zero give -127."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def round_magnitude(
    a: torch.Tensor,
    fmt: FloatFormat,
    rounding: str = "nearest",
    rand: torch.Tensor | None = None,
    sr_mode: str = "hardware",
    limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round non-negative finite FP32 ``a`` onto ``fmt``'s grid, then saturate at ``fmt.max``.

    ``rand`` (same shape as ``a``) holds the random numbers for stochastic rounding: uint8 bits
    for ``sr_mode="hardware"``, FP32 uniforms in [0, 1) for ``"exact"``. ``limit`` (FP32 grid
    values <= ``fmt.max``, broadcasting to ``a``, e.g. one per block) saturates at ``limit`` instead.
    """
    k = torch.clamp(fp32_exponent(a), min=fmt.emin) - fmt.mbits
    r = round_integer(a * pow2(-k), rounding, rand, sr_mode)
    v = r * pow2(k)
    return torch.clamp(v, max=fmt.max) if limit is None else torch.minimum(v, limit)


def round_integer(
    t: torch.Tensor, rounding: str = "nearest", rand: torch.Tensor | None = None, sr_mode: str = "hardware"
) -> torch.Tensor:
    """Round non-negative FP32 ``t`` to an integer (FP32): half-even, or stochastic as above."""
    if rounding == "nearest":
        return torch.round(t)
    lo = torch.floor(t)
    frac = t - lo
    if sr_mode == "hardware":
        up = torch.floor(frac * 256.0).to(torch.int32) + rand.to(torch.int32) >= 256
    else:
        up = rand < frac
    return lo + up.to(torch.float32)


def round_to_format(
    x: torch.Tensor,
    fmt: FloatFormat,
    rounding: str = "nearest",
    rand: torch.Tensor | None = None,
    sr_mode: str = "hardware",
    limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Signed rounding of finite FP32 ``x`` onto ``fmt`` (magnitude rounded, sign kept, saturating at
    ``fmt.max`` or at ``limit``, see ``round_magnitude``)."""
    v = round_magnitude(torch.abs(x), fmt, rounding, rand, sr_mode, limit)
    return torch.where(sign_bit(x), -v, v)


def sign_bit(x: torch.Tensor) -> torch.Tensor:
    """True where the FP32 sign bit is set (including -0.0)."""
    return x.view(torch.int32) < 0
