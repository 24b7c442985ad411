"""NVFP4 rule "sweep": every positive finite E4M3 value as block scale, least squared error.

Start from the scale-to-6 choice and move only to a strictly lower error, trying candidates in
increasing order (so among equal errors the lowest candidate wins, and 6 wins ties with it).
The reference loops over the 126 candidates (``sweep_init`` / ``sweep_step`` / ``sweep_finish``,
each also compiled by ``quantize``); ``sweep_block_scales`` gives the same bits faster (``sweep_fast``, 1x16; all
candidates at once for 16x16 tiles) for callers that need only the scales with a fixed S (GPTQ).
"""
from __future__ import annotations

import torch

from .encode import block_outputs, candidate_error
from .scales import BLOCK, block_amax, block_scales, e4m3_positive_values
from .sweep_fast import fast_sweep_scales

SWEEP_CHUNK = 1 << 20  # elements of one candidate-error tensor [126, rows, nb] in ``sweep_block_scales``


def sweep_init(xb, S, block_2d: bool):
    """Sweep start for blocks [R, nb, 16], S [R, 1, 1]: the scale-to-6 block scales and their squared error."""
    xb = xb.float()
    inv_s = 1.0 / S
    s = block_scales(block_amax(xb, block_2d), S, 6)
    return s, candidate_error(xb, s, inv_s, None, "nearest", "hardware", "mse", block_2d).unsqueeze(-1)


def sweep_step(xb, S, cand, best_s, best_err, block_2d: bool):
    """One sweep candidate (0-d FP32 tensor): keep it where its squared error is strictly lower."""
    xb = xb.float()
    inv_s = 1.0 / S
    s = cand.expand_as(best_s)
    err = candidate_error(xb, s, inv_s, None, "nearest", "hardware", "mse", block_2d).unsqueeze(-1)
    better = err < best_err
    return torch.where(better, s, best_s), torch.where(better, err, best_err)


def sweep_finish(xb, S, best_s, outputs: str):
    """The outputs (``encode.block_outputs``) of the chosen sweep scales."""
    return block_outputs(xb.float(), best_s, 1.0 / S, None, "nearest", "hardware", outputs)


def sweep_blocks(xb, S, block_2d: bool, init=sweep_init, step=sweep_step, finish=sweep_finish,
                 outputs: str = "codes"):
    """The whole sweep over blocks [R, nb, 16] (``init`` / ``step`` / ``finish``: these or compiled copies)."""
    best_s, best_err = init(xb, S, block_2d)
    for cand in e4m3_positive_values():
        best_s, best_err = step(xb, S, cand, best_s, best_err, block_2d)
    return finish(xb, S, best_s, outputs)


def sweep_block_scales(Wm: torch.Tensor, S: torch.Tensor, block_2d: bool = False) -> torch.Tensor:
    """Sweep block scales [N, nb] of ``Wm`` [N, nb*16] (FP32) with one fixed S: bit for bit the choice of
    ``quantize(Wm, NVFP4(scale_rule="sweep"), encode_scale=S)``. 1x16 blocks: ``sweep_fast.fast_sweep_scales``
    (the provably losing candidates skipped, the same errors); 16x16 tiles: all 126 candidates at once per
    row chunk."""
    N, K = Wm.shape
    nb = K // BLOCK
    if not block_2d:
        return fast_sweep_scales(Wm.float().reshape(N * nb, BLOCK), S.reshape(()).float()).reshape(N, nb)
    rows = N
    if block_2d:
        rows = -(-N // BLOCK) * BLOCK
        Wm = torch.nn.functional.pad(Wm, (0, 0, 0, rows - N))
    xb = Wm.reshape(rows, nb, BLOCK)
    S3 = S.reshape(1, 1, 1)
    inv_s = 1.0 / S3
    cand = e4m3_positive_values().to(Wm.device)
    C = cand.numel()
    step = max(1, SWEEP_CHUNK // (C * nb))
    if block_2d:
        step = max(BLOCK, step // BLOCK * BLOCK)
    out = torch.empty(rows, nb, dtype=torch.float32, device=Wm.device)
    idx = torch.arange(C, device=Wm.device).view(C, 1, 1)
    for r0 in range(0, rows, step):
        x = xb[r0:r0 + step]
        s6, err6 = sweep_init(x, S3, block_2d)  # [r, nb, 1] each
        s_all = cand.view(C, 1, 1, 1).expand(C, x.shape[0], nb, 1)
        err = candidate_error(x, s_all, inv_s, None, "nearest", "hardware", "mse", block_2d)  # [C, r, nb]
        best = err.amin(dim=0)
        first = torch.where(err == best, idx, torch.full_like(idx, C)).amin(dim=0)
        out[r0:r0 + step] = torch.where(best < err6.squeeze(-1), cand[first], s6.squeeze(-1))
    return out[:N]


__all__ = ["SWEEP_CHUNK", "sweep_block_scales", "sweep_blocks", "sweep_finish", "sweep_init", "sweep_step"]
