"""FP8 kernels on row blocks, written once as eager torch (the reference) and compiled for the fast path.

A kernel sees ``r`` rows of ``K`` values, ``r`` a multiple of the group height ``gm``; it pads K to
whole groups of ``gk`` (zeros: an amax never changes) and views the rows as groups
[r/gm, gm, nb, gk]. Every step is elementwise FP32 or an exact max, so the compiled kernels
(TorchInductor keeps IEEE division: no reciprocal, no FMA) give the reference's bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...formats.fp8 import FP8_DTYPES
from ..fast_kernel import fast_kernel
from .scales import dequantize_values, encode_with_scale, scale_from_amax


def _groups(t: torch.Tensor, gm: int, gk: int) -> torch.Tensor:
    """[r, K] -> [r/gm, gm, nb, gk], K zero-padded to a multiple of ``gk``."""
    r, K = t.shape
    extra = (-K) % gk
    if extra:
        t = F.pad(t, (0, extra))
    return t.view(r // gm, gm, (K + extra) // gk, gk)


def fp8_rows(x2, amax, rand, element: str, gm: int, gk: int, rounding: str, sr_mode: str, outputs: str = "codes"):
    """Rows [r, K] -> (codes [r, K] float8 or None, scales FP32, values [r, K] FP32 or None).

    amax: None -> one amax per gm x gk group (scales [r/gm, nb]); else a given FP32 amax (per tensor:
    0-d, scales 0-d). rand: stochastic rounding's random numbers for the padded rows [r, Kp], or None.
    outputs: "codes", "values" or "both" (what is not asked for is None).
    """
    r, K = x2.shape
    xg = _groups(x2.float(), gm, gk)
    if amax is None:
        amax = torch.abs(xg).amax(dim=(1, 3), keepdim=True)
    s = scale_from_amax(amax, element)
    rg = None if rand is None else rand.view(xg.shape)
    v = encode_with_scale(xg, s, element, rounding, rg, sr_mode)
    codes = values = None
    if outputs != "values":
        codes = v.to(FP8_DTYPES[element]).reshape(r, -1)[:, :K]
    if outputs != "codes":
        values = dequantize_values(v, s).reshape(r, -1)[:, :K]
    scales = s if s.dim() == 0 else s.reshape(r // gm, -1)
    return codes, scales, values


def fp8_dequant_rows(c2, scales, gm: int, gk: int, out_dtype):
    """Codes [r, K] (r a multiple of gm) and their scales ([r/gm, nb], or 0-d) -> x^ [r, K] in ``out_dtype``."""
    r, K = c2.shape
    vg = _groups(c2.to(torch.float32), gm, gk)
    s = scales if scales.dim() == 0 else scales.reshape(r // gm, 1, -1, 1)
    return dequantize_values(vg, s).reshape(r, -1)[:, :K].to(out_dtype)


fp8_rows_fast = fast_kernel(fp8_rows)
fp8_dequant_rows_fast = fast_kernel(fp8_dequant_rows)

__all__ = ["fp8_dequant_rows", "fp8_dequant_rows_fast", "fp8_rows", "fp8_rows_fast"]
