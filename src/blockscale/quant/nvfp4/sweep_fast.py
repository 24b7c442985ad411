"""The exact fast NVFP4 sweep: per 1x16 block, the positive E4M3 block scale of least (optionally
channel-weighted) squared error, bit for bit the choice of the reference loop (``sweep.sweep_blocks``:
start from scale-to-6, move only to a strictly lower error, candidates in increasing order, so among equal
errors the lowest candidate wins and scale-to-6 wins ties with it).

Same arithmetic as the reference, less of it:

* Errors: each candidate's 16 terms ``(dx * dx) [* w]`` with dx = (v * s) * (1/S) - |x| (the sign drops out
  exactly), v = E2M1_RNE(min(|x| * e, 6)), e = ``encode_multiplier(s, 1/S)``, summed in ``block_error``'s
  fixed tree order; computed on one [16, C', b] work tensor per chunk (cache-sized, in place), position
  major. The E2M1 rounding is ``(y + M) - M`` with M = 2^(22 + max(exponent(y), 0)) (bit for bit
  ``round_magnitude(y, E2M1)`` on 0 <= y <= 6: the FP32 add rounds y to the grid step of its binade, 0.5
  below 2, 1 below 4, 2 up to 6, ties to even; tested exhaustively near every rounding boundary).
* Pruning (exact): a candidate whose term at the block's largest-|x| element alone is >= the scale-to-6
  error cannot be chosen (the FP32 tree sum of non-negative terms is never below one of them, and only a
  strictly lower error replaces scale-to-6). Per block only the window between the lowest and the highest
  candidate that survives this test is evaluated (about 20 of 126 on SmolLM2); blocks are sorted by their
  window and evaluated in chunks over the chunk's common window. Pruned candidates have errors >= the
  scale-to-6 error, so neither the minimum nor the tie order changes.
"""
from __future__ import annotations

import torch

from .encode import encode_multiplier
from .scales import BLOCK, block_amax, block_scales, e4m3_positive_values

FAST_CHUNK = 1 << 17  # elements of one work tensor [16, C', b] (fits the L2 cache)
_EXP_BITS = 0x7F800000  # FP32 exponent field
_ONE_BITS = 0x3F800000  # bits of 1.0
_STEP_SHIFT = 22 << 23  # x 2^22: M's ulp is then the E2M1 grid step of y's binade
_BIG = 1024.0  # > any candidate index: a key offset that marks a pruned / non-least candidate


def e2m1_round_(y: torch.Tensor) -> torch.Tensor:
    """In place: FP32 ``y`` (0 <= y <= 6, contiguous) rounded to the nearest E2M1 magnitude, ties to even;
    bit for bit ``round_magnitude(y, E2M1)``. M = 2^(22 + max(e(y), 0)) has ulp 0.5 / 1 / 2 for y below 2 /
    4 / up to 6, so fl(y + M) - M is y rounded to that step (exact subtraction)."""
    m = torch.bitwise_and(y.view(torch.int32), _EXP_BITS)
    m.clamp_(min=_ONE_BITS).add_(_STEP_SHIFT)
    mf = m.view(torch.float32)
    return y.add_(mf).sub_(mf)


def candidate_errors(ax: torch.Tensor, w, s: torch.Tensor, inv_s: torch.Tensor) -> torch.Tensor:
    """Errors [C, b] of blocks with magnitudes ``ax`` [16, b] (position major, FP32) and weights ``w``
    ([16, b] or None for all ones) under block scales ``s`` ([C, 1]: C candidates for every block, or
    [C, b]), outer 1/S ``inv_s`` (0-d): bit for bit ``weighted_block_error`` / the sweep's "mse" error."""
    e = encode_multiplier(s, inv_s)
    y = torch.mul(ax.unsqueeze(1), e.unsqueeze(0))  # [16, C, b]
    y.clamp_(max=6.0)
    e2m1_round_(y)
    y.mul_(s.unsqueeze(0)).mul_(inv_s).sub_(ax.unsqueeze(1))  # dx = (v * s) * (1/S) - |x|
    y.mul_(y)
    if w is not None:
        y.mul_(w.unsqueeze(1))
    n = BLOCK
    while n > 1:  # block_error's tree: v[:h] + v[h:]
        h = n // 2
        y[:h] += y[h:n]
        n = h
    return y[0]


def _element_terms(a: torch.Tensor, wm, cand: torch.Tensor, inv_s: torch.Tensor) -> torch.Tensor:
    """The error term [C, b] of one element per block (magnitude ``a`` [b], weight ``wm`` [b] or None) under
    every candidate ``cand`` [C]: the very value ``candidate_errors`` adds at that position."""
    s = cand.view(-1, 1)
    y = a.view(1, -1) * encode_multiplier(s, inv_s)
    y.clamp_(max=6.0)
    e2m1_round_(y)
    y.mul_(s).mul_(inv_s).sub_(a.view(1, -1))
    y.mul_(y)
    if wm is not None:
        y.mul_(wm.view(1, -1))
    return y


