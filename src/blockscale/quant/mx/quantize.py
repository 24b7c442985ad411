"""MX formats (MXFP8 E4M3 / E5M2, MXFP4 E2M1): one UE8M0 scale per 32 values along ``spec.dim``.

    k  = ceil(log2(block_amax / max_elem))      "ceil" (default; nothing saturates below FLT_MAX)
       = floor(log2(block_amax)) - emax_elem     "floor" (OCP v1.0; elements saturate to ±max)
    k clamped to [-127, 127]; zero block -> k = -127. Stored b = k + 127 (uint8).
    v  = round(x * 2**-k)                        RNE or stochastic, onto the element grid, then
         |v| <= v_lim(k) = min(max_elem, (2 - 2**-m) * 2**(127 - k))   (m mantissa bits)
    x^ = v * 2**k

v_lim(k) is the largest element with v_lim * 2**k <= FLT_MAX: finite inputs give finite x^. It is
below max_elem only for "ceil" blocks with k > 127 - emax_elem, i.e. amax > max_elem * 2**(127 -
emax_elem) (2.98e38 E4M3 / E5M2, 2.55e38 E2M1), e.g. amax = FLT_MAX, E4M3: k = 120, 255.99 rounds
to 256, saturated to v_lim = 240 (the peers give 256 * 2**120 = inf).
"""
from __future__ import annotations

import math

import torch

from ...formats.constants import element_format
from ...formats.e2m1 import decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from ...formats.fp8 import FP8_DTYPES, FP8_FORMATS, round_fp8
from ...formats.minifloat import mul_pow2
from ...formats.ue8m0 import decode_ue8m0, encode_ue8m0
from ..backend import want_compiled, want_triton
from ..fast_kernel import fast_kernel
from ..blocking import draw_random, pad_dim, random_from_bits, row_chunks, triton_seed
from ..tensor import QuantizedTensor
from .scales import BLOCK, block_exponent, element_limit
from .spec import MX

def encode_elements(scaled, element: str, rounding: str, rand, sr_mode: str, limit):
    """Scaled values -> (element codes of the same shape, unpacked: uint8 E2M1 or float8 values; their FP32
    values), each rounded to ``element`` within ``limit`` (``element_limit``; None: the element's max)."""
    if element == "e2m1":
        c = encode_e2m1(scaled, rounding, rand, sr_mode, limit)
        return c, decode_e2m1(c)
    v = round_fp8(scaled, FP8_FORMATS[element], rounding, rand, sr_mode, limit)
    return v.to(FP8_DTYPES[element]), v


def stored_codes(c, element: str):
    """Element codes [R, n] (``encode_elements``) as an MX tensor stores them: E2M1 packed two per byte
    [R, n/2] (element 2i in the low nibble), float8 codes as they are."""
    return pack_nibbles(c) if element == "e2m1" else c


def quantize_mx_blocks(xb, rand, element: str, rule: str, rounding: str, sr_mode: str, outputs: str = "codes"):
    """Blocks [R, nb, 32] -> (codes [R, nb*32] float8, or [R, nb*16] packed uint8 for e2m1; b [R, nb]
    uint8; dequantized FP32 values [R, nb*32] when ``outputs`` is "values" or "both")."""
    xb = xb.float()
    amax = torch.abs(xb).amax(dim=-1, keepdim=True)
    fmt = element_format(element)
    k = block_exponent(amax, rule, fmt.max, fmt.emax)
    scaled = mul_pow2(xb, -k)
    limit = element_limit(k, element) if rule == "ceil" else None  # "floor": k <= 127 - emax_elem
    r = xb.shape[0]
    codes = values = None
    c, v = encode_elements(scaled, element, rounding, rand, sr_mode, limit)
    if outputs != "values":
        codes = stored_codes(c.reshape(r, -1), element)
    if outputs != "codes":
        values = (v * decode_ue8m0(encode_ue8m0(k))).reshape(r, -1)
    return codes, encode_ue8m0(k.squeeze(-1)), values


