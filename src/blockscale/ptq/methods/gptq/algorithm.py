"""The GPTQ algorithm: NVFP4-aware GPTQ (Frantar et al., 2022), with a Four-Over-Six-aware variant.

GPTQ quantizes a linear layer's weight ``W`` [N, K] column by column and spreads each column's
rounding error over the columns not yet quantized, weighted by the inverse of the layer-input
Hessian ``H = (2/n) * sum_t x_t x_t^T`` [K, K] (``ptq.statistics.HessianAccumulator``), so that the layer
output error ``||(W - Q) X^T||_F^2`` is small rather than the weight error ``||W - Q||^2``.

Algorithm (per call, everything in FP32 except the Cholesky factorizations, done in FP64):

1. Dead inputs (``H_ii == 0``: the channel was zero on every calibration token): ``H_ii = 1`` and
   ``W[:, i] = 0``. The column has no effect on the calibrated output, and zeroing it can only
   lower its NVFP4 block's amax (finer scales for the other 15 columns); its codes are 0.
2. With ``act_order``: columns are processed in order of decreasing ``H_ii`` (stable sort).
3. Dampening: ``H += damp * mean(diag(H)) * I``.
4. ``U`` = upper Cholesky factor of ``H^-1``; ``d_j = U_jj``.
5. For every column j in processing order: ``q_j = quantize(w_j)`` with that column's NVFP4 block
   scale, ``err_j = (w_j - q_j) / d_j``, ``w_{k} -= err_j * U_{j,k}`` for the later columns k.
   Updates are applied lazily: within a 16-column group column by column, to the rest of a
   ``block_size`` block once per group, and to the columns after the block once per block
   (all three orders give the same result up to FP32 rounding).

NVFP4 specifics. A block is 16 consecutive *original* columns of a row; its E4M3 scale ``s`` and
the fixed outer encode scale ``S`` (given by the caller, e.g. from the amax of a fused q/k/v
group) determine every code of the block: ``q = E2M1_RNE(clamp(w * e, -6, 6)) * s * (1/S)``,
``e = 1 / (s * (1/S))``, computed with the library's own kernels (``quant.nvfp4``), so the
returned codes are bit for bit what ``blockscale.quantize`` stores for those block scales.

* Default (no ``act_order``, no ``static_groups``): when the loop reaches the first column of a
  group, the group's block scales are chosen from the *current* (already error-corrected) weights
  ``W[:, g:g+16]`` with ``spec.scale_rule`` ("6", "4", "sweep", or "4over6" as below) and the fixed
  ``S``; then its 16 columns are quantized one by one with those scales fixed.
* ``static_groups=True``: every block scale is chosen up front from the original weights (after
  the dead-column zeroing) with ``spec.scale_rule``; for "4over6" that is the plain 4/6 rule with
  ``spec.error``. ``act_order=True`` implies ``static_groups=True``: after the permutation a
  block's 16 columns are scattered over the whole loop, so its scale cannot wait for them.
* "4over6" with ``four_over_six="aware"`` (default, not static): the 16-column inner loop runs
  twice for the group, once with every row's block at its scale-to-4 candidate and once at
  scale-to-6 (the two candidates ``quantize`` with rules "4" and "6" picks for the fixed ``S``),
  and each row keeps the candidate whose GPTQ loss over the group ``sum_j ((w_j - q_j)/d_j)^2``
  (summed in ``block_error``'s fixed pairwise order) is strictly lower; ties keep 6. Rows are
  independent in GPTQ, so the kept row continues exactly as if only its candidate had been run.
  The loss is squared by construction: ``spec.error`` is not used by the aware choice. With
  ``block_2d`` the choice is per 16x16 tile (the tile's summed loss, in ``tile_error``'s order).
  ``four_over_six="plain"``: the library's 4/6 rule (with ``spec.error``) on the group's current
  weights, as RTN 4/6 would choose.

* Hessian-aware rules (``weighted_rule="hessian"`` / ``"hessian-4over6"``, ``spec`` their stored base spec
  ``WEIGHTED_RULES[rule]``): wherever the rules above choose a group's scales (from the current weights, or up
  front for static groups), the weighted rule chooses them instead, with channel weights ``d`` (default: the
  undamped diagonal of ``H``; dead inputs 0), ``quant.nvfp4.weighted.weighted_block_scales``.

With a diagonal ``H`` nothing propagates and the result is RTN ``quantize(W, spec,
encode_scale=S)`` bit for bit (for the aware variant: when also ``H = c*I`` with ``U_jj`` a power
of two, e.g. ``H = 4*I`` and ``damp=0``, the aware choice is exactly RTN 4/6 with ``error="mse"``).

Only round-to-nearest specs (``rounding="nearest"``) are supported.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import torch

from ....formats.e2m1 import pack_nibbles
from ....quant import NVFP4, QuantizedTensor, quantize
from ....quant.block_error import block_error, tile_error
from ....quant.nvfp4 import (BLOCK, amax_of_outer_scale, encode_blocks, encode_scale_tensor, reconstruct_blocks,
                             sweep_block_scales)
from ....quant.nvfp4.weighted import WEIGHTED_RULES, check_channel_weights, weighted_block_scales
from .options import GPTQOptions


# ----------------------------------------------------------------------------------------------
# block scales


def _block_scales(Wm: torch.Tensor, spec: NVFP4, rule: str, S: torch.Tensor, d=None) -> torch.Tensor:
    """FP32 block scales [N, nb] the library chooses for ``Wm`` [N, nb*16] with ``rule`` and fixed S (a
    Hessian-aware rule: with the channel weights ``d`` of those columns)."""
    if rule in WEIGHTED_RULES:
        return weighted_block_scales(Wm, S, d, rule)
    if rule == "sweep":
        return sweep_block_scales(Wm, S, spec.block_2d)
    return quantize(Wm, replace(spec, scale_rule=rule), encode_scale=S).scales.to(torch.float32)


# ----------------------------------------------------------------------------------------------
# the GPTQ loop


def _segment(Wg: torch.Tensor, U: torch.Tensor, s: torch.Tensor, inv_S: torch.Tensor):
    """GPTQ over the columns of ``Wg`` [..., N, m] (updated in place), each quantized with its block
    scale ``s`` [..., N, m]; ``U`` [m, m] is the segment's block of the Cholesky factor.
    Returns (q, err, pre): quantized values, scaled errors (w - q)/d, values at quantization time."""
    m = Wg.shape[-1]
    q = torch.empty_like(Wg)
    err = torch.empty_like(Wg)
    pre = torch.empty_like(Wg)
    for j in range(m):
        w = Wg[..., j]
        pre[..., j] = w
        qj = reconstruct_blocks(w, s[..., j], inv_S)
        ej = (w - qj) / U[j, j]
        q[..., j] = qj
        err[..., j] = ej
        if j + 1 < m:
            Wg[..., j + 1:] -= ej.unsqueeze(-1) * U[j, j + 1:]
    return q, err, pre


def _aware_loss(err: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """GPTQ loss of each candidate's row block (or 16x16 tile, broadcast to its rows): err [2, N, 16] -> [2, N]."""
    if not block_2d:
        return block_error(err, "mse")
    c, N, _ = err.shape
    rows = -(-N // BLOCK) * BLOCK
    e = torch.nn.functional.pad(err, (0, 0, 0, rows - N)).view(c, rows // BLOCK, BLOCK, BLOCK)
    return tile_error(e, "mse").repeat_interleave(BLOCK, dim=-1)[:, :N]


def _hessian_factor(H: torch.Tensor, W: torch.Tensor, damp: float, act_order: bool):
    """Dead columns, optional permutation, dampening; returns (U fp32 upper Cholesky of H^-1, perm, n_dead)."""
    H = H.to(device=W.device, dtype=torch.float64).clone()
    diag = torch.diagonal(H)
    dead = diag == 0
    n_dead = int(dead.sum())
    if n_dead:
        diag[dead] = 1.0
        W[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(diag, descending=True, stable=True)
        H = H[perm][:, perm]
        diag = torch.diagonal(H)
    diag += damp * float(diag.mean())
    L, info = torch.linalg.cholesky_ex(H)
    if int(info):
        raise ValueError(f"H (+ dampening {damp} * mean diag) is not positive definite (Cholesky failed at "
                         f"column {int(info) - 1}); raise GPTQOptions.damp or use more calibration tokens")
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info):
        raise ValueError(f"H^-1 is not numerically positive definite (column {int(info) - 1}); raise GPTQOptions.damp")
    return U.to(torch.float32), perm, n_dead


def _channel_weights(rule: str, d, H: torch.Tensor, spec: NVFP4, K: int, device) -> torch.Tensor:
    """The channel weights [K] of a Hessian-aware ``rule`` inside GPTQ: ``d`` (checked), or diag(H) when None."""
    if rule not in WEIGHTED_RULES:
        raise ValueError(f"weighted_rule={rule!r}; allowed values: None, {', '.join(map(repr, WEIGHTED_RULES))}")
    base = WEIGHTED_RULES[rule]
    if spec.scale_rule != base.scale_rule or spec.outer_bound != base.outer_bound:
        raise ValueError(f"weighted_rule={rule!r} stores its weights as {base.scale_rule!r} (outer bound "
                         f"{base.outer_bound:g}); got spec with scale_rule={spec.scale_rule!r}, outer bound "
                         f"{spec.outer_bound:g}")
    if d is None:
        d = torch.diagonal(H).to(device=device, dtype=torch.float32)
    return check_channel_weights(d, K, device)


def _check_inputs(weight, H, spec, encode_scale, options):
    if not isinstance(spec, NVFP4):
        raise TypeError(f"spec must be blockscale.NVFP4 (GPTQ here targets NVFP4 blocks), got {type(spec).__name__}")
    if spec.rounding != "nearest":
        raise ValueError(f"spec.rounding={spec.rounding!r}: GPTQ needs deterministic rounding='nearest'")
    if not isinstance(options, GPTQOptions):
        raise TypeError(f"options must be a GPTQOptions, got {type(options).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError("weight must be a torch.Tensor of dtype float32, bfloat16 or float16"
                        + (f", got {weight.dtype}" if isinstance(weight, torch.Tensor) else ""))
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if K == 0 or K % BLOCK:
        raise ValueError(f"weight has in_features K={K}; NVFP4 GPTQ needs K to be a positive multiple of {BLOCK}")
    if not isinstance(H, torch.Tensor) or not H.is_floating_point():
        raise TypeError("H must be a floating torch.Tensor [K, K]")
    if tuple(H.shape) != (K, K):
        raise ValueError(f"H has shape {tuple(H.shape)}; expected ({K}, {K}) for weight of shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(H).all()):
        raise ValueError("H contains NaN/inf")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight contains NaN/inf")
    return encode_scale_tensor(encode_scale, device=weight.device)


@torch.no_grad()
def _gptq(weight, H, spec, encode_scale, options, weighted_rule=None, d=None):
    """The GPTQ loop. Returns (Q [N, K] FP32 as computed in the loop, pre-quantization values
    [N, K], block scales [N, K/16] FP32, S, stats)."""
    t0 = time.perf_counter()
    S = _check_inputs(weight, H, spec, encode_scale, options)
    inv_S = 1.0 / S
    N, K = weight.shape
    nb = K // BLOCK
    W = weight.detach().to(torch.float32).clone()
    static = options.static_groups or options.act_order
    dcol = None
    if weighted_rule is not None:
        dcol = _channel_weights(weighted_rule, d, H, spec, K, W.device)
    U, perm, n_dead = _hessian_factor(H, W, float(options.damp), options.act_order)
    rule = spec.scale_rule if weighted_rule is None else weighted_rule
    if dcol is not None and n_dead:
        dcol = torch.where(torch.diagonal(H).to(dcol.device) == 0, torch.zeros_like(dcol), dcol)
    four6 = rule in ("4over6", "hessian-4over6")  # two candidates: report the share of blocks at scale-to-4
    aware = rule == "4over6" and options.four_over_six == "aware" and not static
    dev = W.device

    scales = torch.empty(N, nb, dtype=torch.float32, device=dev)
    n4 = torch.zeros((), dtype=torch.float64, device=dev)
    if static:  # every block scale from the original weights, then the columns in processing order
        scales = _block_scales(W, spec, rule, S, dcol)
        if four6:
            s6, s4 = _block_scales(W, spec, "6", S), _block_scales(W, spec, "4", S)
            n4 = ((scales == s4) & (s4 != s6)).sum().double()
        scol = scales.repeat_interleave(BLOCK, dim=1)
        if perm is not None:
            W = W[:, perm]
            scol = scol[:, perm]

    Q = torch.empty_like(W)
    E = torch.empty_like(W)
    P = torch.empty_like(W)
    B = options.block_size
    for i1 in range(0, K, B):
        i2 = min(i1 + B, K)
        W1 = W[:, i1:i2]
        U1 = U[i1:i2, i1:i2]
        for g1 in range(0, i2 - i1, BLOCK):
            g2 = g1 + BLOCK
            c1, c2 = i1 + g1, i1 + g2  # columns (processing order)
            Wg = W1[:, g1:g2]
            Ug = U1[g1:g2, g1:g2]
            if static:
                q, e, p = _segment(Wg, Ug, scol[:, c1:c2], inv_S)
            elif aware:
                s6 = _block_scales(Wg, spec, "6", S)  # [N, 1]
                s4 = _block_scales(Wg, spec, "4", S)
                both = torch.stack((Wg, Wg))  # [2, N, 16]: 6 then 4
                sc = torch.stack((s6, s4)).expand(2, N, BLOCK)
                q2, e2, p2 = _segment(both, Ug, sc, inv_S)
                loss = _aware_loss(e2, spec.block_2d)  # [2, N]
                pick4 = (loss[1] < loss[0]).unsqueeze(-1)  # ties keep 6
                q, e, p = (torch.where(pick4, t[1], t[0]) for t in (q2, e2, p2))
                scales[:, c1 // BLOCK] = torch.where(pick4, s4, s6).squeeze(-1)
                n4 += pick4.sum()
            else:  # [N, 1], from the current weights (a Hessian-aware rule: this block's channel weights)
                s = _block_scales(Wg, spec, rule, S, None if dcol is None else dcol[c1:c2])
                scales[:, c1 // BLOCK] = s.squeeze(-1)
                q, e, p = _segment(Wg, Ug, s.expand(N, BLOCK), inv_S)
            Q[:, c1:c2] = q
            E[:, c1:c2] = e
            P[:, c1:c2] = p
            if g2 < i2 - i1:
                W1[:, g2:] -= e @ U1[g1:g2, g2:]
        if i2 < K:
            W[:, i2:] -= E[:, i1:i2] @ U[i1:i2, i2:]

    if four6 and not static and not aware:  # each scale is scale-to-6 or scale-to-4 of the values it rounded (P)
        n4 = (scales != _block_scales(P, spec, "6", S)).sum().double()
    if perm is not None:
        inv = torch.argsort(perm)
        Q, E, P = Q[:, inv], E[:, inv], P[:, inv]
    stats = {
        "loss": float(E.double().square().sum()),
        "frac_scale4": float(n4) / max(N * nb, 1) if four6 else 0.0,
        "dead_columns": n_dead,
        "seconds": time.perf_counter() - t0,
    }
    return Q, P, scales, S, stats


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, spec: NVFP4, encode_scale: torch.Tensor,
                  options: GPTQOptions = GPTQOptions(), weighted_rule: Optional[str] = None,
                  d: Optional[torch.Tensor] = None) -> tuple[QuantizedTensor, dict]:
    """GPTQ-quantize ``weight`` [N, K] (K a multiple of 16) to NVFP4 with the fixed outer encode
    scale ``encode_scale`` (FP32 scalar S) and the layer-input Hessian ``H`` [K, K].

    Returns ``(q, stats)``: ``q`` a QuantizedTensor (dtype = weight's dtype) whose
    ``q.dequantize()`` is the GPTQ result bit for bit; ``stats`` = {"loss": total GPTQ loss
    ``sum ((w - q)/d)^2``, "frac_scale4": fraction of blocks at their scale-to-4 candidate
    (4over6 and hessian-4over6; 0 otherwise), "dead_columns": inputs with H_ii == 0 (their weights were zeroed),
    "seconds": wall time, "latent": the FP32 [N, K] values the loop rounded (each column after the error
    feedback of the earlier ones): their rounding with ``q``'s scales is ``q``'s codes, so scale learning can
    start from them (``QuantizedWeight.latent``)}. See the module docstring for the exact semantics.
    """
    t0 = time.perf_counter()
    _, P, scales, S, stats = _gptq(weight, H, spec, encode_scale, options, weighted_rule, d)
    N, K = P.shape
    nb = K // BLOCK
    inv_S = 1.0 / S
    codes = encode_blocks(P.view(N, nb, BLOCK), scales.view(N, nb, 1), inv_S)
    amax = amax_of_outer_scale(S, spec.outer_bound)
    q = QuantizedTensor(spec=spec, codes=pack_nibbles(codes.reshape(N, K)), scales=scales.to(torch.float8_e4m3fn),
                        shape=weight.shape, dtype=weight.dtype, outer_scale=S, amax=amax)
    stats["seconds"] = time.perf_counter() - t0
    stats["latent"] = P
    return q, stats


__all__ = ["gptq_quantize"]
