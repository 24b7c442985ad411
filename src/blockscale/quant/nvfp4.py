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

from ..formats.e2m1 import e2m1_index, e2m1_lut, pack_nibbles, unpack_nibbles
from ..formats.minifloat import E2M1, E4M3, round_magnitude, sign_bit
from .backend import fast_kernel, want_compiled, want_triton
from .block_error import block_error_terms, tile_error
from .blocking import abs_max, draw_random, pad_dim, random_from_bits, row_chunks
from .specs import NVFP4
from .tensor import QuantizedTensor

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN_NORMAL = 2.0**-126
BLOCK = 16


def e4m3_positive_values() -> torch.Tensor:
    """The 126 positive finite E4M3 values, increasing (codes 0x01..0x7E)."""
    return torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def outer_scale(amax: torch.Tensor, bound: float = 448.0) -> torch.Tensor:
    """S = min(bound*6 / amax, FLT_MAX), and 1 where amax is 0."""
    # a true division (``float / tensor`` would be reciprocal-then-multiply: two roundings)
    s = torch.clamp(torch.tensor(bound * 6.0, dtype=torch.float32, device=amax.device) / amax, max=FLT_MAX)
    return torch.where(amax == 0, torch.ones_like(s), s)


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    return round_magnitude(torch.clamp(t, max=448.0), E4M3)


def _encode(xb, s, inv_s, rand, rounding, sr_mode):
    """E2M1 codes (uint8, unpacked) of blocks ``xb`` [..., 16] with block scales ``s`` [..., 1]."""
    neg, v = _rounded_magnitudes(xb, s, inv_s, rand, rounding, sr_mode)
    return e2m1_index(v) | (neg.to(torch.uint8) << 3)


def _reconstruct(xb, s, inv_s, rand, rounding, sr_mode):
    """Dequantized values x^ = (q * s) * (1/S) of blocks ``xb`` with block scales ``s``."""
    neg, v = _rounded_magnitudes(xb, s, inv_s, rand, rounding, sr_mode)
    return (torch.where(neg, -v, v) * s) * inv_s


def _rounded_magnitudes(xb, s, inv_s, rand, rounding, sr_mode):
    e = torch.clamp(1.0 / (s * inv_s), max=FLT_MAX)
    e = torch.where(s == 0, torch.zeros_like(e), e)
    v = round_magnitude(torch.abs(torch.clamp(xb * e, -6.0, 6.0)), E2M1, rounding, rand, sr_mode)
    return sign_bit(xb), v


