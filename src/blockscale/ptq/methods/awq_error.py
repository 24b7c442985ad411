"""The quantized output error of AWQ candidate scales (``awq.awq_search``, ``awq.awq_search_parts``).

A candidate s [K] is scored by rounding W' = W * s as PTQ rounds the group (``scheme_quantizers``) and
comparing X' Q^T with the full-precision x W^T, X' = x / s (quantized for W4A4): with unquantized
activations through one QR of the tokens (||x F^T||^2 = ||R F^T||^2, F = Q / s - W: a sum of squares, no
cancellation), else chunk by chunk of tokens. Every chunk's float64 sum is added to a Python float in
order, so the sums (and the AWQ choice they drive) are deterministic.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...quant import NVFP4, fake_quantize
from ...quant.nvfp4 import input_encode_scale, shared_outer_scale
from ...quant.nvfp4.weighted import WEIGHTED_RULES
from ..scheme_quantize import group_weight_scale, input_quantizer, rtn_quantize
from ..smoothing import check_weights
from .awq_clip import subsample_rows

# tokens x outputs per matmul chunk, and the largest reference output cached between candidates
_CHUNK_ELEMS = 1 << 24
_CACHE_ELEMS = 1 << 26


def scheme_quantizers(scheme, spec: Optional[NVFP4], act_scale_rule: Optional[str]):
    """(weights W'_i sharing one scale -> their FP32 fake-quantized values, input amax -> the activation
    quantizer or None) for a ``recipes.Scheme``, or for the flat NVFP4 ``spec`` / ``act_scale_rule``."""
    if scheme is None:
        act_spec = None if act_scale_rule is None else NVFP4(scale_rule=act_scale_rule)

        def qw(Wp):
            S = shared_outer_scale(Wp, spec.outer_bound)
            if spec == WEIGHTED_RULES["hessian"]:  # the sweep (a Hessian-aware rule's base): its exact fast path
                return [rtn_quantize(w, spec, S).dequantize(torch.float32) if w.numel() else w.float() for w in Wp]
            return [fake_quantize(w, spec, encode_scale=S, dtype=torch.float32) if w.numel() else w.float()
                    for w in Wp]

        def aq(amax):
            if act_spec is None:
                return None
            enc = input_encode_scale(amax, act_scale_rule)
            return lambda xc: fake_quantize(xc, act_spec, encode_scale=enc.to(xc.device), check_finite=False)
        return qw, aq
    wspec = scheme.weight_spec

    def qw(Wp):
        S = group_weight_scale(scheme, Wp)
        return [rtn_quantize(w, wspec, S).dequantize(torch.float32) if w.numel() else w.float() for w in Wp]
    return qw, lambda amax: input_quantizer(scheme, amax)


def token_factor(xs: torch.Tensor) -> torch.Tensor:
    """R with ||xs F^T||^2 = ||R F^T||^2 for every F: the [K, K] R of xs = QR when xs [T, K] has more rows
    (T > K), else xs itself."""
    return torch.linalg.qr(xs, mode="r").R if xs.shape[0] > xs.shape[1] else xs


def _add_linear_error(total: float, R: torch.Tensor, F: torch.Tensor, rows: int) -> float:
    """total + ||R F^T||^2 (F: the effective weight error Q / s - W), ``rows`` rows of R at a time, each
    chunk's float64 sum added in turn."""
    for r0 in range(0, R.shape[0], rows):
        total += float((R[r0:r0 + rows] @ F.T).square().sum(dtype=torch.float64))
    return total


