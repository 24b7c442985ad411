"""Hessian-aware ("local Hessian") NVFP4 block scales: per 1x16 block, the stored E4M3 block scale with the
least input-weighted squared error.

For a Linear y = x W^T with calibration inputs X, the output error of a quantized W~ is
tr((W - W~) X^T X (W - W~)^T); keeping only the diagonal d = diag(X^T X) [K] (any positive multiple, e.g.
the mean of x_j^2 over tokens), the error of block b of row n is

    err(s) = sum_{j in b} d_j * (W~[n, j](s) - W[n, j])^2          W~(s): the block encoded with scale s

summed in ``block_error``'s fixed tree order, each term ``(dx * dx) * d_j`` in FP32 (dx = x^ - x as
``candidate_error`` computes it). With d = 1 every term is bit for bit the unweighted one, so the choice is
exactly that of the unweighted rule.

Rules (``WEIGHTED_RULES``, base spec = the stored format and its outer bound):

    "hessian"           candidates: the 126 positive finite E4M3 values (the "sweep" rule's), outer bound 448;
                        start from scale-to-6, move only to a strictly lower error, candidates in increasing
                        order (ties: scale-to-6, then the lowest candidate), exactly as the sweep
    "hessian-4over6"    candidates: scale-to-6 and scale-to-4 (the "4over6" rule's), outer bound 256;
                        scale-to-4 only where its error is strictly lower (ties keep 6), exactly as 4over6
"""
from __future__ import annotations

import torch

from ...formats.e2m1 import pack_nibbles
from ..block_error import tree_sum_terms
from ..tensor import QuantizedTensor
from .encode import block_outputs, reconstruct_blocks
from .scales import BLOCK, amax_of_outer_scale, block_amax, block_scales, encode_scale_tensor
from .spec import NVFP4
from .sweep_fast import fast_sweep_scales

WEIGHTED_RULES = {"hessian": NVFP4(scale_rule="sweep"), "hessian-4over6": NVFP4(scale_rule="4over6", error="mse")}
WEIGHTED_CHUNK = 1 << 21  # elements of one [2, rows, nb, 16]-equivalent chunk (rule hessian-4over6)


def check_channel_weights(d, k: int, device=None) -> torch.Tensor:
    """``d`` as a contiguous FP32 [k] tensor of finite values >= 0 (ValueError naming ``d`` otherwise)."""
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"d must be a torch.Tensor of per-input-channel weights [{k}], got {type(d).__name__}")
    if d.dim() != 1 or d.shape[0] != k:
        raise ValueError(f"d has shape {tuple(d.shape)}; expected [{k}] (one weight per input channel, in_features)")
    if not d.is_floating_point():
        raise ValueError(f"d has dtype {d.dtype}; expected a floating tensor")
    d = d.detach().to(device=device or d.device, dtype=torch.float32).contiguous()
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"d contains NaN/inf ({int((~torch.isfinite(d)).sum())} of {k} values); the channel "
                         "weights must be finite and >= 0")
    if bool((d < 0).any()):
        raise ValueError(f"d has {int((d < 0).sum())} negative value(s) (min {float(d.min()):.4g}); the channel "
                         "weights (diagonal of X^T X) must be >= 0")
    return d


