"""MX (MXFP8 E4M3 / E5M2, MXFP4 E2M1) quantize / dequantize as Triton kernels: blocks of 32 along
the rows (the contiguous last dim), along a strided dim (e.g. the columns of a 2-D tensor), and a
one-pass kernel giving both the row-wise and the column-wise quantization of a 2-D tensor from one
read of it (training: x along K for the forward GEMM, along M for the weight-gradient GEMM).

Same numbers, bit for bit, as the reference in ``quant/mx.py``:

    k  = smallest k in [-127, 127] with max_elem * 2**k >= amax       "ceil" (zero block: -127)
       = clamp(floor(log2 amax) - emax_elem, -127, 127)               "floor" (amax < 2**-126: -127)
    v  = round(x * 2**h * 2**(-k-h)),  h = floor(-k/2)                (``mul_pow2``: two multiplies)
         "ceil": |v| <= min(max_elem, 2**(e+1) - 2**(e-m)), e = min(127 - k, EC)  (``_element_limit``)
    x^ = v * 2**k                                                      (2**-127 for b = 0)

Why it is bit-exact:
* the scale exponent is integer arithmetic on the FP32 bits of amax and max_elem = (1 + MC/2**23) * 2**EC
  (``_scale_exponent``): no division, no subnormal float compare (the reference's FP32 ratio plus its
  two exact corrections computes the same smallest k);
* element rounding (RNE, PTX ``cvt.rs``-style "hardware" SR, 24-bit "exact" SR) is integer arithmetic on
  the FP32 bit pattern (``_round_magnitude``), never a float8 cast (Triton's interpreter cast to
  float8e4nv is wrong, and GPUs differ); code bytes are built from the rounded value's bits;
* the only float operations are the two power-of-two multiplies of ``mul_pow2`` and the dequantize
  multiply, in the reference's order; kernels are launched with ``enable_fp_fusion=False``.

Stochastic rounding draws one uint32 per element from Philox: ``tl.randint(seed, (offset + i) mod 2**32)``
with ``i`` the element's index in the padded output layout [R, Kp] (R rows of blocks, i.e. the layout of
the reference's ``rand`` of shape (R, nb, 32) for dim moved last). ``random_bits`` returns the same draws,
for the reference's ``quantize_mx(..., rand_bits=...)``. The one-pass rows+cols kernel uses counters
``offset + r*Kp + c`` for the rows and ``offset_cols + k*Mp + m`` for the columns (default
``offset_cols = offset + M*Kp``: the two parts take consecutive ranges of one stream).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.constants import code_width, element_format
from .common import (BLOCK, BLOCKS_PER_PROGRAM, ELEMENTS, RULES, TILE_N, bits_view, element_limit, load_f32,  # noqa: F401
                     max_bits, mul_pow2, pow2, random_bits, randbits, round_magnitude, rounding_id, scale_exponent,
                     ue8m0_value)


def spec_params(spec) -> dict:
    """Kernel constexprs of an MX spec (element, scale_rule, rounding, sr_mode; dim is not used)."""
    fmt = element_format(spec.element)  # formats.constants: the one table of element parameters
    mbits, emin, maxv, emax = fmt.mbits, fmt.emin, fmt.max, fmt.emax
    mc, ec = max_bits(maxv)
    return dict(ELEM=ELEMENTS[spec.element], MBITS=mbits, EMIN=emin, MAXV=maxv, EMAX=emax, MC=mc, EC=ec,
                RULE=RULES[spec.scale_rule], ROUND=rounding_id(spec.rounding, spec.sr_mode))


@triton.jit
def _mx_block(x, rbits, N: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr,
              EMAX: tl.constexpr, MC: tl.constexpr, EC: tl.constexpr, RULE: tl.constexpr, ROUND: tl.constexpr):
    """Blocks x [N, 32] (FP32) -> (rounded magnitudes [N, 32], sign bits [N, 32], k [N, 1])."""
    amax = tl.reshape(tl.max(tl.abs(x), axis=1), [N, 1])
    k = scale_exponent(amax, RULE, MC, EC, EMAX)
    scaled = mul_pow2(x, -k)
    neg = scaled.to(tl.int32, bitcast=True) < 0  # sign bit, -0.0 included
    v = round_magnitude(tl.abs(scaled), rbits, MBITS, EMIN, MAXV, ROUND)
    if RULE == 0:  # "ceil" near FLT_MAX: x^ = v * 2**k stays finite ("floor" has k <= 127 - EC)
        v = tl.minimum(v, element_limit(k, MBITS, EC, MAXV))
    return v, neg, k


@triton.jit
def _mx_emit(v, neg, k, row, blk, mask, codes_ptr, scales_ptr, values_ptr, c_stride, s_stride, v_stride,
             N: tl.constexpr, ELEM: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr):
    """Store block results: scale byte at scales[row, blk], codes in row ``row`` from element
    32*blk (fp8 bytes, or E2M1 nibbles packed 2i low / 2i+1 high), FP32 x^ at values[row, 32*blk + i]."""
    b = k + 127  # [N, 1]
    tl.store(scales_ptr + row * s_stride + blk, tl.reshape(b, [N]).to(tl.uint8), mask=mask)
    if WRITE_CODES:
        bits = v.to(tl.int32, bitcast=True)
        sgn = neg.to(tl.int32)
        if ELEM == 2:
            idx = tl.where(v < 2.0, v * 2.0, tl.where(v < 4.0, v + 2.0, v * 0.5 + 4.0)).to(tl.int32)
            code = idx | (sgn << 3)
            lo, hi = tl.split(tl.reshape(code, [N, 16, 2]))
            byte = (lo | (hi << 4)).to(tl.uint8)
            i16 = tl.arange(0, 16).to(tl.int64)
            tl.store(codes_ptr + row[:, None] * c_stride + blk[:, None] * 16 + i16[None, :], byte,
                     mask=mask[:, None])
        else:
            if ELEM == 0:  # E4M3: normal from 2**-6, subnormal step 2**-9
                normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
                mag = tl.where(v >= 0.015625, normal, (tl.minimum(v, 0.015625) * 512.0).to(tl.int32))
            else:  # E5M2: normal from 2**-14, subnormal step 2**-16
                normal = ((((bits >> 23) & 0xFF) - 112) << 2) | ((bits >> 21) & 3)
                mag = tl.where(v >= 6.103515625e-05, normal, (tl.minimum(v, 6.103515625e-05) * 65536.0).to(tl.int32))
            byte = (mag | (sgn << 7)).to(tl.uint8)
            i32 = tl.arange(0, 32).to(tl.int64)
            tl.store(codes_ptr + row[:, None] * c_stride + blk[:, None] * 32 + i32[None, :], byte,
                     mask=mask[:, None])
    if WRITE_VALUES:
        xv = tl.where(neg, -v, v) * ue8m0_value(b)
        i32 = tl.arange(0, 32).to(tl.int64)
        tl.store(values_ptr + row[:, None] * v_stride + blk[:, None] * 32 + i32[None, :], xv, mask=mask[:, None])


@triton.jit(do_not_specialize=["seed", "offset"])  # a fresh seed per call must not recompile
def _mx_rows_kernel(x_ptr, codes_ptr, scales_ptr, values_ptr, n_blocks, nb, K, stride_row, c_stride, seed, offset,
                    ELEM: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr,
                    EMAX: tl.constexpr, MC: tl.constexpr, EC: tl.constexpr, RULE: tl.constexpr,
                    ROUND: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, BB: tl.constexpr,
                    BF16: tl.constexpr):
    """BB blocks of 32 of the [R, nb] block grid of x [R, K] (unit stride along K; zeros past K)."""
    bid = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)
    bmask = bid < n_blocks
    row = bid // nb
    blk = bid % nb
    cols = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = load_f32(x_ptr + row[:, None] * stride_row + cols, bmask[:, None] & (cols < K), BF16)
    rbits = 0
    if ROUND > 0:
        rbits = randbits(seed, offset, row, blk * 32, nb * 32, BB)
    v, neg, k = _mx_block(x, rbits, BB, MBITS, EMIN, MAXV, EMAX, MC, EC, RULE, ROUND)
    _mx_emit(v, neg, k, row, blk, bmask, codes_ptr, scales_ptr, values_ptr, c_stride, nb, nb * 32,
             BB, ELEM, WRITE_CODES, WRITE_VALUES)


@triton.jit(do_not_specialize=["seed", "offset"])
def _mx_strided_kernel(x_ptr, codes_ptr, scales_ptr, values_ptr, A, D, B, sa, sd, sb, nbd, n_bt, c_stride,
                       seed, offset,
                       ELEM: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr,
                       EMAX: tl.constexpr, MC: tl.constexpr, EC: tl.constexpr, RULE: tl.constexpr,
                       ROUND: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr,
                       BN: tl.constexpr, BF16: tl.constexpr):
    """x viewed [A, D, B] (any strides), blocks of 32 along D. One program: one (a, block j along D)
    and BN consecutive b; reads a [32, BN] tile, writes rows a*B + b of the moved layout [A*B, Dp]."""
    pid = tl.program_id(0).to(tl.int64)
    aj = pid // n_bt
    bt = pid % n_bt
    a = aj // nbd
    j = aj % nbd
    d = j * 32 + tl.arange(0, 32).to(tl.int64)
    b = bt * BN + tl.arange(0, BN).to(tl.int64)
    m = (d < D)[:, None] & (b < B)[None, :]
    x = load_f32(x_ptr + a * sa + d[:, None] * sd + b[None, :] * sb, m, BF16)
    xt = tl.trans(x)  # [BN, 32]: one block per row
    row = a * B + b
    blk = tl.zeros([BN], dtype=tl.int64) + j
    rbits = 0
    if ROUND > 0:
        rbits = randbits(seed, offset, row, blk * 32, nbd * 32, BN)
    v, neg, k = _mx_block(xt, rbits, BN, MBITS, EMIN, MAXV, EMAX, MC, EC, RULE, ROUND)
    _mx_emit(v, neg, k, row, blk, b < B, codes_ptr, scales_ptr, values_ptr, c_stride, nbd, nbd * 32,
             BN, ELEM, WRITE_CODES, WRITE_VALUES)


@triton.jit(do_not_specialize=["seed", "offset_r", "offset_c"])
def _mx_rows_cols_kernel(
    x_ptr, rc_ptr, rs_ptr, rv_ptr, cc_ptr, cs_ptr, cv_ptr, M, K, sm, sk, nbk, nbm, n_kt, rc_stride, cc_stride,
    seed, offset_r, offset_c,
    ELEM_R: tl.constexpr, MBITS_R: tl.constexpr, EMIN_R: tl.constexpr, MAXV_R: tl.constexpr, EMAX_R: tl.constexpr,
    MC_R: tl.constexpr, EC_R: tl.constexpr, RULE_R: tl.constexpr, ROUND_R: tl.constexpr,
    ELEM_C: tl.constexpr, MBITS_C: tl.constexpr, EMIN_C: tl.constexpr, MAXV_C: tl.constexpr, EMAX_C: tl.constexpr,
    MC_C: tl.constexpr, EC_C: tl.constexpr, RULE_C: tl.constexpr, ROUND_C: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, BN: tl.constexpr, NBR: tl.constexpr, BF16: tl.constexpr,
):
    """x [M, K]: one program reads a [32, BN] tile (rows 32*ti.., columns BN*tk..) once and writes
    its row-wise blocks (blocks of 32 along K: layout [M, Kp]) and its column-wise blocks (32 along M:
    layout [K, Mp], i.e. x.T quantized along its last dim)."""
    pid = tl.program_id(0).to(tl.int64)
    ti = pid // n_kt
    tk = pid % n_kt
    mi = ti * 32 + tl.arange(0, 32).to(tl.int64)
    ki = tk * BN + tl.arange(0, BN).to(tl.int64)
    x = load_f32(x_ptr + mi[:, None] * sm + ki[None, :] * sk, (mi < M)[:, None] & (ki < K)[None, :], BF16)
    # row-wise: [32, BN] -> [32 * NBR, 32], block n = (row n // NBR, block tk*NBR + n % NBR)
    xr = tl.reshape(x, [32 * NBR, 32])
    n = tl.arange(0, 32 * NBR).to(tl.int64)
    row = ti * 32 + n // NBR
    blk = tk * NBR + n % NBR
    rbits = 0
    if ROUND_R > 0:
        rbits = randbits(seed, offset_r, row, blk * 32, nbk * 32, 32 * NBR)
    v, neg, k = _mx_block(xr, rbits, 32 * NBR, MBITS_R, EMIN_R, MAXV_R, EMAX_R, MC_R, EC_R, RULE_R, ROUND_R)
    _mx_emit(v, neg, k, row, blk, (row < M) & (blk < nbk), rc_ptr, rs_ptr, rv_ptr, rc_stride, nbk, nbk * 32,
             32 * NBR, ELEM_R, WRITE_CODES, WRITE_VALUES)
    # column-wise: [BN, 32], block n = (row ki[n] of x.T, block ti)
    xc = tl.trans(x)
    cblk = tl.zeros([BN], dtype=tl.int64) + ti
    rbits_c = 0
    if ROUND_C > 0:
        rbits_c = randbits(seed, offset_c, ki, cblk * 32, nbm * 32, BN)
    vc, negc, kc = _mx_block(xc, rbits_c, BN, MBITS_C, EMIN_C, MAXV_C, EMAX_C, MC_C, EC_C, RULE_C, ROUND_C)
    _mx_emit(vc, negc, kc, ki, cblk, ki < K, cc_ptr, cs_ptr, cv_ptr, cc_stride, nbm, nbm * 32,
             BN, ELEM_C, WRITE_CODES, WRITE_VALUES)


@triton.jit
def _mx_dequantize_kernel(codes_ptr, scales_ptr, out_ptr, n_blocks, ELEM: tl.constexpr, BB: tl.constexpr):
    """x^ = v * 2**(b-127) for codes [R, Kp] (fp8 bytes) or [R, Kp/2] (E2M1) and scales [R, nb]."""
    bid = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)
    bmask = bid < n_blocks
    i32 = tl.arange(0, 32)
    if ELEM == 2:
        byte = tl.load(codes_ptr + bid[:, None] * 16 + (i32 // 2)[None, :], mask=bmask[:, None], other=0)
        code = (byte.to(tl.int32) >> ((i32 % 2) * 4)[None, :]) & 0xF
        idx = code & 7
        mag = tl.where(idx < 4, idx.to(tl.float32) * 0.5,
                       tl.where(idx < 6, (idx - 2).to(tl.float32), tl.where(idx == 6, 4.0, 6.0)))
        q = tl.where(code >= 8, -mag, mag)
    else:
        c = tl.load(codes_ptr + bid[:, None] * 32 + i32[None, :], mask=bmask[:, None], other=0).to(tl.int32)
        if ELEM == 0:
            ex = (c >> 3) & 0xF
            mb = c & 7
            normal = ((ex + 120) << 23 | (mb << 20)).to(tl.float32, bitcast=True)
            mag = tl.where(ex == 0, mb.to(tl.float32) * 0.001953125, normal)
            mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
        else:
            ex = (c >> 2) & 0x1F
            mb = c & 3
            normal = ((ex + 112) << 23 | (mb << 21)).to(tl.float32, bitcast=True)
            mag = tl.where(ex == 0, mb.to(tl.float32) * 1.52587890625e-05, normal)
            mag = tl.where(ex == 31, tl.where(mb == 0, float("inf"), float("nan")), mag)
        q = tl.where((c & 0x80) != 0, -mag, mag)
    sb = tl.load(scales_ptr + bid, mask=bmask, other=127).to(tl.int32)
    out = q * tl.reshape(ue8m0_value(sb), [BB, 1])
    tl.store(out_ptr + bid[:, None] * 32 + i32[None, :], out, mask=bmask[:, None])


# ---------------------------------------------------------------------------------------------
# host wrappers

_FLOAT_IN = (torch.float32, torch.bfloat16, torch.float16)


def _check_float(x: torch.Tensor, name: str) -> None:
    if x.dtype not in _FLOAT_IN:
        raise TypeError(f"{name}: unsupported dtype {x.dtype} (float32, bfloat16, float16)")


def _outputs(R: int, Kp: int, element: str, want_codes: bool, want_values: bool, dev):
    codes = torch.empty(R, Kp // 2 if element == "e2m1" else Kp, dtype=torch.uint8, device=dev) if want_codes else None
    scales = torch.empty(R, Kp // BLOCK, dtype=torch.uint8, device=dev)
    values = torch.empty(R, Kp, dtype=torch.float32, device=dev) if want_values else None
    return codes, scales, values


def _ptrs(codes, scales, values):
    """Unused outputs get a valid dummy pointer (the scales), never written."""
    return (scales if codes is None else codes), scales, (scales if values is None else values)


def quantize_mx_rows(x: torch.Tensor, spec, seed: int = 0, offset: int = 0, want_codes: bool = True,
                     want_values: bool = False):
    """MX-quantize 2-D ``x`` [R, K] with blocks of 32 along K (``spec.dim`` is not used).

    Returns ``(codes, scale_bytes, values)``: codes uint8 [R, Kp] (fp8 bit patterns: ``.view(torch.float8_e4m3fn)``
    / ``float8_e5m2``) or [R, Kp/2] packed E2M1 (None unless want_codes); UE8M0 bytes uint8 [R, Kp/32];
    FP32 x^ [R, Kp] (None unless want_values). Kp = K rounded up to 32, the padding quantized as zeros.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_mx_rows expects a 2-D tensor, got shape {tuple(x.shape)}")
    _check_float(x, "quantize_mx_rows")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    R, K = x.shape
    nb = -(-K // BLOCK)
    codes, scales, values = _outputs(R, nb * BLOCK, spec.element, want_codes, want_values, x.device)
    if R * nb:
        p = spec_params(spec)
        grid = (triton.cdiv(R * nb, BLOCKS_PER_PROGRAM),)
        xk, bf16 = bits_view(x)
        _mx_rows_kernel[grid](xk, *_ptrs(codes, scales, values), R * nb, nb, K, x.stride(0),
                              nb * code_width(spec.element, BLOCK), int(seed), int(offset), **p,
                              WRITE_CODES=want_codes, WRITE_VALUES=want_values, BB=BLOCKS_PER_PROGRAM,
                              BF16=bf16, enable_fp_fusion=False)
    return codes, scales, values


def quantize_mx_strided(x3: torch.Tensor, spec, seed: int = 0, offset: int = 0, want_codes: bool = True,
                        want_values: bool = False):
    """MX-quantize ``x3`` viewed as [A, D, B] (any strides) with blocks of 32 along D, e.g. a 2-D
    [M, K] tensor along its columns as ``x.unsqueeze(0)`` (A = 1, D = M, B = K).

    Outputs are in the moved layout (D last) of ``quant.mx``: codes [A*B, Dp] (fp8 bytes) or
    [A*B, Dp/2] (E2M1), UE8M0 bytes [A*B, Dp/32], FP32 x^ [A*B, Dp]; row a*B + b holds x3[a, :, b].
    """
    if x3.dim() != 3:
        raise ValueError(f"quantize_mx_strided expects a 3-D [A, D, B] view, got shape {tuple(x3.shape)}")
    _check_float(x3, "quantize_mx_strided")
    A, D, B = x3.shape
    nbd = -(-D // BLOCK)
    codes, scales, values = _outputs(A * B, nbd * BLOCK, spec.element, want_codes, want_values, x3.device)
    if A * B * nbd:
        p = spec_params(spec)
        n_bt = triton.cdiv(B, TILE_N)
        grid = (A * nbd * n_bt,)
        xk, bf16 = bits_view(x3)
        _mx_strided_kernel[grid](xk, *_ptrs(codes, scales, values), A, D, B, *x3.stride(), nbd, n_bt,
                                 nbd * code_width(spec.element, BLOCK), int(seed), int(offset), **p,
                                 WRITE_CODES=want_codes, WRITE_VALUES=want_values, BN=TILE_N,
                                 BF16=bf16, enable_fp_fusion=False)
    return codes, scales, values


def _suffixed(p: dict, s: str) -> dict:
    return {k + s: v for k, v in p.items()}


def quantize_mx_rows_cols(x: torch.Tensor, spec_rows, spec_cols, seed: int = 0, offset: int = 0,
                          offset_cols: int | None = None, want_codes: bool = True, want_values: bool = False):
    """Both MX quantizations of 2-D ``x`` [M, K] from one read: blocks of 32 along K (``spec_rows``:
    what ``quantize(x, MX(dim=-1))`` stores) and along M (``spec_cols``: what ``MX(dim=0)`` stores, i.e.
    x.T quantized along its last dim). Each spec may use its own element / scale rule / rounding.

    Returns ``((codes, scale_bytes, values) rows, (codes, scale_bytes, values) cols)`` with layouts
    [M, Kp] / [K, Mp] (codes [.., Kp/2] / [.., Mp/2] for E2M1), as ``quantize_mx_rows`` and
    ``quantize_mx_strided``. SR counters: rows ``offset + m*Kp + k``, cols ``offset_cols + k*Mp + m``
    (default offset_cols = offset + M*Kp), both from ``seed``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_mx_rows_cols expects a 2-D tensor, got shape {tuple(x.shape)}")
    _check_float(x, "quantize_mx_rows_cols")
    M, K = x.shape
    nbk, nbm = -(-K // BLOCK), -(-M // BLOCK)
    if offset_cols is None:
        offset_cols = offset + M * nbk * BLOCK
    rows = _outputs(M, nbk * BLOCK, spec_rows.element, want_codes, want_values, x.device)
    cols = _outputs(K, nbm * BLOCK, spec_cols.element, want_codes, want_values, x.device)
    if M * K:
        n_kt = triton.cdiv(K, TILE_N)
        grid = (nbm * n_kt,)
        xk, bf16 = bits_view(x)
        _mx_rows_cols_kernel[grid](
            xk, *_ptrs(*rows), *_ptrs(*cols), M, K, x.stride(0), x.stride(1), nbk, nbm, n_kt,
            nbk * code_width(spec_rows.element, BLOCK), nbm * code_width(spec_cols.element, BLOCK),
            int(seed), int(offset), int(offset_cols),
            **_suffixed(spec_params(spec_rows), "_R"), **_suffixed(spec_params(spec_cols), "_C"),
            WRITE_CODES=want_codes, WRITE_VALUES=want_values, BN=TILE_N, NBR=TILE_N // BLOCK,
            BF16=bf16, enable_fp_fusion=False)
    return rows, cols


def dequantize_mx_2d(codes: torch.Tensor, scale_bytes: torch.Tensor, element: str) -> torch.Tensor:
    """FP32 x^ [R, Kp] = v * 2**(b-127) from codes [R, Kp] (float8 or its uint8 bits; [R, Kp/2] packed
    for E2M1) and UE8M0 bytes [R, Kp/32]."""
    if codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = codes.view(torch.uint8)
    R, nb = scale_bytes.shape
    width = nb * code_width(element, BLOCK)
    if codes.shape != (R, width):
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scale_bytes.shape)} do not match")
    out = torch.empty(R, nb * BLOCK, dtype=torch.float32, device=codes.device)
    if R * nb:
        grid = (triton.cdiv(R * nb, BLOCKS_PER_PROGRAM),)
        _mx_dequantize_kernel[grid](codes.contiguous(), scale_bytes.contiguous(), out, R * nb,
                                    ELEM=ELEMENTS[element], BB=BLOCKS_PER_PROGRAM, enable_fp_fusion=False)
    return out


__all__ = ["spec_params", "quantize_mx_rows", "quantize_mx_strided", "quantize_mx_rows_cols", "dequantize_mx_2d", "random_bits"]
