"""NVFP4 quantizer: E2M1 values, an E4M3 scale per 16 values, an FP32 outer scale.

FP32 order of operations (Transformer Engine's reference, ``../shared/spec/numerics.md``):

    S  = min(bound*6 / amax, FLT_MAX)       (S = 1 if amax = 0; bound 448, or 256 for 4/6 and "4")
    t  = block_amax * (S * (1/6))
    s  = e4m3_rne(min(t, 448))              scale-to-6   (scale-to-4: e4m3_rne(min(1.5*t, 448)))
    e  = min(1 / (s * (1/S)), FLT_MAX)      (0 if s = 0)
    q  = e2m1(clamp(x * e, -6, 6))          RNE or stochastic; never beyond ±6
    x^ = (q * s) * (1/S)

Scale rules: "6"; "4" (always scale-to-4); "4over6" (the candidate with the strictly lower block
error, ties keep 6, summed in ``block_error``'s fixed order); "sweep" (every positive finite E4M3
value as block scale, least squared error; starts from the scale-to-6 choice and only moves on a
strictly lower error, trying candidates in increasing order).
"""
from __future__ import annotations

import math

import torch

from ...formats.e2m1 import e2m1_lut, pack_nibbles, unpack_nibbles
from ..backend import want_compiled, want_triton
from ..fast_kernel import fast_kernel
from ..blocking import abs_max, draw_random, pad_dim, random_from_bits, row_chunks, triton_seed
from ..tensor import QuantizedTensor
from .encode import block_outputs, choose_4over6
from .scales import BLOCK, amax_of_outer_scale, block_amax, block_scales, encode_scale_tensor, group_amax, outer_scale
from .spec import NVFP4
from .sweep import sweep_blocks, sweep_finish, sweep_init, sweep_step


def _quantize_blocks(xb, S, rand, rule: str, error: str, block_2d: bool, rounding: str, sr_mode: str,
                     outputs: str = "codes"):
    """Kernel for rules "6", "4", "4over6": blocks [R, nb, 16] (any float dtype), S [R, 1, 1] ->
    (unpacked codes [R, nb*16] or None, scales [R, nb], dequantized values [R, nb*16] or None);
    ``outputs`` is "codes", "values" or "both"."""
    xb = xb.float()
    inv_s = 1.0 / S
    amax = block_amax(xb, block_2d)
    if rule == "6":
        s = block_scales(amax, S, 6)
    elif rule == "4":
        s = block_scales(amax, S, 4)
    else:  # 4over6: keep 6 unless 4 is strictly better; codes recomputed from the choice
        s = choose_4over6(xb, block_scales(amax, S, 6), block_scales(amax, S, 4), inv_s, rand, rounding, sr_mode,
                          error, block_2d)
    return block_outputs(xb, s, inv_s, rand, rounding, sr_mode, outputs)


_quantize_blocks_fast = fast_kernel(_quantize_blocks)
_sweep_init_fast = fast_kernel(sweep_init)
_sweep_step_fast = fast_kernel(sweep_step)
_sweep_finish_fast = fast_kernel(sweep_finish)


def _dequantize_blocks(packed, scales, inv_s, out_dtype):
    """packed [R, nb*8], scales [R, nb] (FP32), inv_s [R, 1] -> [R, nb*16]: FP32 values cast to ``out_dtype``."""
    q = e2m1_lut(packed.device)[unpack_nibbles(packed).long()]
    r, nb = scales.shape
    return ((q.view(r, nb, BLOCK) * scales.unsqueeze(-1)) * inv_s.unsqueeze(-1)).view(r, nb * BLOCK).to(out_dtype)


_dequantize_blocks_fast = fast_kernel(_dequantize_blocks)