def fast_sweep_scales(xf: torch.Tensor, S: torch.Tensor, wf=None, clip: bool = True) -> torch.Tensor:
    """Sweep block scales [B] (FP32 values) of blocks ``xf`` [B, 16] (FP32) with outer scale ``S`` (0-d FP32)
    and per-element weights ``wf`` ([B, 16] or None: all ones), bit for bit the reference sweep's choice.
    ``clip=False``: only the candidates at or above each block's scale-to-6 (none that clips the block's
    largest element more than scale-to-6 does)."""
    B = xf.shape[0]
    dev = xf.device
    cand = e4m3_positive_values().to(dev)
    C = cand.numel()
    S3 = S.reshape(1, 1, 1)
    inv_s = (1.0 / S3).reshape(())
    s6 = block_scales(block_amax(xf.view(B, 1, BLOCK)), S3, 6).reshape(B)
    ax_all = xf.abs().T.contiguous()  # [16, B]
    w_all = None if wf is None else wf.T.contiguous()
    err6 = torch.empty(B, dtype=torch.float32, device=dev)
    lo = torch.empty(B, dtype=torch.int64, device=dev)
    hi = torch.empty(B, dtype=torch.int64, device=dev)
    idx_f = torch.arange(C, dtype=torch.float32, device=dev).view(C, 1)
    step0 = max(1, FAST_CHUNK // C)
    for b0 in range(0, B, step0):
        sl = slice(b0, b0 + step0)
        ax = ax_all[:, sl]
        w = None if w_all is None else w_all[:, sl]
        e6 = candidate_errors(ax, w, s6[sl].view(1, -1), inv_s)[0]
        err6[sl] = e6
        if w is None:
            t = _element_terms(ax.amax(dim=0), None, cand, inv_s)
        else:  # a largest-|x| element (any one gives a valid bound)
            jm = ax.argmax(dim=0, keepdim=True)
            t = _element_terms(ax.gather(0, jm).view(-1), w.gather(0, jm).view(-1), cand, inv_s)
        # term >= err6: err >= err6, never strictly lower. sign(t - err6) + 1 is 0 exactly where t < err6
        # (an FP32 difference has the sign of the exact one); float keys, as compare / where are slow here
        pruned = t.sub_(e6.view(1, -1)).sign_().nan_to_num_(1.0).add_(1.0)  # inf - inf: pruned (not lower)
        if not clip:
            pruned.add_((cand.view(C, 1) < s6[sl].view(1, -1)).float())
        lo[sl] = torch.add(idx_f, pruned, alpha=_BIG).amin(dim=0).to(torch.int64)  # >= _BIG: none kept
        hi[sl] = torch.add(idx_f, pruned, alpha=-_BIG).amax(dim=0).to(torch.int64)  # < 0: none kept
    out = s6.clone()
    todo = torch.nonzero(lo <= hi).view(-1)  # blocks with a candidate left
    if not todo.numel():
        return out
    order = todo[torch.argsort(lo[todo] * C + hi[todo], stable=True)]
    lo_s, hi_s = lo[order].tolist(), hi[order]
    ax_s = ax_all[:, order].contiguous()
    w_s = None if w_all is None else w_all[:, order].contiguous()
    n, b0 = order.numel(), 0
    while b0 < n:
        first = lo_s[b0]
        b1 = min(n, b0 + max(1, FAST_CHUNK // (BLOCK * (int(hi_s[b0]) - first + 1))))
        last = int(hi_s[b0:b1].amax())
        b1 = min(b1, b0 + max(1, FAST_CHUNK // (BLOCK * (last - first + 1))))
        last = int(hi_s[b0:b1].amax())
        cs = cand[first:last + 1]
        err = candidate_errors(ax_s[:, b0:b1], None if w_s is None else w_s[:, b0:b1], cs.view(-1, 1), inv_s)
        rows = order[b0:b1]
        if not clip:
            err.masked_fill_(cs.view(-1, 1) < s6[rows].view(1, -1), float("inf"))
        best = err.amin(dim=0)
        tied = err.sub_(best).sign_().nan_to_num_(0.0)  # 0 exactly at the least error (err >= best; inf = inf)
        pick = torch.add(idx_f[:cs.numel()], tied, alpha=_BIG).amin(dim=0).to(torch.int64)  # the lowest of those
        out[rows] = torch.where(best < err6[rows], cs[pick], s6[rows])
        b0 = b1
    return out


__all__ = ["FAST_CHUNK", "candidate_errors", "e2m1_round_", "fast_sweep_scales"]