_mx_blocks_fast = fast_kernel(quantize_mx_blocks)


def _mx_moved_blocks(xm, rand, element: str, rule: str, rounding: str, sr_mode: str, outputs: str = "codes"):
    """``quantize_mx_blocks`` on a strided view [..., K] (K a multiple of 32) whose blocks are formed here."""
    r = xm.numel() // xm.shape[-1]
    return quantize_mx_blocks(xm.reshape(r, -1, BLOCK), rand, element, rule, rounding, sr_mode, outputs)


_mx_moved_blocks_fast = fast_kernel(_mx_moved_blocks)


def _mx_dequant_blocks(codes, b, element: str, out_dtype):
    r, nb = b.shape
    v = decode_e2m1(unpack_nibbles(codes)) if element == "e2m1" else codes.to(torch.float32)
    return (v.view(r, nb, BLOCK) * decode_ue8m0(b).unsqueeze(-1)).view(r, nb * BLOCK).to(out_dtype)


_mx_dequant_blocks_fast = fast_kernel(_mx_dequant_blocks)


def _norm_dim(dim: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise ValueError(f"dim={dim} is out of range for a tensor with {ndim} dims")
    return dim % n


def _quantize_triton(x: torch.Tensor, dim: int, spec: MX, generator, outputs: str):
    """The Triton kernels' (codes, scale bytes, values) in the moved layout [R, Kp] of ``quantize_mx``."""
    from ..triton_kernels import mx_triton

    seed = triton_seed(generator, x.device) if spec.rounding == "stochastic" else 0
    want_codes, want_values = outputs != "values", outputs != "codes"
    if x.dim() == 0 or dim == x.dim() - 1:
        K = x.shape[-1] if x.dim() else 1
        return mx_triton.quantize_mx_rows(x.reshape(-1, K), spec, seed, 0, want_codes, want_values)
    shape = x.shape
    x3 = x.reshape(math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]))
    return mx_triton.quantize_mx_strided(x3, spec, seed, 0, want_codes, want_values)


def quantize_mx(x: torch.Tensor, spec: MX, generator: torch.Generator | None = None, outputs: str = "codes",
                rand_bits: torch.Tensor | None = None):
    """Quantize finite ``x`` to MX along ``spec.dim`` (padded to whole blocks of 32).

    outputs: "codes" -> QuantizedTensor; "values" -> dequantized FP32 tensor only; "both" -> both.

    rand_bits: stochastic rounding only: raw uint32 draws (int32/int64 bit patterns), one per element
    of the padded layout [R, Kp] (``spec.dim`` moved last), used instead of drawing from ``generator``
    (see ``blocking.random_from_bits``; e.g. ``triton_kernels.mx_triton.random_bits``). Forces the torch kernels.

    CUDA tensors (and CPU tensors under backend "triton" with TRITON_INTERPRET=1) go to the Triton
    kernels when ``backend.want_triton`` says so (every MX spec is covered): same bits for "nearest";
    stochastic rounding then draws from Philox seeded by ``generator``.
    """
    shape = x.shape
    dim = _norm_dim(spec.dim, x.dim())
    xm = (x.reshape(1) if x.dim() == 0 else x).movedim(dim, -1)
    moved = xm.shape
    K = moved[-1]
    R, Kp = math.prod(moved[:-1]), K + (-K) % BLOCK
    nb = Kp // BLOCK
    e2m1 = spec.element == "e2m1"
    want_codes, want_values = outputs != "values", outputs != "codes"
    if rand_bits is None and R * Kp and want_triton(x):
        codes, scales, values = _quantize_triton(x, dim, spec, generator, outputs)
        if codes is not None and not e2m1:
            codes = codes.view(FP8_DTYPES[spec.element])
    else:
        codes, scales, values = _quantize_torch(x, xm, spec, generator, outputs, R, K, Kp, rand_bits)
    if want_values:
        values = values[:, :K].reshape(moved).movedim(-1, dim).reshape(shape)
        if not want_codes:
            return values
    lead = tuple(moved[:-1])
    q = QuantizedTensor(spec=spec, codes=codes.reshape(lead + (codes.shape[-1],)),
                        scales=scales.reshape(lead + (nb,)), shape=shape, dtype=x.dtype)
    return (q, values) if want_values else q


