"""Fused training-backward requantization: NVFP4 [M, K] -> MXFP8 of its dequantized transpose [K, M].

One kernel reads the packed NVFP4 codes, E4M3 block scales and per-row (or per-tensor) inverse outer
scale of a 2-D operand, dequantizes a [BM, BK] tile in registers, transposes it, and quantizes the
transpose to MX (E4M3 or E5M2 elements, one UE8M0 scale per 32 values along M) -- the dequantized
tensor never goes to memory. Same FP32 operations, in the same order, as

    quantize_mx(dequantize_nvfp4(q).t().contiguous(), MX(element, scale_rule, rounding, sr_mode))

* dequantize: ``x^ = (q * s) * inv_S`` (``inv_S = 1/S`` computed by the caller as the reference does);
* block exponent k: "ceil" = the smallest k in [-127, 127] with ``max_elem * 2**k >= amax`` (the
  reference's ratio-then-exact-correction steps, ``formats.ue8m0.scale_exponent_ceil``), "floor" =
  ``floor(log2 amax) - emax_elem``; zero block -> -127;
* ``x * 2**-k`` as the reference's two exact power-of-two multiplies (``minifloat.mul_pow2``);
* element rounding by integer arithmetic on the FP32 bits (``nvfp4_triton._round_magnitude``),
  saturating at the element max, and for "ceil" at the largest element v with v * 2**k <= FLT_MAX
  (``mx_triton._element_limit``, as ``quant.mx.element_limit``); codes written as float8 bit
  patterns (sign bit kept, -0.0 -> 0x80);
* launched with ``enable_fp_fusion=False``.

Stochastic rounding draws ``tl.randint(seed, (offset + i) mod 2**32)`` with ``i = k * Mp + m`` the
element's index in the M-padded [K, Mp] output layout (Mp = M rounded up to 32): the draws of
``nvfp4_triton.random_bits(K * Mp, seed, offset)``, which the reference consumes through
``blocking.random_from_bits`` (``quant.transforms.requantize_transposed.nvfp4_to_mx_transposed(..., rand_bits=...)``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import element_limit, pow2, round_magnitude, rounding_id
from .nvfp4_triton import per_row

MX_BLOCK = 32
NV_BLOCK = 16
BM = 64  # source rows (M) per program: two MX blocks
BK = 32  # source columns (K) per program: two NVFP4 blocks

# element: (mantissa bits, smallest normal exponent, max, emax for the "floor" rule, torch dtype)
ELEMENTS = {
    "e4m3": (3, -6, 448.0, 8, torch.float8_e4m3fn),
    "e5m2": (2, -14, 57344.0, 15, torch.float8_e5m2),
}
SCALE_RULES = {"ceil": 0, "floor": 1}


@triton.jit
def _times_pow2(c: tl.constexpr, k):
    """c * 2**k for int32 k in [-127, 127] (2**-127 as (c/2) * 2**-126: no subnormal constant)."""
    return tl.where(k > -127, c * pow2(tl.maximum(k, -126)), (c * 0.5) * 1.1754943508222875e-38)


@triton.jit
def _block_exponent(amax, MAXE: tl.constexpr, EMAXE: tl.constexpr, RULE: tl.constexpr):
    """Unbiased UE8M0 exponent (int32) of each block amax, as ``formats.ue8m0`` computes it."""
    if RULE == 0:  # ceil: ratio's exponent (+1 if mantissa bits), then two exact corrections
        ratio = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, MAXE, tl.float32)), 1.1754943508222875e-38)
        rb = ratio.to(tl.int32, bitcast=True)
        k = ((rb >> 23) & 0xFF) - 127 + ((rb & 0x7FFFFF) != 0).to(tl.int32)
        k = tl.minimum(tl.maximum(k, -127), 127)
        k = tl.where((amax > _times_pow2(MAXE, k)) & (k < 127), k + 1, k)
        k = tl.where((k > -127) & (amax <= _times_pow2(MAXE, k - 1)), k - 1, k)
    else:  # floor (OCP): floor(log2 amax) - emax, -127 below the normal range
        safe = tl.maximum(amax, 1.1754943508222875e-38)
        k = ((safe.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - EMAXE
        k = tl.where(amax < 1.1754943508222875e-38, -127, k)
        k = tl.minimum(tl.maximum(k, -127), 127)
    return k


@triton.jit
def _fp8_byte(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Bit pattern (int32, sign excluded) of FP32 ``v >= 0`` already on the fp8 grid (MBITS, 2**EMIN)."""
    b = v.to(tl.int32, bitcast=True)
    normal = ((((b >> 23) & 0xFF) - 127 - EMIN + 1) << MBITS) | ((b >> (23 - MBITS)) & ((1 << MBITS) - 1))
    # subnormal: v / 2**(EMIN - MBITS), an exact small integer (scaled in two steps: 2**(MBITS - EMIN) <= 2**16)
    small = pow2(tl.full(v.shape, EMIN, tl.int32))
    sub = (tl.minimum(v, small) * pow2(tl.full(v.shape, MBITS - EMIN, tl.int32))).to(tl.int32)
    return tl.where(v >= small, normal, sub)


