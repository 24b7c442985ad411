"""S2F6 (int8 x 2**-6, one UE8M0 scale per 32 values along the last dim) quantize / dequantize as
Triton kernels, with the optional 32-point random Hadamard transform fused in.

Same FP32 operations, in the same order, as the reference (``quant/s2f6/quantize.py``, ``quant/transforms/hadamard.py``):

    x'  = butterfly(x * signs) * FP32(1/sqrt(32))      butterfly: h = 1, 2, 4, 8, 16; pairs (i, i + h)
                                                        of each 2h group -> (a + b, a - b)
    k   = UE8M0 exponent of max|x'| for max_elem 127/64 ("ceil") or emax 0 ("floor")
    c   = sign * min(round(|x' * 2**h * 2**(-k-h)| * 64), 127)   (RNE or stochastic, integer bit arithmetic)
    x^  = butterfly((c * 2**-6) * 2**k) * FP32(1/sqrt(32)) * signs

Launched with ``enable_fp_fusion=False``. Stochastic rounding: ``tl.randint(seed, offset + r*Kp + c)``
per element of the padded [R, Kp] layout, as the MX kernels (``mx_triton.random_bits`` gives the draws).
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from .common import (BLOCKS_PER_PROGRAM, RULES, bits_view, load_f32, mul_pow2, randbits, round_magnitude,
                        scale_exponent, ue8m0_value, max_bits, rounding_id)

BLOCK = 32
S2F6_MAX = 127.0 / 64.0
# the reference multiplies an FP32 tensor by the Python float 1/sqrt(32): torch rounds it to FP32 first
INV_SQRT32 = struct.unpack("<f", struct.pack("<f", 1.0 / math.sqrt(BLOCK)))[0]
_MC, _EC = max_bits(S2F6_MAX)


@triton.jit
def _stage(v, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
    """One butterfly level on [N, 32]: in each group of 2H, (a, b) = (v[i], v[i + H]) -> (a + b, a - b)."""
    w = tl.permute(tl.reshape(v, [N, G, 2, H]), [0, 1, 3, 2])  # [N, G, H, 2]
    a, b = tl.split(w)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [N, 32])


@triton.jit
def _butterfly32(v, N: tl.constexpr):
    """``hadamard._butterfly`` over the last dim (32) of [N, 32]: unnormalised Walsh-Hadamard."""
    v = _stage(v, N, 16, 1)
    v = _stage(v, N, 8, 2)
    v = _stage(v, N, 4, 4)
    v = _stage(v, N, 2, 8)
    return _stage(v, N, 1, 16)


@triton.jit(do_not_specialize=["seed", "offset"])
def _s2f6_quantize_kernel(x_ptr, signs_ptr, codes_ptr, scales_ptr, n_blocks, nb, K, stride_row, seed, offset,
                          C: tl.constexpr, MC: tl.constexpr, EC: tl.constexpr, RULE: tl.constexpr,
                          ROUND: tl.constexpr, HADAMARD: tl.constexpr, BB: tl.constexpr, BF16: tl.constexpr):
    """BB blocks of 32 of the [R, nb] grid of x [R, K] (zeros past K) -> int8 codes [R, Kp], UE8M0 [R, nb]."""
    bid = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)
    bmask = bid < n_blocks
    row = bid // nb
    blk = bid % nb
    i32 = tl.arange(0, 32)
    cols = blk[:, None] * 32 + i32[None, :]
    x = load_f32(x_ptr + row[:, None] * stride_row + cols, bmask[:, None] & (cols < K), BF16)
    if HADAMARD:
        s = tl.load(signs_ptr + i32)
        x = _butterfly32(x * s[None, :], BB) * C
    amax = tl.reshape(tl.max(tl.abs(x), axis=1), [BB, 1])
    k = scale_exponent(amax, RULE, MC, EC, 0)
    scaled = mul_pow2(x, -k)
    rbits = 0
    if ROUND > 0:
        rbits = randbits(seed, offset, row, blk * 32, nb * 32, BB)
    # integer rounding of t = |scaled| * 64 < 128: quantum 1 (MBITS = EMIN = 7), saturate at 127
    r = round_magnitude(tl.abs(scaled) * 64.0, rbits, 7, 7, 127.0, ROUND).to(tl.int32)
    code = tl.where(scaled.to(tl.int32, bitcast=True) < 0, -r, r)
    tl.store(codes_ptr + bid[:, None] * 32 + i32[None, :], code.to(tl.int8), mask=bmask[:, None])
    tl.store(scales_ptr + bid, tl.reshape(k + 127, [BB]).to(tl.uint8), mask=bmask)


@triton.jit
def _s2f6_dequantize_kernel(codes_ptr, scales_ptr, signs_ptr, out_ptr, n_blocks, C: tl.constexpr,
                            HADAMARD: tl.constexpr, BB: tl.constexpr):
    """x^ [R, Kp] FP32 = inverse rotation of (c * 2**-6) * 2**(b-127)."""
    bid = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB).to(tl.int64)
    bmask = bid < n_blocks
    i32 = tl.arange(0, 32)
    c = tl.load(codes_ptr + bid[:, None] * 32 + i32[None, :], mask=bmask[:, None], other=0)
    sb = tl.load(scales_ptr + bid, mask=bmask, other=127).to(tl.int32)
    v = (c.to(tl.float32) * 0.015625) * tl.reshape(ue8m0_value(sb), [BB, 1])
    if HADAMARD:
        s = tl.load(signs_ptr + i32)
        v = (_butterfly32(v, BB) * C) * s[None, :]
    tl.store(out_ptr + bid[:, None] * 32 + i32[None, :], v, mask=bmask[:, None])


def _signs(signs, device):
    if signs is None:
        return None
    s = torch.as_tensor(signs, dtype=torch.float32, device=device).reshape(-1).contiguous()
    if s.numel() != BLOCK:
        raise ValueError(f"signs must hold {BLOCK} values, got {s.numel()}")
    return s


def quantize_s2f6_2d(x: torch.Tensor, signs: torch.Tensor | None, scale_rule: str = "ceil",
                     rounding: str = "nearest", sr_mode: str = "hardware", seed: int = 0, offset: int = 0):
    """S2F6-quantize 2-D ``x`` [R, K] (FP32 / BF16 / FP16) in blocks of 32 along K, rotating each block
    first when ``signs`` (the ±1 FP32 vector of ``hadamard.random_signs(32, seed)``) is given.

    Returns ``(codes, scale_bytes)``: int8 [R, Kp] and UE8M0 uint8 [R, Kp/32], Kp = K rounded up to 32
    (the reference zero-pads K before rotating)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_s2f6_2d expects a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_s2f6_2d: unsupported dtype {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    R, K = x.shape
    nb = -(-K // BLOCK)
    codes = torch.empty(R, nb * BLOCK, dtype=torch.int8, device=x.device)
    scales = torch.empty(R, nb, dtype=torch.uint8, device=x.device)
    s = _signs(signs, x.device)
    if R * nb:
        grid = (triton.cdiv(R * nb, BLOCKS_PER_PROGRAM),)
        xk, bf16 = bits_view(x)
        _s2f6_quantize_kernel[grid](xk, scales if s is None else s, codes, scales, R * nb, nb, K, x.stride(0),
                                    int(seed), int(offset), C=INV_SQRT32, MC=_MC, EC=_EC, RULE=RULES[scale_rule],
                                    ROUND=rounding_id(rounding, sr_mode), HADAMARD=s is not None,
                                    BB=BLOCKS_PER_PROGRAM, BF16=bf16, enable_fp_fusion=False)
    return codes, scales


def dequantize_s2f6_2d(codes: torch.Tensor, scale_bytes: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """FP32 x^ [R, Kp] from int8 codes [R, Kp] and UE8M0 bytes [R, Kp/32], the rotation undone."""
    R, nb = scale_bytes.shape
    if codes.shape != (R, nb * BLOCK):
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scale_bytes.shape)} do not match")
    out = torch.empty(R, nb * BLOCK, dtype=torch.float32, device=codes.device)
    s = _signs(signs, codes.device)
    if R * nb:
        grid = (triton.cdiv(R * nb, BLOCKS_PER_PROGRAM),)
        _s2f6_dequantize_kernel[grid](codes.contiguous(), scale_bytes.contiguous(), out if s is None else s, out,
                                      R * nb, C=INV_SQRT32, HADAMARD=s is not None, BB=BLOCKS_PER_PROGRAM,
                                      enable_fp_fusion=False)
    return out


__all__ = ["quantize_s2f6_2d", "dequantize_s2f6_2d"]
