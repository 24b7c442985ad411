"""NVFP4-aware GPTQ (Frantar et al., 2022), with a Four-Over-Six-aware variant.

GPTQ quantizes a linear layer's weight ``W`` [N, K] column by column and spreads each column's
rounding error over the columns not yet quantized, weighted by the inverse of the layer-input
Hessian ``H = (2/n) * sum_t x_t x_t^T`` [K, K] (see ``HessianAccumulator``), so that the layer
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

With a diagonal ``H`` nothing propagates and the result is RTN ``quantize(W, spec,
encode_scale=S)`` bit for bit (for the aware variant: when also ``H = c*I`` with ``U_jj`` a power
of two, e.g. ``H = 4*I`` and ``damp=0``, the aware choice is exactly RTN 4/6 with ``error="mse"``).

Only round-to-nearest specs (``rounding="nearest"``) are supported.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..formats.e2m1 import pack_nibbles
from ..quant.block_error import block_error, tile_error
from ..quant.dispatch import quantize
from ..quant.nvfp4 import _encode, _error, _reconstruct, _sweep_init, e4m3_positive_values
from ..quant.specs import NVFP4
from ..quant.tensor import QuantizedTensor

__all__ = ["GPTQConfig", "HessianAccumulator", "gptq_quantize"]

BLOCK = 16
FOUR_OVER_SIX_MODES = ("aware", "plain")
_SWEEP_CHUNK = 1 << 20  # elements of one candidate-error tensor [126, rows, nb] in the sweep


@dataclass(frozen=True)
class GPTQConfig:
    """Options of ``gptq_quantize``.

    damp: dampening ``damp * mean(diag(H))`` added to H's diagonal (a finite float >= 0).
    block_size: columns per lazy-batch block (a positive multiple of 16).
    act_order: process columns by decreasing ``diag(H)``; implies ``static_groups``.
    static_groups: fix every block scale up front from the original weights (see the module doc).
    four_over_six: for ``scale_rule="4over6"``: "aware" (choose 4 or 6 per block by the GPTQ loss
      inside the loop) or "plain" (the 4/6 rule on the group's current weights). Ignored for
      other rules, and for static groups (plain 4/6 on the original weights).
    """

    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    static_groups: bool = False
    four_over_six: str = "aware"

    def __post_init__(self):
        if isinstance(self.damp, bool) or not isinstance(self.damp, (int, float)) or not (
                float(self.damp) >= 0 and float(self.damp) < float("inf")):
            raise ValueError(f"damp={self.damp!r}: expected a finite float >= 0 (relative to mean(diag(H)))")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0 \
                or self.block_size % BLOCK:
            raise ValueError(f"block_size={self.block_size!r}: expected a positive multiple of {BLOCK} "
                             "(whole NVFP4 blocks), e.g. 128")
        for name in ("act_order", "static_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")
        if self.four_over_six not in FOUR_OVER_SIX_MODES:
            raise ValueError(f"four_over_six={self.four_over_six!r} is not supported; allowed values: "
                             f"{', '.join(map(repr, FOUR_OVER_SIX_MODES))}")


class HessianAccumulator:
    """Running ``H = (2/n) * sum_t x_t x_t^T`` [K, K] over calibration tokens.

    ``add(x)`` takes activations [..., K] (every leading index is a token) and updates the running
    mean: ``H <- H * n/(n+m) + (2/(n+m)) * X^T X`` for a chunk of m tokens. Accumulates in
    ``dtype`` (FP32 by default; FP64 for very long calibration runs).
    """

    def __init__(self, in_features: int, device=None, dtype: torch.dtype = torch.float32):
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features={in_features!r}: expected a positive int")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype={dtype}: expected torch.float32 or torch.float64")
        self.in_features = in_features
        self._H = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.n_tokens = 0

    @property
    def H(self) -> torch.Tensor:
        """The current Hessian estimate [K, K] (zeros before any ``add``)."""
        return self._H

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating torch.Tensor, got {type(x).__name__}"
                            + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., {self.in_features}] (in_features)")
        x2 = x.detach().reshape(-1, self.in_features).to(device=self._H.device, dtype=self._H.dtype)
        m = x2.shape[0]
        if m == 0:
            return
        n = self.n_tokens
        self._H.mul_(n / (n + m))
        self._H.addmm_(x2.T, x2, alpha=2.0 / (n + m))
        self.n_tokens = n + m


# ----------------------------------------------------------------------------------------------
# block scales


def _sweep_scales(Wm: torch.Tensor, S: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """Sweep block scales [N, nb] of ``Wm`` [N, nb*16] (FP32) with fixed S: bit for bit the choice of
    ``quantize(Wm, NVFP4(scale_rule="sweep"), encode_scale=S)`` (start at scale-to-6, move only to a
    strictly lower squared error, the lowest such candidate first), all 126 candidates at once."""
    N, K = Wm.shape
    nb = K // BLOCK
    rows = N
    if block_2d:
        rows = -(-N // BLOCK) * BLOCK
        Wm = torch.nn.functional.pad(Wm, (0, 0, 0, rows - N))
    xb = Wm.reshape(rows, nb, BLOCK)
    S3 = S.reshape(1, 1, 1)
    inv_s = 1.0 / S3
    cand = e4m3_positive_values().to(Wm.device)
    C = cand.numel()
    step = max(1, _SWEEP_CHUNK // (C * nb))
    if block_2d:
        step = max(BLOCK, step // BLOCK * BLOCK)
    out = torch.empty(rows, nb, dtype=torch.float32, device=Wm.device)
    idx = torch.arange(C, device=Wm.device).view(C, 1, 1)
    for r0 in range(0, rows, step):
        x = xb[r0:r0 + step]
        s6, err6 = _sweep_init(x, S3, block_2d)  # [r, nb, 1] each
        s_all = cand.view(C, 1, 1, 1).expand(C, x.shape[0], nb, 1)
        err = _error(x, s_all, inv_s, None, "nearest", "hardware", "mse", block_2d)  # [C, r, nb]
        best = err.amin(dim=0)
        first = torch.where(err == best, idx, torch.full_like(idx, C)).amin(dim=0)
        out[r0:r0 + step] = torch.where(best < err6.squeeze(-1), cand[first], s6.squeeze(-1))
    return out[:N]


def _block_scales(Wm: torch.Tensor, spec: NVFP4, rule: str, S: torch.Tensor) -> torch.Tensor:
    """FP32 block scales [N, nb] the library chooses for ``Wm`` [N, nb*16] with ``rule`` and fixed S."""
    if rule == "sweep":
        return _sweep_scales(Wm, S, spec.block_2d)
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
        qj = _reconstruct(w, s[..., j], inv_S, None, "nearest", "hardware")
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
                         f"column {int(info) - 1}); raise GPTQConfig.damp or use more calibration tokens")
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info):
        raise ValueError(f"H^-1 is not numerically positive definite (column {int(info) - 1}); raise GPTQConfig.damp")
    return U.to(torch.float32), perm, n_dead


def _check_inputs(weight, H, spec, encode_scale, config):
    if not isinstance(spec, NVFP4):
        raise TypeError(f"spec must be blockscale.NVFP4 (GPTQ here targets NVFP4 blocks), got {type(spec).__name__}")
    if spec.rounding != "nearest":
        raise ValueError(f"spec.rounding={spec.rounding!r}: GPTQ needs deterministic rounding='nearest'")
    if not isinstance(config, GPTQConfig):
        raise TypeError(f"config must be a GPTQConfig, got {type(config).__name__}")
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
    if not isinstance(encode_scale, torch.Tensor):
        encode_scale = torch.tensor(float(encode_scale), dtype=torch.float32)
    if encode_scale.numel() != 1:
        raise ValueError(f"encode_scale must be one FP32 scalar (per-tensor outer scale S), got shape "
                         f"{tuple(encode_scale.shape)}")
    S = encode_scale.detach().to(device=weight.device, dtype=torch.float32).reshape(())
    if not (bool(torch.isfinite(S)) and float(S) > 0):
        raise ValueError(f"encode_scale={float(S)!r}: must be a positive finite FP32 scalar")
    return S


@torch.no_grad()
def _gptq(weight, H, spec, encode_scale, config):
    """The GPTQ loop. Returns (Q [N, K] FP32 as computed in the loop, pre-quantization values
    [N, K], block scales [N, K/16] FP32, S, stats)."""
    t0 = time.perf_counter()
    S = _check_inputs(weight, H, spec, encode_scale, config)
    inv_S = 1.0 / S
    N, K = weight.shape
    nb = K // BLOCK
    W = weight.detach().to(torch.float32).clone()
    static = config.static_groups or config.act_order
    U, perm, n_dead = _hessian_factor(H, W, float(config.damp), config.act_order)
    rule = spec.scale_rule
    aware = rule == "4over6" and config.four_over_six == "aware" and not static
    dev = W.device

    scales = torch.empty(N, nb, dtype=torch.float32, device=dev)
    n4 = torch.zeros((), dtype=torch.float64, device=dev)
    if static:  # every block scale from the original weights, then the columns in processing order
        scales = _block_scales(W, spec, rule, S)
        if rule == "4over6":
            s6, s4 = _block_scales(W, spec, "6", S), _block_scales(W, spec, "4", S)
            n4 = ((scales == s4) & (s4 != s6)).sum().double()
        scol = scales.repeat_interleave(BLOCK, dim=1)
        if perm is not None:
            W = W[:, perm]
            scol = scol[:, perm]

    Q = torch.empty_like(W)
    E = torch.empty_like(W)
    P = torch.empty_like(W)
    B = config.block_size
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
            else:
                s = _block_scales(Wg, spec, rule, S)  # [N, 1], from the current weights
                if rule == "4over6":
                    s6, s4 = _block_scales(Wg, spec, "6", S), _block_scales(Wg, spec, "4", S)
                    n4 += ((s == s4) & (s != s6)).sum()
                scales[:, c1 // BLOCK] = s.squeeze(-1)
                q, e, p = _segment(Wg, Ug, s.expand(N, BLOCK), inv_S)
            Q[:, c1:c2] = q
            E[:, c1:c2] = e
            P[:, c1:c2] = p
            if g2 < i2 - i1:
                W1[:, g2:] -= e @ U1[g1:g2, g2:]
        if i2 < K:
            W[:, i2:] -= E[:, i1:i2] @ U[i1:i2, i2:]

    if perm is not None:
        inv = torch.argsort(perm)
        Q, E, P = Q[:, inv], E[:, inv], P[:, inv]
    stats = {
        "loss": float(E.double().square().sum()),
        "frac_scale4": float(n4) / max(N * nb, 1) if rule == "4over6" else 0.0,
        "dead_columns": n_dead,
        "seconds": time.perf_counter() - t0,
    }
    return Q, P, scales, S, stats


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, spec: NVFP4, encode_scale: torch.Tensor,
                  config: GPTQConfig = GPTQConfig()) -> tuple[QuantizedTensor, dict]:
    """GPTQ-quantize ``weight`` [N, K] (K a multiple of 16) to NVFP4 with the fixed outer encode
    scale ``encode_scale`` (FP32 scalar S) and the layer-input Hessian ``H`` [K, K].

    Returns ``(q, stats)``: ``q`` a QuantizedTensor (dtype = weight's dtype) whose
    ``q.dequantize()`` is the GPTQ result bit for bit; ``stats`` = {"loss": total GPTQ loss
    ``sum ((w - q)/d)^2``, "frac_scale4": fraction of blocks at their scale-to-4 candidate
    (4over6; 0 otherwise), "dead_columns": inputs with H_ii == 0 (their weights were zeroed),
    "seconds": wall time}. See the module docstring for the exact semantics.
    """
    t0 = time.perf_counter()
    _, P, scales, S, stats = _gptq(weight, H, spec, encode_scale, config)
    N, K = P.shape
    nb = K // BLOCK
    inv_S = 1.0 / S
    codes = _encode(P.view(N, nb, BLOCK), scales.view(N, nb, 1), inv_S, None, "nearest", "hardware")
    amax = torch.tensor(spec.outer_bound * 6.0, dtype=torch.float32, device=S.device) / S
    q = QuantizedTensor(spec=spec, codes=pack_nibbles(codes.reshape(N, K)), scales=scales.to(torch.float8_e4m3fn),
                        shape=weight.shape, dtype=weight.dtype, outer_scale=S, amax=amax)
    stats["seconds"] = time.perf_counter() - t0
    return q, stats