def _add_output_error(total: float, xs, W, Q, s, q, rows: int, Y=None, post=None) -> float:
    """total + ||X' Q^T - xs W^T||^2 (post: ||post(X' Q^T) - Y||^2, Y = post(xs W^T)), X' = q(xs / s)
    (q None: xs / s), ``rows`` tokens at a time, each chunk's float64 sum added in turn; a cached
    reference Y [T, N] replaces xs W^T without post."""
    for r0 in range(0, xs.shape[0], rows):
        xc = xs[r0:r0 + rows]
        xq = q(xc / s) if q is not None else xc / s
        if post is not None:
            diff = post(xq @ Q.T) - Y[r0:r0 + rows]
        else:
            ref = Y[r0:r0 + rows] if Y is not None else xc @ W.T
            diff = torch.addmm(ref, xq, Q.T, beta=-1.0)  # xq Q^T - x W^T
        total += float(diff.square().sum(dtype=torch.float64))
    return total


def group_error(xs, ws, W, qw, aq, x_absmax):
    """s -> the mean over tokens and outputs of ``awq_search``'s error for one group: weights ``ws``
    (W: their FP32 rows), quantized by ``qw``, tokens ``xs``; ``aq`` None: unquantized activations (the
    error through one QR of the tokens: a sum of squares, no cancellation), else max|x / s| -> the
    activation quantizer (``x_absmax``: max |x| per channel over every token)."""
    T, K = xs.shape
    N = W.shape[0]
    R = token_factor(xs) if aq is None else None
    Y = xs @ W.T if aq is not None and T * N <= _CACHE_ELEMS else None
    rows = max(1, _CHUNK_ELEMS // max(1, N))

    def error_of(s: torch.Tensor) -> float:
        Q = torch.cat(qw([(w.float() * s).to(w.dtype) for w in ws]), 0)
        if aq is None:
            return _add_linear_error(0.0, R, Q / s - W, rows) / (T * N)
        q = aq(float((x_absmax / s).max()))
        return _add_output_error(0.0, xs, W, Q, s, q, rows, Y) / (T * N)
    return error_of


def part_input(x, weights, post, K: int, dev, aq, max_tokens: int, fn: str):
    """(the entry of one input of ``awq_search_parts``, sum over its rows of |x| in float64 or None, its
    row count)."""
    ws = [w.to(dev) for w in check_weights(weights, K, fn)]
    x2 = x.detach().reshape(-1, K).to(dev)
    if x2.shape[0] and not bool(torch.isfinite(x2).all()):
        raise ValueError(f"{fn}: x contains NaN/inf")
    W = torch.cat([w.float() for w in ws], 0)
    xs = subsample_rows(x2, max_tokens).float()
    T = xs.shape[0]
    row_sum = x2.abs().double().sum(0) if x2.shape[0] else None
    lin = aq(1.0) is None and post is None
    R = token_factor(xs) if lin and T else None
    Y = post(xs @ W.T) if post is not None and T else None  # reference outputs [T, M]
    entry = dict(ws=ws, W=W, xs=xs, T=T, R=R, lin=lin, amax=x2.abs().amax(0).float() if T else None,
                 post=post, Y=Y, width=Y.shape[1] if Y is not None else W.shape[0])
    return entry, row_sum, x2.shape[0]


def parts_error(prepared, count: int):
    """s -> ``awq_search_parts``'s error: the sum over every part's inputs, divided by ``count``."""

    def error_of(s: torch.Tensor) -> float:
        total = 0.0
        for qw, aq, entries in prepared:
            Q = qw([(w.float() * s).to(w.dtype) for e in entries for w in e["ws"]])
            i = 0
            for e in entries:
                Qe = torch.cat(Q[i:i + len(e["ws"])], 0)
                i += len(e["ws"])
                if not e["T"]:
                    continue
                rows = max(1, _CHUNK_ELEMS // max(1, e["W"].shape[0]))
                if e["lin"]:  # x / s Q^T - x W^T = x F^T
                    total = _add_linear_error(total, e["R"], Qe / s - e["W"], rows)
                else:
                    q = aq(float((e["amax"] / s).max()))
                    total = _add_output_error(total, e["xs"], e["W"], Qe, s, q, rows, e["Y"], e["post"])
        return total / max(1, count)
    return error_of



__all__ = ["group_error", "part_input", "parts_error", "scheme_quantizers", "token_factor"]
