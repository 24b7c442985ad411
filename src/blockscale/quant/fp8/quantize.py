"""quantize_fp8 / dequantize_fp8: FP8 codes with FP32 scales per tensor, row or block (see ``layout``).

The tensor is viewed as rows [L * Np, K]: L matrices [N, K], N zero-padded to whole 128-row tiles
for 128x128 blocks (Np = N otherwise). The eager reference runs ``kernels.fp8_rows`` over row chunks
(whole tiles); the fast path runs the compiled kernel once. Per tensor, the amax is taken first
(one exact max over the whole tensor) and every chunk uses its scale. Stochastic rounding draws its
random numbers once for the padded rows [L * Np, Kp] (Kp = K padded to whole groups), so both
paths see the same numbers: deterministic given a generator.
"""
from __future__ import annotations

import torch

from ..backend import want_compiled
from ..blocking import abs_max, draw_random, pad_dim, row_chunks
from ..tensor import QuantizedTensor
from .kernels import fp8_dequant_rows_fast, fp8_rows_fast
from .layout import check_layout, geometry, layout, scales_shape
from .spec import FP8

OUTPUTS = ("codes", "values", "both")


def _rows(t: torch.Tensor, L: int, N: int, K: int, gm: int) -> torch.Tensor:
    """``t`` as rows [L * Np, K], N zero-padded to a multiple of ``gm`` in each of the L matrices."""
    t3 = t.reshape(L, N, K)
    if N % gm:
        t3 = pad_dim(t3.view(torch.uint8) if t3.dtype.itemsize == 1 else t3, 1, gm).view(t3.dtype)
    return t3.reshape(-1, K)


def _unrows(t2: torch.Tensor, L: int, N: int, shape) -> torch.Tensor:
    """Inverse of ``_rows``: padding rows dropped, original ``shape``."""
    return t2.reshape(L, -1, t2.shape[-1])[:, :N].reshape(shape)


def quantize_fp8(x: torch.Tensor, spec: FP8, generator: torch.Generator | None = None, outputs: str = "codes",
                 encode_scale=None):
    """Quantize finite ``x`` (contiguous fp32 / bf16 / fp16) to ``spec``.

    outputs: "codes" -> QuantizedTensor; "values" -> dequantized FP32 tensor (``x.shape``); "both" -> both.
    encode_scale must be None (FP8 has no outer scale).
    """
    if encode_scale is not None:
        raise ValueError("encode_scale is an NVFP4 outer scale; FP8 has none (its FP32 scales are amax / max_elem)")
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs={outputs!r} is not supported; allowed values: {', '.join(map(repr, OUTPUTS))}")
    shape = x.shape
    L, N, K, gm, gk = geometry(spec, shape)
    want_codes, want_values = outputs != "values", outputs != "codes"
    if x.numel() == 0:  # every group is empty: amax 0, s = 1
        codes = torch.empty(shape, dtype=layout(spec, shape)["codes"][1], device=x.device)
        scales = torch.ones(scales_shape(spec, shape), dtype=torch.float32, device=x.device)
        values = torch.zeros(shape, dtype=torch.float32, device=x.device)
    else:
        codes, scales, values = _quantize_rows(x, spec, generator, outputs, L, N, K, gm, gk)
        if want_codes:
            codes = _unrows(codes, L, N, shape)
        if want_values:
            values = _unrows(values, L, N, shape)
        scales = scales.reshape(scales_shape(spec, shape))
    if not want_codes:
        return values
    q = QuantizedTensor(spec=spec, codes=codes, scales=scales, shape=shape, dtype=x.dtype)
    return (q, values) if want_values else q


def _quantize_rows(x, spec: FP8, generator, outputs: str, L: int, N: int, K: int, gm: int, gk: int):
    """(codes [rows, K], scales [rows/gm, nb] or 0-d, values [rows, K]) over the padded rows of x."""
    x2 = _rows(x, L, N, K, gm)
    rows, Kp = x2.shape[0], K + (-K) % gk
    rand = draw_random((rows, Kp), spec.rounding, spec.sr_mode, generator, x.device)
    amax = abs_max(x) if spec.granularity == "tensor" else None
    args = (spec.element, gm, gk, spec.rounding, spec.sr_mode, outputs)
    if want_compiled(rows * Kp, fp8_rows_fast):
        return fp8_rows_fast(x2, amax, rand, *args)
    want_codes, want_values = outputs != "values", outputs != "codes"
    dev = x.device
    codes = torch.empty(x2.shape, dtype=layout(spec, ())["codes"][1], device=dev) if want_codes else None
    values = torch.empty(x2.shape, dtype=torch.float32, device=dev) if want_values else None
    scales = None if amax is not None else torch.empty(rows // gm, Kp // gk, dtype=torch.float32, device=dev)
    for sl in row_chunks(rows, Kp, gm):
        c, s, v = fp8_rows_fast.eager(x2[sl], amax, None if rand is None else rand[sl], *args)
        if want_codes:
            codes[sl] = c
        if want_values:
            values[sl] = v
        if amax is None:
            scales[sl.start // gm: sl.stop // gm] = s
        else:
            scales = s
    return codes, scales, values


def dequantize_fp8(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x^ = q * s in FP32 (each code times its group's scale), as ``dtype``; ValueError unless q's
    codes and scales fit its shape and spec (``layout.check_layout``)."""
    check_layout(q)
    shape = q.shape
    if q.codes.numel() == 0:
        return torch.zeros(shape, dtype=dtype, device=q.device)
    L, N, K, gm, gk = geometry(q.spec, shape)
    c2 = _rows(q.codes, L, N, K, gm)
    s = q.scales if q.scales.dim() == 0 else q.scales.reshape(c2.shape[0] // gm, -1)
    rows, Kp = c2.shape[0], K + (-K) % gk
    if want_compiled(rows * Kp, fp8_dequant_rows_fast):
        out = fp8_dequant_rows_fast(c2, s, gm, gk, dtype)
    else:
        out = torch.empty(c2.shape, dtype=dtype, device=q.device)
        for sl in row_chunks(rows, Kp, gm):
            part = s if s.dim() == 0 else s[sl.start // gm: -(-sl.stop // gm)]
            out[sl] = fp8_dequant_rows_fast.eager(c2[sl], part, gm, gk, dtype)
    return _unrows(out, L, N, shape)


__all__ = ["dequantize_fp8", "quantize_fp8"]