def _quantize_torch(x, xm, spec: MX, generator, outputs: str, R: int, K: int, Kp: int, rand_bits):
    """The torch kernels' (codes, scale bytes, values) in the moved layout [R, Kp] of ``quantize_mx``."""
    nb = Kp // BLOCK
    fast = want_compiled(R * Kp, _mx_blocks_fast)
    if rand_bits is not None and spec.rounding == "stochastic":
        rand = random_from_bits(rand_bits.to(x.device), (R, nb, BLOCK), spec.sr_mode)
    else:
        rand = draw_random((R, nb, BLOCK), spec.rounding, spec.sr_mode, generator, x.device)
    if fast and Kp == K and not xm.is_contiguous() and _mx_moved_blocks_fast.ready():
        # blocks along a dim other than the last: let the compiled kernel read the strided layout
        # directly instead of copying the moved view first
        xb = xm
    else:
        xb = pad_dim(xm.reshape(R, K), -1, BLOCK).reshape(R, nb, BLOCK)
    e2m1 = spec.element == "e2m1"
    want_codes, want_values = outputs != "values", outputs != "codes"
    codes = values = None
    if not fast or R * Kp == 0:  # eager chunks write into preallocated outputs; the fast path returns them
        codes = torch.empty(R, Kp // 2 if e2m1 else Kp, dtype=torch.uint8 if e2m1 else FP8_DTYPES[spec.element],
                            device=x.device) if want_codes else None
        values = torch.empty(R, Kp, dtype=torch.float32, device=x.device) if want_values else None
        scales = torch.empty(R, nb, dtype=torch.uint8, device=x.device)
    if R * Kp:
        kernel = (_mx_moved_blocks_fast if xb is xm else _mx_blocks_fast) if fast else _mx_blocks_fast.eager
        for rows in ([slice(0, R)] if fast else row_chunks(R, Kp)):
            c, b, v = kernel(xb[rows], None if rand is None else rand[rows], spec.element, spec.scale_rule,
                             spec.rounding, spec.sr_mode, outputs)
            if fast:
                codes, scales, values = c, b, v
                continue
            if want_codes:
                codes[rows] = c
            if want_values:
                values[rows] = v
            scales[rows] = b
    return codes, scales, values


def dequantize_mx(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x^ = v * 2**(b - 127), moved back to the original layout, padding dropped."""
    shape = q.shape
    dim = _norm_dim(q.spec.dim, len(shape))
    moved = list(shape) if len(shape) else [1]
    moved.append(moved.pop(dim))
    K = moved[-1]
    nb = q.scales.shape[-1]
    R = math.prod(moved[:-1])
    if R * K == 0:
        return torch.zeros(shape, dtype=dtype, device=q.device)
    codes = q.codes.reshape(R, -1)
    b = q.scales.reshape(R, nb)
    if want_triton(codes):
        from ..triton_kernels.mx_triton import dequantize_mx_2d

        out = dequantize_mx_2d(codes, b, q.spec.element).to(dtype)
    elif want_compiled(R * nb * BLOCK, _mx_dequant_blocks_fast):
        out = _mx_dequant_blocks_fast(codes, b, q.spec.element, dtype)
    else:
        out = torch.empty(R, nb * BLOCK, dtype=dtype, device=q.device)
        for rows in row_chunks(R, nb * BLOCK):
            out[rows] = _mx_dequant_blocks_fast.eager(codes[rows], b[rows], q.spec.element, dtype)
    out = out[:, :K].reshape(moved).movedim(-1, dim)
    return out.reshape(shape)


__all__ = ["dequantize_mx", "encode_elements", "quantize_mx", "quantize_mx_blocks", "stored_codes"]