def weighted_block_error(xb: torch.Tensor, s: torch.Tensor, inv_s: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """Weighted squared error [..., R, nb] of blocks ``xb`` [R, nb, 16] (FP32) with scales ``s`` [..., R, nb, 1]
    (leading dims: several candidates at once) and weights ``wb`` [nb, 16] or [R, nb, 16]: the tree sum of
    ``(dx * dx) * w`` per position, dx = x^ - x (as ``candidate_error`` with error "mse" for w = 1)."""
    sq, inv = s.squeeze(-1), inv_s.squeeze(-1)
    ws = wb.unbind(-1)
    terms = []
    for c, w in zip(xb.unbind(-1), ws):
        dx = reconstruct_blocks(c, sq, inv) - c
        terms.append((dx * dx) * w)
    return tree_sum_terms(terms)


def _rows(Wm: torch.Tensor, S: torch.Tensor, d: torch.Tensor):
    N, K = Wm.shape
    if K % BLOCK:
        raise ValueError(f"weight has {K} columns; Hessian-aware block scales need a multiple of {BLOCK}")
    nb = K // BLOCK
    xb = Wm.detach().float().reshape(N, nb, BLOCK)
    S3 = encode_scale_tensor(S, Wm.device).reshape(1, 1, 1)
    return xb, S3, 1.0 / S3, d.reshape(nb, BLOCK), nb


def weighted_sweep_scales(Wm: torch.Tensor, S, d: torch.Tensor) -> torch.Tensor:
    """Rule "hessian": E4M3 block scales [N, nb] (FP32 values) of ``Wm`` [N, nb*16] with outer scale S, each
    the sweep candidate (126 positive E4M3 values) of least d-weighted error, ties as the sweep resolves them
    (keep scale-to-6 unless strictly lower; among equal errors the lowest candidate). d = ones gives exactly
    ``sweep_block_scales`` (the "sweep" rule).

    Fast and exact (``sweep_fast.fast_sweep_scales``): the candidates whose term at the block's largest
    element alone reaches the scale-to-6 error are skipped, the rest evaluated in cache-sized chunks with the
    very errors the reference computes, so minimum and tie order are unchanged. d all ones skips the
    multiply by 1 (exact)."""
    N, K = Wm.shape
    d = check_channel_weights(d, K, Wm.device)
    xb, S3, _, wb, nb = _rows(Wm, S, d)
    wf = None if bool((d == 1).all()) else wb.unsqueeze(0).expand(N, nb, BLOCK).reshape(N * nb, BLOCK)
    return fast_sweep_scales(xb.reshape(N * nb, BLOCK), S3.reshape(()), wf).reshape(N, nb)


def weighted_4over6_scales(Wm: torch.Tensor, S, d: torch.Tensor) -> torch.Tensor:
    """Rule "hessian-4over6": per block, scale-to-4 where its d-weighted error is strictly lower than
    scale-to-6's, else scale-to-6 ([N, nb] FP32 values). d = ones gives exactly rule "4over6" (error "mse")."""
    N, K = Wm.shape
    d = check_channel_weights(d, K, Wm.device)
    xb, S3, inv_s, wb, nb = _rows(Wm, S, d)
    out = torch.empty(N, nb, dtype=torch.float32, device=Wm.device)
    step = max(1, WEIGHTED_CHUNK // max(1, 2 * K))
    for r0 in range(0, N, step):
        x = xb[r0:r0 + step]
        amax = block_amax(x)
        s6, s4 = block_scales(amax, S3, 6), block_scales(amax, S3, 4)
        err = weighted_block_error(x, torch.stack((s6, s4)), inv_s, wb)  # [2, r, nb]
        out[r0:r0 + step] = torch.where((err[1] < err[0]).unsqueeze(-1), s4, s6).squeeze(-1)
    return out


def weighted_block_scales(Wm: torch.Tensor, S, d: torch.Tensor, rule: str = "hessian") -> torch.Tensor:
    """The block scales [N, nb] of ``rule`` ("hessian" or "hessian-4over6", see the module docstring)."""
    if rule == "hessian":
        return weighted_sweep_scales(Wm, S, d)
    if rule == "hessian-4over6":
        return weighted_4over6_scales(Wm, S, d)
    raise ValueError(f"rule={rule!r}; allowed values: {', '.join(map(repr, WEIGHTED_RULES))}")


def quantize_weighted(W: torch.Tensor, rule: str, S, d: torch.Tensor) -> QuantizedTensor:
    """``W`` [N, K] (K a multiple of 16) as NVFP4 with outer encode scale S (one per tensor, e.g. the fused
    group's shared one) and the block scales of ``rule`` under channel weights ``d`` [K]. The result has the
    base spec ``WEIGHTED_RULES[rule]`` ("sweep" / "4over6"): with d = ones it is bit for bit
    ``quantize(W, base spec, encode_scale=S)``."""
    if rule not in WEIGHTED_RULES:
        raise ValueError(f"rule={rule!r}; allowed values: {', '.join(map(repr, WEIGHTED_RULES))}")
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise ValueError(f"W must be a 2-D weight [N, K], got {getattr(W, 'shape', type(W).__name__)}")
    spec = WEIGHTED_RULES[rule]
    N, K = W.shape
    S0 = encode_scale_tensor(S, W.device)
    scales = weighted_block_scales(W, S0, d, rule)
    nb = K // BLOCK
    xb = W.detach().float().reshape(N, nb, BLOCK)
    S3 = S0.reshape(1, 1, 1)
    codes, _, _ = block_outputs(xb, scales.unsqueeze(-1), 1.0 / S3, None, "nearest", "hardware", "codes")
    return QuantizedTensor(spec=spec, codes=pack_nibbles(codes), scales=scales.to(torch.float8_e4m3fn),
                           shape=W.shape, dtype=W.dtype, outer_scale=S0,
                           amax=amax_of_outer_scale(S0, spec.outer_bound))


__all__ = ["WEIGHTED_RULES", "check_channel_weights", "quantize_weighted", "weighted_4over6_scales",
           "weighted_block_error", "weighted_block_scales", "weighted_sweep_scales"]