def outer_scales(x3: torch.Tensor, spec: NVFP4, shape: torch.Size):
    """(stored amax, stored S, S per row) of ``x3`` [B, M, K] (``x`` of shape ``shape``) by ``spec.outer``:
    the stored forms broadcast against ``shape`` (see ``QuantizedTensor.outer_scale``)."""
    B, M, _ = x3.shape
    ndim = len(shape)
    bound = spec.outer_bound
    if isinstance(spec.outer, float) or isinstance(spec.outer, int):
        amax = torch.tensor(float(spec.outer), dtype=torch.float32, device=x3.device)
        stored_shape = ()
        amax_rows = amax.expand(B * M)
    elif spec.outer == "tensor":
        amax = abs_max(x3)
        stored_shape = ()
        amax_rows = amax.expand(B * M)
    elif spec.outer == "row":
        amax = abs_max(x3, dim=-1)
        stored_shape = tuple(shape[:-1]) + (1,) if ndim else ()
        amax_rows = amax.reshape(B * M)
    else:  # group: one per slice of dim 0
        G = shape[0] if ndim >= 2 else 1
        amax = group_amax(x3.reshape(shape))
        stored_shape = (G,) + (1,) * (ndim - 1) if ndim >= 2 else ()
        amax_rows = amax.repeat_interleave((B * M) // G) if G else amax
    S_rows = outer_scale(amax_rows.float(), bound)
    amax_st = amax.float().reshape(stored_shape)
    return amax_st, outer_scale(amax_st, bound), S_rows


def _given_outer(x3: torch.Tensor, spec: NVFP4, encode_scale):
    """A fixed per-tensor encode scale S (e.g. a calibrated input scale read from a checkpoint)."""
    S = encode_scale_tensor(encode_scale, x3.device)
    B, M, _ = x3.shape
    return amax_of_outer_scale(S, spec.outer_bound), S, S.expand(B * M)


def triton_supports(spec: NVFP4) -> bool:
    """Cases the Triton kernels cover: 1x16 blocks and 16x16 tiles, scale rules "6", "4", "4over6"
    (any outer, error, rounding); not "sweep"."""
    return spec.scale_rule != "sweep"


def quantize_nvfp4(x: torch.Tensor, spec: NVFP4, generator: torch.Generator | None = None,
                   outputs: str = "codes", encode_scale: torch.Tensor | None = None,
                   rand_bits: torch.Tensor | None = None):
    """Quantize finite ``x`` (FP32 / BF16 / FP16, any shape; kernels compute in FP32) to NVFP4.
    Use ``blockscale.quantize`` for checked input.

    encode_scale: a given FP32 outer encode scale S (one per tensor: a one-element tensor or a Python
    float, see ``encode_scale_tensor``) used instead of the one ``spec.outer`` would compute; the
    stored amax is then bound*6/S.

    outputs: "codes" -> QuantizedTensor; "values" -> the dequantized FP32 tensor only (fake
    quantization in one pass, nothing packed); "both" -> (QuantizedTensor, values).

    rand_bits: stochastic rounding only: raw uint32 draws (int32/int64 bit patterns), one per
    element of the padded [B, Mp, Kp] layout, used instead of drawing from ``generator`` (see
    ``blocking.random_from_bits``; e.g. the Triton kernel's ``random_bits``). Forces the torch kernels.

    CUDA tensors (and CPU tensors under backend "triton" with TRITON_INTERPRET=1) go to the Triton
    kernel when ``backend.want_triton`` says so and the spec is supported (any but "sweep"):
    same bits for "nearest"; stochastic rounding then draws from Philox seeded by ``generator``.
    """
    shape = x.shape
    K = shape[-1] if x.dim() else 1
    M = shape[-2] if x.dim() >= 2 else 1
    B = math.prod(shape[:-2])
    if spec.block_2d and x.dim() < 2:
        raise ValueError(f"block_2d=True needs a tensor with at least 2 dims, got shape {tuple(shape)}")
    if spec.block_2d and spec.outer == "group" and x.dim() < 3:
        raise ValueError("block_2d=True with outer='group' needs a tensor with at least 3 dims (groups along dim 0)")
    x3 = x.reshape(B, M, K)
    if encode_scale is None:
        amax_st, S_st, S_rows = outer_scales(x3, spec, shape)
    else:
        amax_st, S_st, S_rows = _given_outer(x3, spec, encode_scale)

    if rand_bits is None and triton_supports(spec) and B * M * K and want_triton(x):
        return _quantize_triton(x3, spec, S_rows, amax_st, S_st, shape, x.dtype, generator, outputs)

    xp = pad_dim(x3, -1, BLOCK)
    if spec.block_2d:
        xp = pad_dim(xp, -2, BLOCK)
        S_rows = pad_dim(S_rows.view(B, M), -1, BLOCK).reshape(-1)  # padded rows: zeros in x, any S
        S_rows = torch.where(S_rows == 0, torch.ones_like(S_rows), S_rows)
    Mp, Kp = xp.shape[1], xp.shape[2]
    R, nb = B * Mp, Kp // BLOCK
    xb = xp.reshape(R, nb, BLOCK)
    S3 = S_rows.reshape(R, 1, 1)
    if rand_bits is not None and spec.rounding == "stochastic":
        rand = random_from_bits(rand_bits.to(x.device), (R, nb, BLOCK), spec.sr_mode)
    else:
        rand = draw_random((R, nb, BLOCK), spec.rounding, spec.sr_mode, generator, x.device)

    want_codes, want_values = outputs != "values", outputs != "codes"
    sweep_kernels = (_sweep_init_fast, _sweep_step_fast, _sweep_finish_fast)
    fast = want_compiled(R * Kp, *(sweep_kernels if spec.scale_rule == "sweep" else (_quantize_blocks_fast,)))
    if not fast:  # eager chunks write into preallocated outputs; the fast path returns them whole
        codes = torch.empty(R, Kp // 2, dtype=torch.uint8, device=x.device) if want_codes else None
        scales = torch.empty(R, nb, dtype=torch.float32, device=x.device)
        values = torch.empty(R, Kp, dtype=torch.float32, device=x.device) if want_values else None
    if R * Kp:
        parts = [slice(0, R)] if fast else row_chunks(R, Kp, BLOCK if spec.block_2d else 1)
        for rows in parts:
            args = (xb[rows], S3[rows])
            if spec.scale_rule == "sweep":
                kernels = sweep_kernels if fast else tuple(k.eager for k in sweep_kernels)
                c, s, v = sweep_blocks(*args, spec.block_2d, *kernels, outputs)
            else:
                kernel = _quantize_blocks_fast if fast else _quantize_blocks_fast.eager
                r = None if rand is None else rand[rows]
                c, s, v = kernel(*args, r, spec.scale_rule, spec.error, spec.block_2d, spec.rounding, spec.sr_mode,
                                 outputs)
            if fast:
                codes, scales, values = (pack_nibbles(c) if want_codes else None), s, v
            else:
                if want_codes:
                    codes[rows] = pack_nibbles(c)
                if want_values:
                    values[rows] = v
                scales[rows] = s
    else:
        codes = torch.empty(R, Kp // 2, dtype=torch.uint8, device=x.device) if want_codes else None
        scales = torch.empty(R, nb, dtype=torch.float32, device=x.device)
        values = torch.empty(R, Kp, dtype=torch.float32, device=x.device) if want_values else None
    if want_values:
        values = values.view(B, Mp, Kp)[:, :M, :K].reshape(shape)
        if not want_codes:
            return values
    lead = tuple(shape[:-1]) if x.dim() else ()
    codes = codes.view(B, Mp, Kp // 2)[:, :M].reshape(lead + (Kp // 2,))
    scales = scales.view(B, Mp, nb)[:, :M].reshape(lead + (nb,)).to(torch.float8_e4m3fn)
    q = QuantizedTensor(spec=spec, codes=codes, scales=scales, shape=shape, dtype=x.dtype,
                        outer_scale=S_st, amax=amax_st)
    return (q, values) if want_values else q


def _quantize_triton(x3, spec, S_rows, amax_st, S_st, shape, dtype, generator, outputs):
    """``quantize_nvfp4`` through the Triton kernels (1x16 blocks or 16x16 tiles): same outputs, same bits."""
    from ..triton_kernels.nvfp4_triton import quantize_nvfp4_2d, quantize_nvfp4_tiles

    B, M, K = x3.shape
    want_codes, want_values = outputs != "values", outputs != "codes"
    seed = triton_seed(generator, x3.device) if spec.rounding == "stochastic" else 0
    if spec.block_2d:
        codes, sbytes, values = quantize_nvfp4_tiles(
            x3, S_rows, spec.scale_rule, spec.error, spec.rounding, spec.sr_mode, seed, 0, want_codes, want_values)
    else:
        codes, sbytes, values = quantize_nvfp4_2d(
            x3.reshape(B * M, K), S_rows, spec.scale_rule, spec.error, spec.rounding, spec.sr_mode, seed, 0,
            want_codes, want_values)
    if want_values:
        values = values[:, :K].reshape(shape)
        if not want_codes:
            return values
    lead = tuple(shape[:-1]) if len(shape) else ()
    q = QuantizedTensor(spec=spec, codes=codes.reshape(lead + (codes.shape[-1],)),
                        scales=sbytes.view(torch.float8_e4m3fn).reshape(lead + (sbytes.shape[-1],)),
                        shape=shape, dtype=dtype, outer_scale=S_st, amax=amax_st)
    return (q, values) if want_values else q


def dequantize_nvfp4(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x^ = (q * s) * (1/S) in FP32 (then cast to ``dtype``), shaped like the original tensor."""
    shape = q.shape
    K = shape[-1] if len(shape) else 1
    Kp = q.codes.shape[-1] * 2
    R = q.codes.numel() // max(q.codes.shape[-1], 1) if q.codes.numel() else 0
    if R == 0 or Kp == 0:
        return torch.zeros(shape, dtype=dtype, device=q.device)
    lead = tuple(shape[:-1]) if len(shape) else ()
    inv_s = (1.0 / q.outer_scale).expand(lead + (1,) if lead else (1,)).reshape(R, 1)
    packed = q.codes.reshape(R, Kp // 2)
    if want_triton(packed):
        from ..triton_kernels.nvfp4_triton import dequantize_nvfp4_2d

        out = dequantize_nvfp4_2d(packed, q.scales.reshape(R, Kp // BLOCK), inv_s.reshape(R))
        return out[:, :K].to(dtype).reshape(shape)
    scales = q.scales.reshape(R, Kp // BLOCK).to(torch.float32)
    if want_compiled(R * Kp, _dequantize_blocks_fast):
        out = _dequantize_blocks_fast(packed, scales, inv_s, dtype)
    else:
        out = torch.empty(R, Kp, dtype=dtype, device=q.device)
        for rows in row_chunks(R, Kp):
            out[rows] = _dequantize_blocks_fast.eager(packed[rows], scales[rows], inv_s[rows], dtype)
    return out[:, :K].reshape(shape)


__all__ = ["dequantize_nvfp4", "outer_scales", "quantize_nvfp4", "triton_supports"]
