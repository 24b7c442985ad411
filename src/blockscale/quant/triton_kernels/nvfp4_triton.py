"""NVFP4 quantize / dequantize as Triton kernels: 1x16 blocks along the last dim, or 16x16 tiles
over the last two dims (``block_2d``; values still packed along K, every row of a tile stores the
tile's E4M3 scale).

Same FP32 operations, in the same order, as the reference in ``quant/nvfp4.py``:

    inv_S = 1/S;  t = block_amax * (S * (1/6))
    s     = e4m3_rne(min(t, 448))     rule "6"   (rule "4": e4m3_rne(min(1.5*t, 448)))
    e     = min(1 / (s * inv_S), FLT_MAX)  (0 if s = 0)
    q     = e2m1(clamp(x * e, -6, 6)),  x^ = (q * s) * inv_S
    4over6: s4 replaces s6 only if its block error (``block_error``'s pairwise tree) is strictly lower.

Why it is bit-exact:
* BF16 inputs are loaded as their int16 bit patterns and shifted into the FP32 bit pattern
  (``mx_triton._load_f32``): exact, where Triton's interpreter converts BF16 subnormals wrongly with
  ``.to(tl.float32)`` (FP16 converts exactly, subnormals included);
* E4M3 / E2M1 rounding is integer arithmetic on the FP32 bit pattern (``round_magnitude``), never a
  float8 cast (Triton's interpreter cast to float8e4nv is wrong, and GPUs differ);
* divisions are ``div_rn`` (plain ``/`` on fp32 is an approximate ``div.full`` on NVIDIA);
* kernels are launched with ``enable_fp_fusion=False``: a fused ``(q*s)*inv_S - x`` or ``d*d + e*e``
  (FMA) would change the 4/6 decision on near-ties;
* the block error tree is spelled out as ``v[i] + v[i + h]`` halvings; a 16x16 tile's error is
  ``block_error.tile_error``: ``P = V + V^T``, the same halvings over P's 256 entries (row-major), x0.5.

Scale bytes can be written in the cuBLAS / CUTLASS 128x4 swizzled layout instead of row-major
(``scale_layout="swizzled"``: the bytes of ``swizzle.swizzle_scales``, zero padding included).

Stochastic rounding draws one uint32 per element from Philox: ``tl.randint(seed, (offset + i) mod 2**32)``
with ``i`` the element's index in the K-padded [R, Kp] layout (16x16 tiles: the [B, Mp, Kp] layout,
M padded to 16 too, as in the reference). "hardware" uses the top 8 bits,
"exact" the top 24 bits as ``u = (bits >> 8) * 2**-24``; ``random_bits`` returns the same draws so the
reference (``quantize_nvfp4(..., rand_bits=...)``) can consume them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import bits_view, load_f32, round_magnitude, random_bits, rounding_id  # shared helpers

BLOCK = 16
BLOCKS_PER_PROGRAM = 64  # 1024 elements per program
TILES_PER_PROGRAM = 4  # 16x16 tiles: 1024 elements per program
FLT_MAX = 3.4028234663852886e38

RULES = {"6": 0, "4": 1, "4over6": 2}
ERRORS = {"mse": 0, "mae": 1, "maxabs": 2}


@triton.jit
def _e4m3_rne(t):
    """e4m3_rne(min(t, 448)) for t >= 0 (FP32 value on the E4M3 grid)."""
    return round_magnitude(tl.minimum(t, 448.0), 0, 3, -6, 448.0, 0)


@triton.jit
def _e4m3_byte(s):
    """uint8 bit pattern (as int32) of an FP32 value ``s >= 0`` already on the E4M3 grid."""
    b = s.to(tl.int32, bitcast=True)
    normal = ((((b >> 23) & 0xFF) - 120) << 3) | ((b >> 20) & 7)
    return tl.where(s >= 0.015625, normal, (s * 512.0).to(tl.int32))  # subnormal: s / 2**-9


@triton.jit
def _e2m1_magnitude(x, s, inv_s, rbits, ROUND: tl.constexpr):
    """Rounded |E2M1 value| of each element for block scale ``s`` ([BB, 1])."""
    den = s * inv_s
    # 1/0 = inf -> FLT_MAX, written out so the interpreter (numpy) does not warn
    e = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(den == 0.0, 1.0, den))
    e = tl.where(den == 0.0, FLT_MAX, tl.minimum(e, FLT_MAX))
    e = tl.where(s == 0.0, 0.0, e)
    xe = tl.minimum(tl.maximum(x * e, -6.0), 6.0)
    return round_magnitude(tl.abs(xe), rbits, 1, 0, 6.0, ROUND)


@triton.jit
def _four_and_six(x, neg, t, inv_s, rbits, ROUND: tl.constexpr):
    """Four Over Six candidates: (s4, s6, d4, d6), the E4M3 scales e4m3(1.5 t) and e4m3(t) and the
    reconstruction errors x^ - x each gives; the caller keeps s4 where its block error is smaller."""
    s6 = _e4m3_rne(t)
    s4 = _e4m3_rne(t * 1.5)
    v6 = _e2m1_magnitude(x, s6, inv_s, rbits, ROUND)
    v4 = _e2m1_magnitude(x, s4, inv_s, rbits, ROUND)
    d6 = (tl.where(neg, -v6, v6) * s6) * inv_s - x
    d4 = (tl.where(neg, -v4, v4) * s4) * inv_s - x
    return s4, s6, d4, d6


@triton.jit
def _halve(v, BB: tl.constexpr, H: tl.constexpr):
    """[BB, 2H] -> [BB, H]: v[:, i] + v[:, i + H] (one level of ``block_error.tree_sum``)."""
    a, b = tl.split(tl.permute(tl.reshape(v, [BB, 2, H]), [0, 2, 1]))
    return a + b


@triton.jit
def _block_error(d, BB: tl.constexpr, ERR: tl.constexpr):
    """Error of each block [BB, 16] -> [BB, 1]: sum d^2 / sum |d| (pairwise tree) or max |d|."""
    if ERR == 2:
        return tl.reshape(tl.max(tl.abs(d), axis=1), [BB, 1])
    if ERR == 0:
        v = d * d
    else:
        v = tl.abs(d)
    v = _halve(v, BB, 8)
    v = _halve(v, BB, 4)
    v = _halve(v, BB, 2)
    return _halve(v, BB, 1)


@triton.jit
def _swizzled_offset(row, col, rows_per_batch, nb):
    """Offset of scale (row, col) of a [B*rows_per_batch, nb] scale matrix in the flat 128x4
    swizzled layout (``swizzle.swizzle_scales``, per leading index b = row // rows_per_batch)."""
    b = row // rows_per_batch
    r = row % rows_per_batch
    mp = (rows_per_batch + 127) // 128 * 128
    kp = (nb + 3) // 4 * 4
    tile = (r // 128) * (kp // 4) + col // 4
    return b * (mp * kp) + tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + col % 4


@triton.jit(do_not_specialize=["seed", "offset"])  # a fresh seed per call must not recompile
def _nvfp4_quantize_kernel(
    x_ptr, s_ptr, codes_ptr, scales_ptr, values_ptr,
    n_blocks, nb, K, stride_row, s_stride, seed, offset, rows_per_batch,
    RULE: tl.constexpr, ERR: tl.constexpr, ROUND: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, SWIZZLE: tl.constexpr, BB: tl.constexpr,
    BF16: tl.constexpr,
):
    """One program = BB blocks of 16 of the flattened [R, nb] block grid.

    x: [R, K] (row stride ``stride_row``), read as zeros past K (the reference zero-pads K to
    Kp = 16*nb); BF16 inputs come as int16 bit patterns (``BF16``). S: FP32 outer encode scale at
    ``s_ptr + row * s_stride``. Writes packed codes [R, Kp/2] uint8, E4M3 scale bytes [R, nb] uint8
    and, if asked, x^ [R, Kp] FP32.
    """
    pid = tl.program_id(0)
    bid = pid.to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)  # [BB]
    bmask = bid < n_blocks
    row = bid // nb
    col = (bid % nb) * BLOCK  # first column of the block
    i16 = tl.arange(0, BLOCK)
    cols = col[:, None] + i16[None, :]
    m = bmask[:, None] & (cols < K)
    x = load_f32(x_ptr + row[:, None] * stride_row + cols, m, BF16)
    S = tl.reshape(tl.load(s_ptr + row * s_stride, mask=bmask, other=1.0), [BB, 1])
    inv_s = tl.math.div_rn(tl.full(S.shape, 1.0, tl.float32), S)
    neg = x.to(tl.int32, bitcast=True) < 0  # sign bit of the input, -0.0 included

    if ROUND > 0:
        ctr = (offset + bid[:, None] * BLOCK + i16[None, :]).to(tl.uint32)  # wraps mod 2**32
        rbits = tl.randint(seed, ctr).to(tl.int32, bitcast=True)
    else:
        rbits = 0

    amax = tl.reshape(tl.max(tl.abs(x), axis=1), [BB, 1])
    t = amax * (S * (1.0 / 6.0))
    if RULE == 0:
        s = _e4m3_rne(t)
    elif RULE == 1:
        s = _e4m3_rne(t * 1.5)
    else:
        s4, s6, d4, d6 = _four_and_six(x, neg, t, inv_s, rbits, ROUND)
        s = tl.where(_block_error(d4, BB, ERR) < _block_error(d6, BB, ERR), s4, s6)  # ties keep 6

    v = _e2m1_magnitude(x, s, inv_s, rbits, ROUND)
    if SWIZZLE:
        s_off = _swizzled_offset(row, bid % nb, rows_per_batch, nb)
    else:
        s_off = bid
    tl.store(scales_ptr + s_off, tl.reshape(_e4m3_byte(s), [BB]).to(tl.uint8), mask=bmask)
    if WRITE_CODES:
        idx = tl.where(v < 2.0, v * 2.0, tl.where(v < 4.0, v + 2.0, v * 0.5 + 4.0)).to(tl.int32)
        code = idx | (neg.to(tl.int32) << 3)
        lo, hi = tl.split(tl.reshape(code, [BB, BLOCK // 2, 2]))  # element 2i low nibble, 2i+1 high
        byte = (lo | (hi << 4)).to(tl.uint8)
        i8 = tl.arange(0, BLOCK // 2)
        tl.store(codes_ptr + bid[:, None] * (BLOCK // 2) + i8[None, :], byte, mask=bmask[:, None])
    if WRITE_VALUES:
        xhat = (tl.where(neg, -v, v) * s) * inv_s
        tl.store(values_ptr + bid[:, None] * BLOCK + i16[None, :], xhat, mask=bmask[:, None])


@triton.jit
def _tile_error(d, TB: tl.constexpr, ERR: tl.constexpr):
    """Error of each 16x16 tile [TB, 16, 16] -> [TB, 1, 1], in ``block_error.tile_error``'s order:
    V = d^2 or |d|; P = V + V^T; pairwise tree over P's 256 entries (row-major); x0.5. maxabs: max |d|."""
    if ERR == 2:
        return tl.reshape(tl.max(tl.max(tl.abs(d), axis=2), axis=1), [TB, 1, 1])
    if ERR == 0:
        v = d * d
    else:
        v = tl.abs(d)
    p = tl.reshape(v + tl.permute(v, [0, 2, 1]), [TB, 256])
    p = _halve(p, TB, 128)
    p = _halve(p, TB, 64)
    p = _halve(p, TB, 32)
    p = _halve(p, TB, 16)
    p = _halve(p, TB, 8)
    p = _halve(p, TB, 4)
    p = _halve(p, TB, 2)
    p = _halve(p, TB, 1)
    return tl.reshape(p * 0.5, [TB, 1, 1])


@triton.jit(do_not_specialize=["seed", "offset"])
def _nvfp4_tile_quantize_kernel(
    x_ptr, s_ptr, codes_ptr, scales_ptr, values_ptr,
    n_tiles, nbm, nbk, M, K, stride_b, stride_row, s_stride, seed, offset,
    RULE: tl.constexpr, ERR: tl.constexpr, ROUND: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, SWIZZLE: tl.constexpr, TB: tl.constexpr,
    BF16: tl.constexpr,
):
    """One program = TB tiles of 16x16 of the [B, nbm, nbk] tile grid of x [B, M, K].

    Rows past M and columns past K read as zeros (the reference zero-pads both to 16); BF16 inputs
    come as int16 bit patterns (``BF16``). S: the tile's FP32 outer encode scale, read at its first
    row (``s_ptr + (b*M + row) * s_stride``).
    Outputs are per real row (row < M): packed codes [B*M, Kp/2], scale bytes [B*M, nbk] (the
    tile's scale on each of its rows; or swizzled), FP32 x^ [B*M, Kp].
    """
    pid = tl.program_id(0)
    tid = pid.to(tl.int64) * TB + tl.arange(0, TB).to(tl.int64)  # [TB]
    tmask = tid < n_tiles
    b = tid // (nbm * nbk)
    tr = (tid // nbk) % nbm
    tc = tid % nbk
    i16 = tl.arange(0, BLOCK)
    rows = tr[:, None, None] * BLOCK + i16[None, :, None]  # [TB, 16, 1], within the batch
    cols = tc[:, None, None] * BLOCK + i16[None, None, :]  # [TB, 1, 16]
    rmask = tmask[:, None, None] & (rows < M)
    m = rmask & (cols < K)
    x = load_f32(x_ptr + b[:, None, None] * stride_b + rows * stride_row + cols, m, BF16)
    S = tl.reshape(tl.load(s_ptr + (b * M + tr * BLOCK) * s_stride, mask=tmask, other=1.0), [TB, 1, 1])
    inv_s = tl.math.div_rn(tl.full(S.shape, 1.0, tl.float32), S)
    neg = x.to(tl.int32, bitcast=True) < 0

    if ROUND > 0:  # element index in the padded [B, Mp, Kp] layout
        ctr = (offset + (b[:, None, None] * (nbm * BLOCK) + rows) * (nbk * BLOCK) + cols).to(tl.uint32)
        rbits = tl.randint(seed, ctr).to(tl.int32, bitcast=True)
    else:
        rbits = 0

    amax = tl.reshape(tl.max(tl.max(tl.abs(x), axis=2), axis=1), [TB, 1, 1])
    t = amax * (S * (1.0 / 6.0))
    if RULE == 0:
        s = _e4m3_rne(t)
    elif RULE == 1:
        s = _e4m3_rne(t * 1.5)
    else:
        s4, s6, d4, d6 = _four_and_six(x, neg, t, inv_s, rbits, ROUND)
        s = tl.where(_tile_error(d4, TB, ERR) < _tile_error(d6, TB, ERR), s4, s6)  # ties keep 6

    v = _e2m1_magnitude(x, s, inv_s, rbits, ROUND)
    grow = b[:, None, None] * M + rows  # [TB, 16, 1] row of the [B*M, ...] outputs
    sbyte = tl.reshape(_e4m3_byte(s), [TB, 1]).to(tl.uint8) + tl.zeros([TB, BLOCK], tl.uint8)
    if SWIZZLE:
        s_off = _swizzled_offset(tl.reshape(grow, [TB, BLOCK]), tc[:, None], M, nbk)
    else:
        s_off = tl.reshape(grow, [TB, BLOCK]) * nbk + tc[:, None]
    tl.store(scales_ptr + s_off, sbyte, mask=tl.reshape(rmask, [TB, BLOCK]))
    if WRITE_CODES:
        idx = tl.where(v < 2.0, v * 2.0, tl.where(v < 4.0, v + 2.0, v * 0.5 + 4.0)).to(tl.int32)
        code = idx | (neg.to(tl.int32) << 3)
        lo, hi = tl.split(tl.reshape(code, [TB, BLOCK, BLOCK // 2, 2]))
        byte = (lo | (hi << 4)).to(tl.uint8)
        i8 = tl.arange(0, BLOCK // 2)
        tl.store(codes_ptr + grow * (nbk * (BLOCK // 2)) + tc[:, None, None] * (BLOCK // 2) + i8[None, None, :],
                 byte, mask=rmask)
    if WRITE_VALUES:
        xhat = (tl.where(neg, -v, v) * s) * inv_s
        tl.store(values_ptr + grow * (nbk * BLOCK) + cols, xhat, mask=rmask)


@triton.jit
def _nvfp4_dequantize_kernel(codes_ptr, scales_ptr, inv_s_ptr, out_ptr, n_blocks, nb, inv_s_stride,
                             BB: tl.constexpr):
    """x^ = (q * s) * inv_S for packed codes [R, Kp/2], E4M3 scale bytes [R, nb] -> FP32 [R, Kp]."""
    pid = tl.program_id(0)
    bid = pid.to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)
    bmask = bid < n_blocks
    row = bid // nb
    i16 = tl.arange(0, BLOCK)
    # byte j of the block holds elements 2j (low nibble) and 2j+1 (high nibble)
    byte = tl.load(codes_ptr + bid[:, None] * (BLOCK // 2) + (i16 // 2)[None, :], mask=bmask[:, None], other=0)
    code = (byte.to(tl.int32) >> ((i16 % 2) * 4)[None, :]) & 0xF
    idx = code & 7
    mag = tl.where(idx < 4, idx.to(tl.float32) * 0.5,
                   tl.where(idx < 6, (idx - 2).to(tl.float32), tl.where(idx == 6, 4.0, 6.0)))
    q = tl.where(code >= 8, -mag, mag)
    sb = tl.load(scales_ptr + bid, mask=bmask, other=0).to(tl.int32)
    ex = (sb >> 3) & 0xF
    normal = (((ex + 120) << 23) | ((sb & 7) << 20)).to(tl.float32, bitcast=True)
    s = tl.where(ex == 0, (sb & 7).to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    s = tl.where((sb & 0x7F) == 0x7F, float("nan"), s)
    inv_s = tl.load(inv_s_ptr + row * inv_s_stride, mask=bmask, other=1.0)
    out = (q * tl.reshape(s, [BB, 1])) * tl.reshape(inv_s, [BB, 1])
    tl.store(out_ptr + bid[:, None] * BLOCK + i16[None, :], out, mask=bmask[:, None])


def per_row(v: torch.Tensor, rows: int, name: str):
    """FP32 per-row vector and its stride: one scalar (stride 0) or one value per row."""
    v = v.detach().to(torch.float32).reshape(-1)
    if v.numel() not in (1, rows):
        raise ValueError(f"{name} must hold 1 or {rows} values (one per row), got {v.numel()}")
    if v.numel() == 1 or v.stride(0) == 0:  # a scalar, possibly expanded to [R]: read it once
        return v[:1].contiguous(), 0
    return v.contiguous(), 1


def quantize_nvfp4_2d(x: torch.Tensor, S: torch.Tensor, scale_rule: str = "6", error: str = "mse",
                      rounding: str = "nearest", sr_mode: str = "hardware", seed: int = 0, offset: int = 0,
                      want_codes: bool = True, want_values: bool = False, scale_layout: str = "plain",
                      rows_per_batch: int | None = None):
    """NVFP4-quantize 2-D ``x`` [R, K] (FP32 / BF16 / FP16, unit stride along K) with 1x16 blocks.

    S: FP32 outer encode scale(s), computed by the caller as the reference does (``outer_scale``):
    one scalar, or [R] (one per row). Returns ``(codes, scale_bytes, values)``: packed uint8
    [R, Kp/2] (None unless want_codes), E4M3 bit patterns uint8 [R, Kp/16] (``.view(torch.float8_e4m3fn)``),
    FP32 x^ [R, Kp] (None unless want_values); Kp = K rounded up to 16, the padding quantized as zeros.

    scale_layout "swizzled": the scale bytes instead come flat in the cuBLAS 128x4 layout, equal to
    ``swizzle_scales(scales.view(B, R/B, nb))`` with B = R / rows_per_batch (default: one matrix).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4_2d expects a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_nvfp4_2d: unsupported dtype {x.dtype}")
    if scale_rule not in RULES or error not in ERRORS:
        raise ValueError(f"Triton NVFP4 kernel supports scale_rule {list(RULES)} and error {list(ERRORS)}, "
                         f"got {scale_rule!r}, {error!r}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    R, K = x.shape
    nb = (K + BLOCK - 1) // BLOCK
    Kp = nb * BLOCK
    S, s_stride = per_row(S.to(x.device), R, "S")
    dev = x.device
    rpb = R if rows_per_batch is None else int(rows_per_batch)
    swizzle = _check_layout(scale_layout)
    if swizzle and (rpb <= 0 or R % rpb) and R:
        raise ValueError(f"rows_per_batch={rows_per_batch} must divide the {R} rows")
    scales = (_swizzled_empty(R // max(rpb, 1), rpb, nb, dev) if swizzle
              else torch.empty(R, nb, dtype=torch.uint8, device=dev))
    codes = torch.empty(R, Kp // 2, dtype=torch.uint8, device=dev) if want_codes else None
    values = torch.empty(R, Kp, dtype=torch.float32, device=dev) if want_values else None
    n_blocks = R * nb
    if n_blocks:
        grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
        xk, bf16 = bits_view(x)
        _nvfp4_quantize_kernel[grid](
            xk, S, scales if codes is None else codes, scales, scales if values is None else values,
            n_blocks, nb, K, x.stride(0), s_stride, int(seed), int(offset), max(rpb, 1),
            RULE=RULES[scale_rule], ERR=ERRORS[error], ROUND=rounding_id(rounding, sr_mode),
            WRITE_CODES=want_codes, WRITE_VALUES=want_values, SWIZZLE=swizzle, BB=BLOCKS_PER_PROGRAM,
            BF16=bf16, enable_fp_fusion=False,
        )
    return codes, scales, values


def _check_layout(scale_layout: str) -> bool:
    if scale_layout not in ("plain", "swizzled"):
        raise ValueError(f"scale_layout={scale_layout!r}: expected 'plain' or 'swizzled'")
    return scale_layout == "swizzled"


def _swizzled_empty(batches: int, rows: int, nb: int, device) -> torch.Tensor:
    """Zero-filled flat swizzled scale buffer [B * ceil(rows/128)*128 * ceil(nb/4)*4] (padding stays 0)."""
    return torch.zeros(batches * (-(-rows // 128) * 128) * (-(-nb // 4) * 4), dtype=torch.uint8, device=device)


def quantize_nvfp4_tiles(x: torch.Tensor, S: torch.Tensor, scale_rule: str = "6", error: str = "mse",
                         rounding: str = "nearest", sr_mode: str = "hardware", seed: int = 0, offset: int = 0,
                         want_codes: bool = True, want_values: bool = False, scale_layout: str = "plain"):
    """NVFP4-quantize ``x`` [B, M, K] (or [M, K]) with 16x16 tiles over (M, K): one E4M3 scale per tile
    (``NVFP4(block_2d=True)``), values packed along K.

    S: FP32 outer encode scale(s): one scalar, or [B*M] (one per row, e.g. per group; a tile uses its
    first row's). Returns ``(codes, scale_bytes, values)``: packed uint8 [B*M, Kp/2], E4M3 bytes
    uint8 [B*M, Kp/16] (each row of a tile holds the tile's scale), FP32 x^ [B*M, Kp] (or None);
    M and K are zero-padded to 16 inside the kernel, only real rows are written. Stochastic rounding
    draws ``tl.randint(seed, offset + i)`` with i the index in the padded [B, Mp, Kp] layout.
    scale_layout "swizzled": scale bytes flat in the 128x4 layout, = ``swizzle_scales(scales.view(B, M, nb))``.
    """
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if x.dim() != 3:
        raise ValueError(f"quantize_nvfp4_tiles expects [M, K] or [B, M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_nvfp4_tiles: unsupported dtype {x.dtype}")
    if scale_rule not in RULES or error not in ERRORS:
        raise ValueError(f"Triton NVFP4 kernel supports scale_rule {list(RULES)} and error {list(ERRORS)}, "
                         f"got {scale_rule!r}, {error!r}")
    if x.shape[2] > 1 and x.stride(2) != 1:
        x = x.contiguous()
    B, M, K = x.shape
    nbm, nbk = -(-M // BLOCK), -(-K // BLOCK)
    Kp = nbk * BLOCK
    S, s_stride = per_row(S.to(x.device), B * M, "S")
    dev = x.device
    swizzle = _check_layout(scale_layout)
    scales = _swizzled_empty(B, M, nbk, dev) if swizzle else torch.empty(B * M, nbk, dtype=torch.uint8, device=dev)
    codes = torch.empty(B * M, Kp // 2, dtype=torch.uint8, device=dev) if want_codes else None
    values = torch.empty(B * M, Kp, dtype=torch.float32, device=dev) if want_values else None
    n_tiles = B * nbm * nbk
    if n_tiles:
        grid = (triton.cdiv(n_tiles, TILES_PER_PROGRAM),)
        xk, bf16 = bits_view(x)
        _nvfp4_tile_quantize_kernel[grid](
            xk, S, scales if codes is None else codes, scales, scales if values is None else values,
            n_tiles, nbm, nbk, M, K, x.stride(0), x.stride(1), s_stride, int(seed), int(offset),
            RULE=RULES[scale_rule], ERR=ERRORS[error], ROUND=rounding_id(rounding, sr_mode),
            WRITE_CODES=want_codes, WRITE_VALUES=want_values, SWIZZLE=swizzle, TB=TILES_PER_PROGRAM,
            BF16=bf16, enable_fp_fusion=False,
        )
    return codes, scales, values


def dequantize_nvfp4_2d(codes: torch.Tensor, scale_bytes: torch.Tensor, inv_s: torch.Tensor) -> torch.Tensor:
    """FP32 x^ [R, Kp] = (q * s) * inv_S from packed codes [R, Kp/2] uint8, E4M3 scales [R, Kp/16]
    (uint8 bit patterns or float8_e4m3fn) and inv_S = 1/S (one scalar or [R], computed by the caller)."""
    if scale_bytes.dtype == torch.float8_e4m3fn:
        scale_bytes = scale_bytes.view(torch.uint8)
    R, half = codes.shape
    nb = scale_bytes.shape[-1]
    if half != nb * (BLOCK // 2) or scale_bytes.shape[0] != R:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scale_bytes.shape)} do not match")
    inv_s, stride = per_row(inv_s.to(codes.device), R, "inv_s")
    out = torch.empty(R, nb * BLOCK, dtype=torch.float32, device=codes.device)
    if R * nb:
        grid = (triton.cdiv(R * nb, BLOCKS_PER_PROGRAM),)
        _nvfp4_dequantize_kernel[grid](codes.contiguous(), scale_bytes.contiguous(), inv_s, out, R * nb, nb, stride,
                                       BB=BLOCKS_PER_PROGRAM, enable_fp_fusion=False)
    return out


__all__ = ["dequantize_nvfp4_2d", "quantize_nvfp4_2d", "quantize_nvfp4_tiles", "random_bits", "rounding_id"]