def _error(xb, s, inv_s, rand, rounding, sr_mode, error, block_2d):
    """Per-block error [..., R, nb] of quantizing blocks ``xb`` [R, nb, 16] with scales ``s`` [..., R, nb, 1].

    1D: position by position (``block_error_terms``); 2D: per 16x16 tile (``tile_error``),
    broadcast back to the tile's 16 rows.
    """
    if not block_2d:
        rs = [None] * BLOCK if rand is None else rand.unbind(-1)
        sq, inv = s.squeeze(-1), inv_s.squeeze(-1)
        ds = [_reconstruct(c, sq, inv, r, rounding, sr_mode) - c for c, r in zip(xb.unbind(-1), rs)]
        return block_error_terms(ds, error)
    d = _reconstruct(xb, s, inv_s, rand, rounding, sr_mode) - xb
    *c, r, nb, _ = d.shape
    tiles = d.view(*c, r // BLOCK, BLOCK, nb, BLOCK).transpose(-3, -2)
    err = tile_error(tiles, error)  # [..., r/16, nb]
    return err.unsqueeze(-2).expand(*c, r // BLOCK, BLOCK, nb).reshape(*c, r, nb)


def _block_amax(xb: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """Block amax [R, nb, 1] of blocks [R, nb, 16]; 2D: the 16x16 tile amax on each of its rows."""
    a = torch.abs(xb).amax(dim=-1, keepdim=True)
    if block_2d:
        r, nb, _ = a.shape
        a = a.view(r // BLOCK, BLOCK, nb, 1).amax(dim=1, keepdim=True).expand(r // BLOCK, BLOCK, nb, 1)
        a = a.reshape(r, nb, 1)
    return a


def _quantize_blocks(xb, S, rand, rule: str, error: str, block_2d: bool, rounding: str, sr_mode: str,
                     outputs: str = "codes"):
    """Kernel for rules "6", "4", "4over6": blocks [R, nb, 16] (any float dtype), S [R, 1, 1] ->
    (unpacked codes [R, nb*16] or None, scales [R, nb], dequantized values [R, nb*16] or None);
    ``outputs`` is "codes", "values" or "both"."""
    xb = xb.float()
    inv_s = 1.0 / S
    t = _block_amax(xb, block_2d) * (S * (1.0 / 6.0))
    if rule == "6":
        s = _e4m3(t)
    elif rule == "4":
        s = _e4m3(t * 1.5)
    else:  # 4over6: keep 6 unless 4 is strictly better; codes recomputed below from the choice
        s6 = _e4m3(t)
        s4 = _e4m3(t * 1.5)
        # both candidates in one broadcast pass: [2, R, nb, 1] scales -> [2, R, nb] errors
        err = _error(xb, torch.stack((s6, s4)), inv_s, rand, rounding, sr_mode, error, block_2d)
        s = torch.where((err[1] < err[0]).unsqueeze(-1), s4, s6)
    return _outputs(xb, s, inv_s, rand, rounding, sr_mode, outputs)


def _outputs(xb, s, inv_s, rand, rounding, sr_mode, outputs):
    r = xb.shape[0]
    codes = _encode(xb, s, inv_s, rand, rounding, sr_mode).reshape(r, -1) if outputs != "values" else None
    xhat = _reconstruct(xb, s, inv_s, rand, rounding, sr_mode).reshape(r, -1) if outputs != "codes" else None
    return codes, s.squeeze(-1), xhat


def _sweep_init(xb, S, block_2d: bool):
    """Sweep start: the scale-to-6 block scales and their squared error."""
    xb = xb.float()
    inv_s = 1.0 / S
    s = _e4m3(_block_amax(xb, block_2d) * (S * (1.0 / 6.0)))
    return s, _error(xb, s, inv_s, None, "nearest", "hardware", "mse", block_2d).unsqueeze(-1)


def _sweep_step(xb, S, cand, best_s, best_err, block_2d: bool):
    """One sweep candidate (0-d FP32 tensor): keep it where its squared error is strictly lower."""
    xb = xb.float()
    inv_s = 1.0 / S
    s = cand.expand_as(best_s)
    err = _error(xb, s, inv_s, None, "nearest", "hardware", "mse", block_2d).unsqueeze(-1)
    better = err < best_err
    return torch.where(better, s, best_s), torch.where(better, err, best_err)


def _sweep_finish(xb, S, best_s, outputs):
    return _outputs(xb.float(), best_s, 1.0 / S, None, "nearest", "hardware", outputs)


def _sweep_blocks(xb, S, block_2d, init, step, finish, outputs):
    best_s, best_err = init(xb, S, block_2d)
    for cand in e4m3_positive_values():
        best_s, best_err = step(xb, S, cand, best_s, best_err, block_2d)
    return finish(xb, S, best_s, outputs)


_quantize_blocks_fast = fast_kernel(_quantize_blocks)
_sweep_init_fast = fast_kernel(_sweep_init)
_sweep_step_fast = fast_kernel(_sweep_step)
_sweep_finish_fast = fast_kernel(_sweep_finish)


def _dequantize_blocks(packed, scales, inv_s, out_dtype):
    """packed [R, nb*8], scales [R, nb] (FP32), inv_s [R, 1] -> [R, nb*16]: FP32 values cast to ``out_dtype``."""
    q = e2m1_lut(packed.device)[unpack_nibbles(packed).long()]
    r, nb = scales.shape
    return ((q.view(r, nb, BLOCK) * scales.unsqueeze(-1)) * inv_s.unsqueeze(-1)).view(r, nb * BLOCK).to(out_dtype)


_dequantize_blocks_fast = fast_kernel(_dequantize_blocks)


def _outer(x3: torch.Tensor, spec: NVFP4, shape: torch.Size):
    """Outer amax and S per row of ``x3`` [B, M, K]; also the stored (broadcastable) forms."""
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
        per = x3.reshape(G, x3.numel() // G if G else 0)  # not -1: ambiguous for empty tensors
        amax = abs_max(per, dim=-1)
        stored_shape = (G,) + (1,) * (ndim - 1) if ndim >= 2 else ()
        amax_rows = amax.repeat_interleave((B * M) // G) if G else amax
    S_rows = outer_scale(amax_rows.float(), bound)
    amax_st = amax.float().reshape(stored_shape)
    return amax_st, outer_scale(amax_st, bound), S_rows


def encode_scale_tensor(encode_scale, device=None) -> torch.Tensor:
    """A given outer encode scale S as a 0-d FP32 tensor (on ``device``, default its own / CPU).

    Accepts a one-element tensor (any float dtype, cast to FP32) or a Python float / int (rounded to
    FP32 as ``torch.tensor(v, dtype=torch.float32)`` does). S must be positive, normal and finite:
    x^ = q * s * (1/S) needs 1/S finite, which a subnormal S (or 0) would not give.
    """
    if isinstance(encode_scale, torch.Tensor):
        if encode_scale.device.type == "meta":
            raise ValueError("encode_scale is a meta tensor: meta tensors have no values (load or compute it first)")
        if encode_scale.numel() != 1:
            raise ValueError(f"encode_scale has shape {tuple(encode_scale.shape)}; expected one FP32 scalar "
                             "(one outer scale per tensor: a one-element tensor or a Python float)")
        S = encode_scale.detach().to(device=device or encode_scale.device, dtype=torch.float32).reshape(())
    elif isinstance(encode_scale, (int, float)) and not isinstance(encode_scale, bool):
        try:
            value = float(encode_scale)
        except OverflowError:  # an int beyond the float range
            value = math.inf
        S = torch.tensor(value, dtype=torch.float32, device=device)
    else:
        raise TypeError(f"encode_scale={encode_scale!r}: expected a Python float or a one-element tensor "
                        "(the FP32 outer encode scale S)")
    if not (bool(torch.isfinite(S)) and float(S) >= FLT_MIN_NORMAL):
        raise ValueError(f"encode_scale={float(S)!r}: must be a positive, normal, finite FP32 scalar "
                         f"(>= 2**-126, so that 1/S is finite)")
    return S


def _given_outer(x3: torch.Tensor, spec: NVFP4, encode_scale):
    """A fixed per-tensor encode scale S (e.g. a calibrated input scale read from a checkpoint)."""
    S = encode_scale_tensor(encode_scale, x3.device)
    B, M, _ = x3.shape
    return torch.tensor(spec.outer_bound * 6.0, dtype=torch.float32, device=x3.device) / S, S, S.expand(B * M)


def _triton_supports(spec: NVFP4) -> bool:
    """Cases the Triton kernels cover: 1x16 blocks and 16x16 tiles, scale rules "6", "4", "4over6"
    (any outer, error, rounding); not "sweep"."""
    return spec.scale_rule != "sweep"


def _triton_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """A Philox seed for the Triton kernel, drawn from ``generator`` (or the device's default one)."""
    dev = generator.device if generator is not None else device
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev).item())


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
        amax_st, S_st, S_rows = _outer(x3, spec, shape)
    else:
        amax_st, S_st, S_rows = _given_outer(x3, spec, encode_scale)

    if rand_bits is None and _triton_supports(spec) and B * M * K and want_triton(x):
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
    fast = want_compiled(R * Kp)
    if not fast:  # eager chunks write into preallocated outputs; the fast path returns them whole
        codes = torch.empty(R, Kp // 2, dtype=torch.uint8, device=x.device) if want_codes else None
        scales = torch.empty(R, nb, dtype=torch.float32, device=x.device)
        values = torch.empty(R, Kp, dtype=torch.float32, device=x.device) if want_values else None
    if R * Kp:
        parts = [slice(0, R)] if fast else row_chunks(R, Kp, BLOCK if spec.block_2d else 1)
        for rows in parts:
            args = (xb[rows], S3[rows])
            if spec.scale_rule == "sweep":
                kernels = (_sweep_init_fast, _sweep_step_fast, _sweep_finish_fast) if fast else (
                    _sweep_init, _sweep_step, _sweep_finish)
                c, s, v = _sweep_blocks(*args, spec.block_2d, *kernels, outputs)
            else:
                kernel = _quantize_blocks_fast if fast else _quantize_blocks
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
    from .triton_kernels.nvfp4_triton import quantize_nvfp4_2d, quantize_nvfp4_tiles

    B, M, K = x3.shape
    want_codes, want_values = outputs != "values", outputs != "codes"
    seed = _triton_seed(generator, x3.device) if spec.rounding == "stochastic" else 0
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
        from .triton_kernels.nvfp4_triton import dequantize_nvfp4_2d

        out = dequantize_nvfp4_2d(packed, q.scales.reshape(R, Kp // BLOCK), inv_s.reshape(R))
        return out[:, :K].to(dtype).reshape(shape)
    scales = q.scales.reshape(R, Kp // BLOCK).to(torch.float32)
    if want_compiled(R * Kp):
        out = _dequantize_blocks_fast(packed, scales, inv_s, dtype)
    else:
        out = torch.empty(R, Kp, dtype=dtype, device=q.device)
        for rows in row_chunks(R, Kp):
            out[rows] = _dequantize_blocks(packed[rows], scales[rows], inv_s[rows], dtype)
    return out[:, :K].reshape(shape)
