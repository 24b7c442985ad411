"""S2F6 block quantizer for communication: blocks of 32, one UE8M0 scale, int8 x 2**-6 values,
optionally rotated first by a 32-point random Hadamard transform (8.25 bits per value).

    x' = hadamard(x, 32, signs(seed))           if spec.hadamard (zero padding to 32 first)
    k  = ceil(log2(amax' / (127/64)))           ("floor": floor(log2 amax'), values saturate)
    c  = clamp(round(x' * 2**-k * 64), -127, 127)  (int8)
    x^ = inverse_hadamard(c / 64 * 2**k)
"""
from __future__ import annotations

import math

import torch

from ...formats.constants import S2F6_BLOCK
from ...formats.minifloat import mul_pow2
from ...formats.s2f6 import S2F6_MAX, decode_s2f6, encode_s2f6
from ...formats.ue8m0 import decode_ue8m0, encode_ue8m0
from ..backend import want_compiled, want_triton
from ..fast_kernel import fast_kernel
from ..blocking import abs_max, draw_random, pad_dim, random_from_bits, row_chunks, triton_seed
from ..transforms.hadamard import inverse_rht_blocks, random_signs, rht_blocks
from ..mx.scales import block_exponent
from ..tensor import QuantizedTensor
from .spec import S2F6

BLOCK = S2F6_BLOCK
_ROTATION_LIMIT = torch.finfo(torch.float32).max / BLOCK


def _s2f6_blocks(xb, signs, rand, rule: str, rounding: str, sr_mode: str):
    """Blocks [R, nb, 32] (rotated first when ``signs`` is given) -> (int8 codes [R, nb*32], b [R, nb])."""
    xb = xb.float()
    if signs is not None:
        xb = rht_blocks(xb, signs)
    amax = torch.abs(xb).amax(dim=-1, keepdim=True)
    k = block_exponent(amax, rule, S2F6_MAX, 0)
    codes = encode_s2f6(mul_pow2(xb, -k), rounding, rand, sr_mode)
    return codes.reshape(xb.shape[0], -1), encode_ue8m0(k.squeeze(-1))


def _s2f6_dequant_blocks(codes, b, signs, out_dtype):
    r, nb = b.shape
    v = decode_s2f6(codes).view(r, nb, BLOCK) * decode_ue8m0(b).unsqueeze(-1)
    if signs is not None:
        v = inverse_rht_blocks(v, signs)
    return v.reshape(r, nb * BLOCK).to(out_dtype)


_s2f6_blocks_fast = fast_kernel(_s2f6_blocks)
_s2f6_dequant_blocks_fast = fast_kernel(_s2f6_dequant_blocks)


def quantize_s2f6(x: torch.Tensor, spec: S2F6, generator: torch.Generator | None = None,
                  rand_bits: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize finite FP32 ``x`` to S2F6 along the last dim (padded to whole blocks of 32).

    rand_bits: stochastic rounding only: raw uint32 draws (int32/int64 bit patterns), one per element
    of the padded [R, Kp] layout, used instead of drawing from ``generator`` (see
    ``blocking.random_from_bits``; e.g. ``triton_kernels.mx_triton.random_bits``). Forces the torch kernels.

    CUDA tensors (and CPU tensors under backend "triton" with TRITON_INTERPRET=1) go to the Triton
    kernel when ``backend.want_triton`` says so: same bits for "nearest"; stochastic rounding then
    draws from Philox seeded by ``generator``.
    """
    shape = x.shape
    K = shape[-1] if x.dim() else 1
    x2 = x.reshape(math.prod(shape[:-1]) if x.dim() else 1, K)
    R, Kp = x2.shape[0], K + (-K) % BLOCK
    nb = Kp // BLOCK
    if spec.hadamard and x.numel() and abs_max(x).item() > _ROTATION_LIMIT:
        raise ValueError(f"S2F6(hadamard=True): |x| must stay below FLT_MAX/32 = {_ROTATION_LIMIT:.3e} "
                         "(the 32-point butterfly adds 32 values); use hadamard=False for such data")
    signs = random_signs(BLOCK, spec.seed, device=x.device) if spec.hadamard else None
    lead = tuple(shape[:-1]) if x.dim() else ()
    if rand_bits is None and R * Kp and want_triton(x):
        from ..triton_kernels.s2f6_triton import quantize_s2f6_2d

        seed = triton_seed(generator, x.device) if spec.rounding == "stochastic" else 0
        codes, scales = quantize_s2f6_2d(x2, signs, spec.scale_rule, spec.rounding, spec.sr_mode,
                                         seed, 0)
        return QuantizedTensor(spec=spec, codes=codes.reshape(lead + (Kp,)), scales=scales.reshape(lead + (nb,)),
                               shape=shape, dtype=x.dtype, signs=signs)
    if rand_bits is not None and spec.rounding == "stochastic":
        rand = random_from_bits(rand_bits.to(x.device), (R, nb, BLOCK), spec.sr_mode)
    else:
        rand = draw_random((R, nb, BLOCK), spec.rounding, spec.sr_mode, generator, x.device)
    codes = torch.empty(R, Kp, dtype=torch.int8, device=x.device)
    scales = torch.empty(R, nb, dtype=torch.uint8, device=x.device)
    if R * Kp:
        fast = want_compiled(R * Kp, _s2f6_blocks_fast)
        kernel = _s2f6_blocks_fast if fast else _s2f6_blocks_fast.eager
        xb = pad_dim(x2, -1, BLOCK).reshape(R, nb, BLOCK)
        for rows in ([slice(0, R)] if fast else row_chunks(R, Kp)):
            c, b = kernel(xb[rows], signs, None if rand is None else rand[rows], spec.scale_rule,
                          spec.rounding, spec.sr_mode)
            codes[rows] = c
            scales[rows] = b
    return QuantizedTensor(spec=spec, codes=codes.reshape(lead + (Kp,)), scales=scales.reshape(lead + (nb,)),
                           shape=shape, dtype=x.dtype, signs=signs)


def dequantize_s2f6(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize and undo the rotation; padding dropped."""
    shape = q.shape
    K = shape[-1] if len(shape) else 1
    nb = q.scales.shape[-1]
    R = math.prod(shape[:-1]) if len(shape) else 1
    if R * K == 0:
        return torch.zeros(shape, dtype=dtype, device=q.device)
    codes = q.codes.reshape(R, nb * BLOCK)
    b = q.scales.reshape(R, nb)
    if want_triton(codes):
        from ..triton_kernels.s2f6_triton import dequantize_s2f6_2d

        out = dequantize_s2f6_2d(codes, b, q.signs).to(dtype)
    elif want_compiled(R * nb * BLOCK, _s2f6_dequant_blocks_fast):
        out = _s2f6_dequant_blocks_fast(codes, b, q.signs, dtype)
    else:
        out = torch.empty(R, nb * BLOCK, dtype=dtype, device=q.device)
        for rows in row_chunks(R, nb * BLOCK):
            out[rows] = _s2f6_dequant_blocks_fast.eager(codes[rows], b[rows], q.signs, dtype)
    return out[:, :K].reshape(shape)
