"""Helpers shared by the Triton kernels (MX, NVFP4, S2F6, requantize-transposed): kernel constants,
bit-exact device functions (power-of-two scaling, minifloat rounding, UE8M0 exponents, loads,
Philox random bits) and host helpers. Each mirrors a torch reference named in its docstring.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

BLOCK = 32
BLOCKS_PER_PROGRAM = 32  # 1024 elements per program (rows / dequantize kernels)
TILE_N = 32  # columns per program of the strided and rows+cols kernels (a 32 x 32 tile)

ELEMENTS = {"e4m3": 0, "e5m2": 1, "e2m1": 2}
RULES = {"ceil": 0, "floor": 1}


def max_bits(value: float) -> tuple[int, int]:
    """(mantissa field MC, unbiased exponent EC) of a positive normal FP32 ``value``."""
    b = struct.unpack("<I", struct.pack("<f", value))[0]
    return b & 0x7FFFFF, ((b >> 23) & 0xFF) - 127


def rounding_id(rounding: str, sr_mode: str) -> int:
    """0: RNE, 1: stochastic "hardware" (8 bits), 2: stochastic "exact" (24 bits)."""
    if rounding == "nearest":
        return 0
    return 1 if sr_mode == "hardware" else 2


# ---------------------------------------------------------------------------------------------
# shared device functions (also used by s2f6_triton)

@triton.jit
def pow2(k):
    """2.0**k (FP32) for int32 k in [-126, 127], from the bit pattern."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_magnitude(a, rbits, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr,
                     ROUND: tl.constexpr):
    """Round finite FP32 ``a >= 0`` onto the minifloat grid (MBITS mantissa bits, smallest normal
    2**EMIN), saturating at MAXV; integer version of ``formats.minifloat.round_magnitude``.

    With significand ``sig`` and exponent ``e``, a = sig * 2**(e-23); the quantum is 2**qe with
    qe = max(e, EMIN) - MBITS, so t = a / 2**qe = sig / 2**n, n = qe - e + 23: floor(t) = sig >> n and
    frac(t) = rem / 2**n exactly. ``rbits`` (int32 pattern of a uint32 draw) is used when ROUND > 0.
    """
    b = a.to(tl.int32, bitcast=True)
    ef = (b >> 23) & 0xFF
    sig = tl.where(ef > 0, (b & 0x7FFFFF) | 0x800000, b & 0x7FFFFF)
    e = tl.maximum(ef, 1) - 127
    qe = tl.maximum(e, EMIN) - MBITS
    n = qe - e + 23
    sh = tl.minimum(n, 31)  # sig < 2**24: shifts of 24..31 already give 0
    lo = sig >> sh
    rem = sig - (lo << sh)
    if ROUND == 0:  # half to even
        half = 1 << (sh - 1)
        up = (rem > half) | ((rem == half) & ((lo & 1) == 1))
    elif ROUND == 1:  # PTX cvt.rs: top 8 discarded bits + 8 random bits carry into the kept bits
        f8 = rem >> tl.minimum(n - 8, 31)
        up = (f8 + ((rbits >> 24) & 0xFF)) >= 256
    else:  # up iff u < frac with u = k24 * 2**-24, compared exactly in int64
        k24 = ((rbits >> 8) & 0xFFFFFF).to(tl.int64)
        r64 = rem.to(tl.int64)
        big = (k24 << tl.maximum(tl.minimum(n, 47) - 24, 0)) < r64
        small = k24 < (r64 << tl.maximum(24 - n, 0))
        tiny = (k24 == 0) & (r64 > 0)  # frac < 2**-24: only u = 0 is below it
        up = tl.where(n >= 48, tiny, tl.where(n >= 24, big, small))
    r = lo + up.to(tl.int32)
    return tl.minimum(r.to(tl.float32) * pow2(qe), MAXV)


