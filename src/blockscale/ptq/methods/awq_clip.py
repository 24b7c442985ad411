"""AWQ's weight-clipping search (auto-clip) for NVFP4: after the smoothing scales are folded, clamp each
16-wide block of a Linear's weight to ``[-c, c]`` with ``c = r * max|block|`` for the ratio ``r`` that
minimises the block's NVFP4-quantized output error on the calibration inputs.

The references (llm-awq ``auto_clip_layer``, AutoAWQ ``_search_best_clip``, llm-compressor's AWQ
``apply_clip``) search one max per output row and input group of their INT4 group size (128) with ratios
``1 - i / n_grid`` for ``i = 0 .. int(max_shrink * n_grid) - 1`` (1.0 down to 0.55 by default), each
group scored by its partial output ``x_g . w_g`` on sampled tokens, and skip q / k (their error passes
through ``softmax(q k^T)``). Here the group is the NVFP4 block (the 16 values whose amax sets one E4M3
block scale), so a ratio < 1 is a smaller block scale with the block's largest values saturating:

1. For each ratio r (r = 1 first): W_r = clamp(W, -r a, r a) per block (a = the block's amax, in FP32,
   stored in the weight dtype), Q_r = its NVFP4 values with the spec's scale rule and the given outer
   scale S (``quant.fake_quantize(..., encode_scale=S)``).
2. The block's partial output error over the T sampled tokens, sum_t (x'_{t,b} . q_b - x_{t,b} . w_b)^2
   (x' = x for W4A16, the quantized inputs for W4A4), from the blocks' 16x16 Gram matrices in float64.
   Each block keeps the ratio with the least error (ties: the larger ratio, i.e. less clipping).
3. Per output row, the exact output error ||X' q_n - X w_n||^2 (every cross term between blocks) of the
   chosen blocks against r = 1 (round to nearest); a row whose chosen clipping is not strictly better is
   not clipped. Rows are independent given S (each block's codes depend only on its 16 values and S),
   so the Linear's calibration output error never exceeds round-to-nearest's.

The outer scale S is fixed before clipping (the caller's: the fused group's S from the smoothed,
unclipped weights), so every member of a fused group keeps the same S. Only NVFP4 weights with 1x16
blocks are searched (``clip_supported``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...quant import NVFP4, fake_quantize
from ...quant.nvfp4 import BLOCK, encode_scale_tensor

# tokens x outputs per matmul chunk of the exact row errors
_CHUNK_ELEMS = 1 << 24


def clip_ratios(n_grid: int = 20, max_shrink: float = 0.5) -> tuple[float, ...]:
    """The candidate ratios ``1 - i / n_grid`` for ``i = 0 .. max(1, int(max_shrink * n_grid)) - 1``
    (llm-awq's grid; 1.0 first, always a candidate)."""
    return tuple(1.0 - i / n_grid for i in range(max(1, int(max_shrink * n_grid))))


def clip_supported(spec) -> bool:
    """Whether auto-clip searches weights of ``spec``: NVFP4 with 1x16 blocks and rounding to nearest
    (16x16 tiles would couple 16 rows; FP8 / MX weights are left as they are)."""
    return isinstance(spec, NVFP4) and not spec.block_2d and spec.rounding == "nearest"


@dataclass(frozen=True)
class ClipResult:
    """weight: the clipped weight [N, K] (the input's dtype; equal to it where nothing is clipped).
    ratios: [N, K/16] FP32, each block's ratio (1.0: not clipped, also for rows reverted in step 3).
    error / baseline_error: the mean squared output error over the T sampled tokens and N outputs with the
    clipped weights / with round to nearest (r = 1), same S; ``error <= baseline_error``.
    candidates: the ratios searched."""

    weight: torch.Tensor
    ratios: torch.Tensor
    error: float
    baseline_error: float
    candidates: tuple[float, ...]

    @property
    def clipped_fraction(self) -> float:
        """Share of the blocks with a ratio below 1."""
        return float((self.ratios < 1).float().mean()) if self.ratios.numel() else 0.0


def subsample_rows(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """At most ``max_tokens`` rows, evenly spaced over x (deterministic, covers every sequence)."""
    T = x.shape[0]
    if T <= max_tokens:
        return x
    idx = torch.div(torch.arange(max_tokens, dtype=torch.int64) * T, max_tokens, rounding_mode="floor")
    return x[idx.to(x.device)]


def _row_errors(x: torch.Tensor, xq: Optional[torch.Tensor], Q: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """[N] float64: sum over tokens of (x' q_n - x w_n)^2 (x' = xq, or x with ``xq`` None: x (q_n - w_n))."""
    N = W.shape[0]
    rows = max(1, _CHUNK_ELEMS // max(1, N))
    out = torch.zeros(N, dtype=torch.float64, device=W.device)
    D = Q - W if xq is None else None
    for r0 in range(0, x.shape[0], rows):
        xc = x[r0:r0 + rows]
        diff = xc @ D.T if xq is None else torch.addmm(xc @ W.T, xq[r0:r0 + rows], Q.T, beta=-1.0)
        out += diff.square().sum(0, dtype=torch.float64)
    return out


@torch.no_grad()
def awq_clip_search(weight: torch.Tensor, x: torch.Tensor, spec: NVFP4, encode_scale, *,
                    act_quantizer: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, n_grid: int = 20,
                    max_shrink: float = 0.5, max_tokens: int = 4096) -> ClipResult:
    """Auto-clip ``weight`` [N, K] (K a multiple of 16) for NVFP4 ``spec`` with the fixed outer scale
    ``encode_scale`` (S), scored on the calibration inputs ``x`` [..., K] this Linear sees (at most
    ``max_tokens`` evenly spaced tokens). ``act_quantizer``: W4A4, x -> the quantized inputs the layer's
    GEMM reads (``scheme_quantize.input_quantizer``); None for W4A16. See the module docstring."""
    fn = "awq_clip_search"
    if not clip_supported(spec):
        raise ValueError(f"{fn}: spec={spec!r}; auto-clip searches NVFP4 weights with 1x16 blocks and "
                         "rounding='nearest'")
    if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
        raise ValueError(f"{fn}: n_grid={n_grid!r} must be an int >= 1")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{fn}: max_tokens={max_tokens!r} must be an int >= 1")
    if not (isinstance(max_shrink, (int, float)) and not isinstance(max_shrink, bool) and 0 <= max_shrink < 1):
        raise ValueError(f"{fn}: max_shrink={max_shrink!r} must be a number in [0, 1)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{fn}: weight must be a floating [N, K] tensor")
    N, K = weight.shape
    if K == 0 or K % BLOCK:
        raise ValueError(f"{fn}: weight has in_features K={K}; NVFP4 needs a positive multiple of {BLOCK}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{fn}: x must be a floating [..., {K}] tensor")
    S = encode_scale_tensor(encode_scale, device=weight.device)
    W = weight.detach()
    Wf = W.float()
    xs = subsample_rows(x.detach().reshape(-1, K).to(W.device), max_tokens).float()
    T, nb = xs.shape[0], K // BLOCK
    ratios = clip_ratios(n_grid, max_shrink)
    if T == 0 or not bool(torch.isfinite(xs).all()):
        raise ValueError(f"{fn}: x has no tokens or contains NaN/inf")
    xq = act_quantizer(xs).float() if act_quantizer is not None else None

    # per-block Gram matrices (float64): W4A16 [nb, 16, 16] of x; W4A4 [nb, 32, 32] of (x', x)
    xb = xs.double().view(T, nb, BLOCK)
    z = xb if xq is None else torch.cat([xq.double().view(T, nb, BLOCK), xb], -1)
    G = torch.einsum("tgi,tgj->gij", z, z)
    Wb = Wf.view(N, nb, BLOCK)
    amax = Wb.abs().amax(-1, keepdim=True)

    def clipped(r: torch.Tensor) -> torch.Tensor:  # r: FP32 [] or [N, nb, 1]
        c = amax * r
        return torch.maximum(torch.minimum(Wb, c), -c).view(N, K).to(W.dtype)

    def block_errors(Q: torch.Tensor) -> torch.Tensor:  # [N, nb] float64
        v = (Q - Wf).double().view(N, nb, BLOCK) if xq is None else \
            torch.cat([Q.double().view(N, nb, BLOCK), -Wb.double()], -1)
        return (torch.einsum("ngi,gij->ngj", v, G) * v).sum(-1)

    best_err, best_r = None, torch.ones(N, nb, 1, dtype=torch.float32, device=W.device)
    Q1 = None
    for r in ratios:
        rt = torch.tensor(r, dtype=torch.float32, device=W.device)
        Q = fake_quantize(clipped(rt), spec, encode_scale=S, dtype=torch.float32)
        err = block_errors(Q)
        if best_err is None:
            best_err, Q1 = err, Q
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_r = torch.where(better.unsqueeze(-1), rt, best_r)

    # step 3: keep a row's clipping only where its exact output error is strictly lower than RTN's
    Wc = clipped(best_r)
    Qc = fake_quantize(Wc, spec, encode_scale=S, dtype=torch.float32)
    e_rtn = _row_errors(xs, xq, Q1, Wf)
    e_clip = _row_errors(xs, xq, Qc, Wf)
    keep = e_clip < e_rtn
    best_r = torch.where(keep.view(N, 1, 1), best_r, torch.ones_like(best_r))
    Wc = torch.where(keep.view(N, 1), Wc, W)
    denom = max(1, T * N)
    return ClipResult(weight=Wc, ratios=best_r.view(N, nb), error=float(torch.minimum(e_clip, e_rtn).sum()) / denom,
                      baseline_error=float(e_rtn.sum()) / denom, candidates=ratios)


__all__ = ["ClipResult", "awq_clip_search", "clip_ratios", "clip_supported", "subsample_rows"]