@triton.jit(do_not_specialize=["seed", "offset"])
def _nvfp4_to_mx_t_kernel(
    codes_ptr, scales_ptr, inv_ptr, out_codes_ptr, out_scales_ptr, out_values_ptr,
    M, K, Mp, half_k, nbk, nbm, inv_stride, seed, offset,
    MBITS: tl.constexpr, EMIN: tl.constexpr, MAXE: tl.constexpr, EMAXE: tl.constexpr,
    RULE: tl.constexpr, ROUND: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr,
    TM: tl.constexpr, TK: tl.constexpr,
):
    """Program (i, j): source rows [i*TM, (i+1)*TM) and columns [j*TK, (j+1)*TK) -> output rows
    (= source columns) j*TK.., output columns (= source rows) i*TM.., TM/32 MX blocks per output row."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = pid_m.to(tl.int64) * TM + tl.arange(0, TM).to(tl.int64)  # [TM]
    k = pid_k.to(tl.int64) * TK + tl.arange(0, TK).to(tl.int64)  # [TK]
    src = (m < M)[:, None] & (k < K)[None, :]
    # NVFP4 dequantize of the [TM, TK] source tile: byte k//2 holds element k in nibble k % 2
    byte = tl.load(codes_ptr + m[:, None] * half_k + (k // 2)[None, :], mask=src, other=0).to(tl.int32)
    code = (byte >> ((k % 2) * 4).to(tl.int32)[None, :]) & 0xF
    idx = code & 7
    mag = tl.where(idx < 4, idx.to(tl.float32) * 0.5,
                   tl.where(idx < 6, (idx - 2).to(tl.float32), tl.where(idx == 6, 4.0, 6.0)))
    q = tl.where(code >= 8, -mag, mag)
    sb = tl.load(scales_ptr + m[:, None] * nbk + (k // NV_BLOCK)[None, :], mask=src, other=0).to(tl.int32)
    ex = (sb >> 3) & 0xF
    normal = (((ex + 120) << 23) | ((sb & 7) << 20)).to(tl.float32, bitcast=True)
    s = tl.where(ex == 0, (sb & 7).to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    s = tl.where((sb & 0x7F) == 0x7F, float("nan"), s)
    inv_s = tl.load(inv_ptr + m * inv_stride, mask=m < M, other=1.0)
    x = (q * s) * inv_s[:, None]  # [TM, TK]

    # MX quantize of the transpose [TK, TM] in blocks of 32 along M
    xt = tl.trans(x)
    NB: tl.constexpr = TM // 32
    xb = tl.reshape(xt, [TK, NB, 32])
    amax = tl.reshape(tl.max(tl.abs(xb), axis=2), [TK, NB, 1])
    e = _block_exponent(amax, MAXE, EMAXE, RULE)  # [TK, NB, 1] int32
    nk = -e
    h = nk >> 1  # floor(-k / 2)
    scaled = xb * pow2(h) * pow2(nk - h)
    neg = xb.to(tl.int32, bitcast=True) < 0
    mo = tl.reshape(m, [1, NB, 32])  # output column (source row) of each element
    ko = k[:, None, None]
    if ROUND > 0:
        rbits = tl.randint(seed, (offset + ko * Mp + mo).to(tl.uint32)).to(tl.int32, bitcast=True)
    else:
        rbits = 0
    v = round_magnitude(tl.abs(scaled), rbits, MBITS, EMIN, MAXE, ROUND)
    if RULE == 0:  # "ceil" near FLT_MAX: x^ = v * 2**k stays finite (EMAXE = floor(log2 MAXE))
        v = tl.minimum(v, element_limit(e, MBITS, EMAXE, MAXE))
    dst = (ko < K) & (mo < Mp)
    if WRITE_CODES:
        cb = _fp8_byte(v, MBITS, EMIN) | (neg.to(tl.int32) << 7)
        tl.store(out_codes_ptr + ko * Mp + mo, cb.to(tl.uint8), mask=dst)
    bidx = pid_m.to(tl.int64) * NB + tl.arange(0, NB).to(tl.int64)  # [NB] MX block index along M
    smask = (k < K)[:, None] & (bidx < nbm)[None, :]
    tl.store(out_scales_ptr + k[:, None] * nbm + bidx[None, :], tl.reshape(e + 127, [TK, NB]).to(tl.uint8),
             mask=smask)
    if WRITE_VALUES:
        b = e + 127
        sc = tl.where(b == 0, 4194304, b << 23).to(tl.float32, bitcast=True)  # 2**(b - 127); b = 0: 2**-127
        tl.store(out_values_ptr + ko * Mp + mo, tl.where(neg, -v, v) * sc, mask=dst)


def nvfp4_to_mx_t(codes: torch.Tensor, scale_bytes: torch.Tensor, inv_s: torch.Tensor, K: int,
                  element: str = "e4m3", scale_rule: str = "ceil", rounding: str = "stochastic",
                  sr_mode: str = "hardware", seed: int = 0, offset: int = 0, want_codes: bool = True,
                  want_values: bool = False):
    """MX quantization of the transpose of a dequantized NVFP4 operand, in one kernel.

    codes: packed NVFP4 codes [M, Kp/2] uint8; scale_bytes: E4M3 block scales [M, Kp/16]
    (float8_e4m3fn or their uint8 bit patterns; 16x16-tile operands store the tile scale on every
    row, so they need nothing special); inv_s: 1/S (one scalar or [M]); K: the operand's true
    number of columns (<= Kp).
    Returns ``(codes_t, scales_t, values_t)``: float8 codes [K, Mp] (Mp = M rounded up to 32, the
    padding quantized as zeros; None unless want_codes), UE8M0 bytes uint8 [K, Mp/32], FP32
    dequantized values [K, Mp] (None unless want_values).
    """
    if element not in ELEMENTS or scale_rule not in SCALE_RULES:
        raise ValueError(f"fused NVFP4->MX kernel supports element {list(ELEMENTS)} and scale_rule "
                         f"{list(SCALE_RULES)}, got {element!r}, {scale_rule!r}")
    if scale_bytes.dtype == torch.float8_e4m3fn:
        scale_bytes = scale_bytes.view(torch.uint8)
    if codes.dim() != 2 or scale_bytes.dim() != 2:
        raise ValueError(f"expected 2-D codes and scales, got {tuple(codes.shape)} and {tuple(scale_bytes.shape)}")
    M, half_k = codes.shape
    nbk = scale_bytes.shape[1]
    if half_k != nbk * (NV_BLOCK // 2) or scale_bytes.shape[0] != M or not 0 <= K <= 2 * half_k:
        raise ValueError(f"codes {tuple(codes.shape)}, scales {tuple(scale_bytes.shape)} and K={K} do not match")
    mbits, emin, maxe, emaxe, dtype = ELEMENTS[element]
    dev = codes.device
    Mp = -(-M // MX_BLOCK) * MX_BLOCK
    nbm = Mp // MX_BLOCK
    inv_s, inv_stride = per_row(inv_s.to(dev), M, "inv_s")
    out_codes = torch.empty(K, Mp, dtype=torch.uint8, device=dev) if want_codes else None
    out_scales = torch.empty(K, nbm, dtype=torch.uint8, device=dev)
    out_values = torch.empty(K, Mp, dtype=torch.float32, device=dev) if want_values else None
    if K * Mp:
        grid = (triton.cdiv(Mp, BM), triton.cdiv(K, BK))
        _nvfp4_to_mx_t_kernel[grid](
            codes.contiguous(), scale_bytes.contiguous(), inv_s,
            out_scales if out_codes is None else out_codes, out_scales,
            out_scales if out_values is None else out_values,
            M, K, Mp, half_k, nbk, nbm, inv_stride, int(seed), int(offset),
            MBITS=mbits, EMIN=emin, MAXE=maxe, EMAXE=emaxe, RULE=SCALE_RULES[scale_rule],
            ROUND=rounding_id(rounding, sr_mode), WRITE_CODES=want_codes, WRITE_VALUES=want_values,
            TM=BM, TK=BK, enable_fp_fusion=False,
        )
    return (None if out_codes is None else out_codes.view(dtype)), out_scales, out_values