@triton.jit
def scale_exponent(amax, RULE: tl.constexpr, MC: tl.constexpr, EC: tl.constexpr, EMAX: tl.constexpr):
    """Unbiased UE8M0 exponent k (int32) of FP32 ``amax >= 0`` (``quant.mx.block_exponent``).

    "ceil": the smallest k with (1 + MC/2**23) * 2**(EC + k) >= amax = (1 + ma/2**23) * 2**ea, i.e.
    k = ea - EC + (ma > MC), clamped to [-127, 127]. FP32 subnormal amax: in [2**-127, 2**-126) it is
    (1 + ma/2**23) * 2**-127 with ma = (m << 1); below 2**-127 (and 0) k clamps to -127 for EC >= 0.
    "floor": exponent field - 127 - EMAX, clamped; -127 when amax < 2**-126.
    """
    b = amax.to(tl.int32, bitcast=True)
    ef = (b >> 23) & 0xFF
    if RULE == 0:
        m = b & 0x7FFFFF
        sub = ef == 0
        ea = tl.where(sub, tl.where(((m >> 22) & 1) == 1, -127, -128), ef - 127)
        ma = tl.where(sub, (m << 1) & 0x7FFFFF, m)
        k = ea - EC + (ma > MC).to(tl.int32)
    else:
        k = tl.where(ef == 0, -127, ef - 127 - EMAX)
    return tl.minimum(tl.maximum(k, -127), 127)


@triton.jit
def element_limit(k, MBITS: tl.constexpr, EC: tl.constexpr, MAXV: tl.constexpr):
    """The largest element v with v * 2**k <= FLT_MAX (``quant.mx.element_limit``), exactly:
    min(MAXV, 2**(e+1) - 2**(e-MBITS)) with e = min(127 - k, EC); MAXV unless k > 127 - EC."""
    e = tl.minimum(127 - k, EC)
    return tl.minimum(pow2(e + 1) - pow2(e - MBITS), MAXV)


@triton.jit
def mul_pow2(x, k):
    """x * 2**k as ``formats.minifloat.mul_pow2``: x * 2**h * 2**(k-h), h = floor(k/2)."""
    h = k >> 1  # arithmetic shift: floor
    return x * pow2(h) * pow2(k - h)


@triton.jit
def ue8m0_value(b):
    """FP32 2**(b-127) for int32 b in 0..254 (b = 0: the subnormal 2**-127); 255 -> NaN."""
    v = tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def load_f32(ptrs, mask, BF16: tl.constexpr):
    """FP32 values of FP32 / FP16 inputs, or of BF16 inputs passed as their int16 bit patterns: bf16 bits
    << 16 is the exact FP32 value (Triton's interpreter converts BF16 subnormals wrongly)."""
    if BF16:
        h = tl.load(ptrs, mask=mask, other=0)
        return (h.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def randbits(seed, offset, row, col0, ROW_LEN, N: tl.constexpr):
    """[N, 32] int32 patterns of tl.randint(seed, offset + row*ROW_LEN + col0 + i) (mod 2**32)."""
    i32 = tl.arange(0, 32).to(tl.int64)
    ctr = offset + row[:, None] * ROW_LEN + col0[:, None] + i32[None, :]
    return tl.randint(seed, ctr.to(tl.uint32)).to(tl.int32, bitcast=True)


# ---------------------------------------------------------------------------------------------
# MX blocks


@triton.jit(do_not_specialize=["seed", "offset"])
def random_bits_kernel(out_ptr, n, seed, offset, B: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B).to(tl.int64)
    r = tl.randint(seed, (offset + i).to(tl.uint32))
    tl.store(out_ptr + i, r.to(tl.int32, bitcast=True), mask=i < n)


def bits_view(x: torch.Tensor):
    """(tensor for the kernel, BF16 flag): BF16 goes in as its int16 bit patterns (see ``load_f32``)."""
    return (x.view(torch.int16), True) if x.dtype == torch.bfloat16 else (x, False)


def random_bits(n: int, seed: int, offset: int = 0, device="cpu") -> torch.Tensor:
    """The uint32 draws (as int32 bit patterns) the kernels use for counters offset .. offset+n-1:
    ``tl.randint(seed, (offset + i) mod 2**32)``."""
    out = torch.empty(n, dtype=torch.int32, device=device)
    if n:
        random_bits_kernel[(triton.cdiv(n, 1024),)](out, n, int(seed), int(offset), B=1024)
    return out


__all__ = ["BLOCK", "BLOCKS_PER_PROGRAM", "ELEMENTS", "RULES", "TILE_N", "bits_view", "element_limit", "load_f32",
           "max_bits", "mul_pow2", "pow2", "random_bits", "randbits", "round_magnitude", "rounding_id",
           "scale_exponent", "ue8m0_value"]
