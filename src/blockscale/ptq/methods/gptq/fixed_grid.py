"""GPTQ for FP8 (per tensor / channel / 128x128 block) and MX (MXFP8 / MXFP4) weights: the GPTQ loop
of ``algorithm`` with a fixed quantization grid per column.

The error feedback is the NVFP4 loop's (dead columns, ``act_order``, dampening, the upper Cholesky
factor U of H^-1, lazy batches; see ``algorithm``); only the grid each column is rounded onto differs:

* FP8: every scale is chosen up front from the original weights (after the dead-column zeroing), as
  ``quantize`` chooses it: ``s = amax / 448`` per tensor (or the fused group's shared ``s`` given by
  the caller), per output row, or per 128x128 tile. Column j of row r is
  ``q = E4M3_RNE(clamp(w / s_rj, -448, 448)) * s_rj`` (``quant.fp8.encode_with_scale``), so values
  the error feedback pushed beyond the original amax saturate.
* MX: one UE8M0 exponent k per row and 32 consecutive original columns. Default: when the loop
  reaches a 32-column group, k is chosen from the *current* (error-corrected) weights with the
  spec's scale rule, as ``quantize`` chooses it; with ``static_groups`` / ``act_order`` every k is
  chosen up front from the original weights. Column values ``v = RNE(w * 2**-k)`` on the element
  grid (saturating at the element limit), ``q = v * 2**k``.

The returned QuantizedTensor is built from the values each column had when it was quantized and the
fixed scales, with the same elementwise operations, so ``q.dequantize()`` is the loop's result bit for
bit. The lazy-batch block is ``options.block_size`` rounded up to whole 32-column groups for MX. GPTQ
options that concern NVFP4 only (``four_over_six``) do not apply here. With a diagonal H the result is
round to nearest with the same scales.
"""
from __future__ import annotations

import time

import torch

from ....formats.fp8 import FP8_DTYPES
from ....formats.minifloat import mul_pow2
from ....formats.ue8m0 import decode_ue8m0, encode_ue8m0
from ....quant import FP8, MX, QuantizedTensor, quantize
from ....quant.fp8 import encode_with_scale
from ....quant.mx import element_limit, encode_elements, stored_codes
from .algorithm import _hessian_factor
from .options import GPTQOptions

MX_GROUP = 32
FP8_GROUP = 16  # FP8 scales do not depend on the loop: the group is only the lazy-update granularity
TILE = 128


def _check(weight, H, spec, options):
    if not isinstance(spec, (FP8, MX)):
        raise TypeError(f"spec must be blockscale.FP8 or blockscale.MX, got {type(spec).__name__}")
    if spec.rounding != "nearest":
        raise ValueError(f"spec.rounding={spec.rounding!r}: GPTQ needs deterministic rounding='nearest'")
    if isinstance(spec, MX) and spec.dim not in (-1, 1):
        raise ValueError(f"spec.dim={spec.dim}: GPTQ quantizes MX blocks along the input features (dim -1)")
    if isinstance(spec, FP8) and spec.granularity == "token":
        raise ValueError("FP8 granularity 'token' is for activations; weights use 'tensor', 'channel' or 'block'")
    if not isinstance(options, GPTQOptions):
        raise TypeError(f"options must be a GPTQOptions, got {type(options).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError("weight must be a torch.Tensor of dtype float32, bfloat16 or float16")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if K == 0 or (isinstance(spec, MX) and K % MX_GROUP):
        raise ValueError(f"weight has in_features K={K}; MX GPTQ needs a positive multiple of {MX_GROUP}")
    if not isinstance(H, torch.Tensor) or not H.is_floating_point() or tuple(H.shape) != (K, K):
        raise ValueError(f"H must be a floating [K, K] = ({K}, {K}) tensor for weight of shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(H).all()):
        raise ValueError("H contains NaN/inf")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight contains NaN/inf")


# ----------------------------------------------------------------------------------------------
# the grids


def _fp8_scales(W: torch.Tensor, spec: FP8, shared) -> torch.Tensor:
    """FP32 scales in quant.fp8's layout ([] / [N, 1] / [ceil(N/128), ceil(K/128)]) for W [N, K]."""
    if spec.granularity == "tensor" and shared is not None:
        return shared.to(device=W.device, dtype=torch.float32).reshape(()).clone()
    return quantize(W, spec).scales.to(torch.float32)


def _fp8_columns(scales: torch.Tensor, spec: FP8, N: int, K: int) -> torch.Tensor:
    """The scales expanded to one per weight element [N, K]."""
    if scales.dim() == 0:
        return scales.expand(N, K)
    if spec.granularity == "channel":
        return scales.expand(N, K)
    return scales.repeat_interleave(TILE, 0)[:N].repeat_interleave(TILE, 1)[:, :K]


def _mx_exponents(Wm: torch.Tensor, spec: MX) -> torch.Tensor:
    """Unbiased UE8M0 exponents k (int32) [N, m/32] the library chooses for ``Wm`` [N, m]."""
    return quantize(Wm.contiguous(), MX(spec.element, spec.scale_rule)).scales.to(torch.int32) - 127


def _mx_values(x: torch.Tensor, k: torch.Tensor, spec: MX):
    """(codes, values) of x with the fixed exponents k (broadcasting): E2M1 codes (unpacked uint8)
    or float8 codes, and the FP32 values ``v * 2**k`` (quant.mx's elementwise operations)."""
    scaled = mul_pow2(x, -k)
    limit = element_limit(k, spec.element) if spec.scale_rule == "ceil" else None
    c, v = encode_elements(scaled, spec.element, "nearest", None, "hardware", limit)
    return c, v * decode_ue8m0(encode_ue8m0(k))


def _fp8_q(w, s, spec):
    return encode_with_scale(w, s, spec.element) * s


# ----------------------------------------------------------------------------------------------
# the loop


def _segment(Wg: torch.Tensor, U: torch.Tensor, qcol):
    """GPTQ over the columns of ``Wg`` [N, m] (in place); ``qcol(w, j)`` rounds column j.
    Returns (q, err, pre)."""
    m = Wg.shape[-1]
    q, err, pre = torch.empty_like(Wg), torch.empty_like(Wg), torch.empty_like(Wg)
    for j in range(m):
        w = Wg[:, j]
        pre[:, j] = w
        qj = qcol(w, j)
        ej = (w - qj) / U[j, j]
        q[:, j] = qj
        err[:, j] = ej
        if j + 1 < m:
            Wg[:, j + 1:] -= ej.unsqueeze(-1) * U[j, j + 1:]
    return q, err, pre


@torch.no_grad()
def gptq_fixed_grid(weight: torch.Tensor, H: torch.Tensor, spec, shared_scale=None,
                    options: GPTQOptions = GPTQOptions()) -> tuple[QuantizedTensor, dict]:
    """GPTQ-quantize ``weight`` [N, K] to FP8 or MX ``spec`` with the layer-input Hessian ``H`` [K, K].

    shared_scale: FP8 per-tensor only: the fused group's shared dequantization scale (0-d FP32;
    None: ``amax(W) / 448`` of this weight). Returns ``(q, stats)`` as ``gptq_quantize`` does
    (stats: "loss", "dead_columns", "seconds"); see the module docstring for the grids.
    """
    t0 = time.perf_counter()
    _check(weight, H, spec, options)
    N, K = weight.shape
    W = weight.detach().to(torch.float32).clone()
    static = options.static_groups or options.act_order
    U, perm, n_dead = _hessian_factor(H, W, float(options.damp), options.act_order)
    mx = isinstance(spec, MX)
    G = MX_GROUP if mx else FP8_GROUP
    dynamic = mx and not static
    dev = W.device

    if mx:
        k_all = _mx_exponents(W, spec) if static else torch.empty(N, K // G, dtype=torch.int32, device=dev)
        kcol = k_all.repeat_interleave(G, dim=1) if static else None
    else:
        scales = _fp8_scales(W, spec, shared_scale)
        scol = _fp8_columns(scales, spec, N, K)
    if perm is not None:
        W = W[:, perm]
        if mx:
            kcol = kcol[:, perm]
        else:
            scol = scol[:, perm]

    Q, E, P = torch.empty_like(W), torch.empty_like(W), torch.empty_like(W)
    B = -(-options.block_size // G) * G
    for i1 in range(0, K, B):
        i2 = min(i1 + B, K)
        W1 = W[:, i1:i2]
        U1 = U[i1:i2, i1:i2]
        for g1 in range(0, i2 - i1, G):
            g2 = min(g1 + G, i2 - i1)
            c1, c2 = i1 + g1, i1 + g2
            Wg = W1[:, g1:g2]
            Ug = U1[g1:g2, g1:g2]
            if dynamic:
                k = _mx_exponents(Wg, spec)  # [N, 1], from the current weights
                k_all[:, c1 // G] = k.squeeze(-1)
                qcol = lambda w, j, k=k[:, 0]: _mx_values(w, k, spec)[1]  # noqa: E731
            elif mx:
                qcol = lambda w, j, c1=c1: _mx_values(w, kcol[:, c1 + j], spec)[1]  # noqa: E731
            else:
                qcol = lambda w, j, c1=c1: _fp8_q(w, scol[:, c1 + j], spec)  # noqa: E731
            q, e, p = _segment(Wg, Ug, qcol)
            Q[:, c1:c2], E[:, c1:c2], P[:, c1:c2] = q, e, p
            if g2 < i2 - i1:
                W1[:, g2:] -= e @ U1[g1:g2, g2:]
        if i2 < K:
            W[:, i2:] -= E[:, i1:i2] @ U[i1:i2, i2:]

    if perm is not None:
        inv = torch.argsort(perm)
        E, P = E[:, inv], P[:, inv]
    if mx:
        c, _ = _mx_values(P.view(N, K // G, G), k_all.unsqueeze(-1), spec)
        codes = stored_codes(c.reshape(N, K), spec.element)
        q = QuantizedTensor(spec=spec, codes=codes, scales=encode_ue8m0(k_all), shape=weight.shape, dtype=weight.dtype)
    else:
        s_full = _fp8_columns(scales, spec, N, K)
        codes = encode_with_scale(P, s_full, spec.element).to(FP8_DTYPES[spec.element])
        q = QuantizedTensor(spec=spec, codes=codes, scales=scales, shape=weight.shape, dtype=weight.dtype)
    stats = {"loss": float(E.double().square().sum()), "dead_columns": n_dead, "seconds": time.perf_counter() - t0,
             "latent": P}  # the values rounded (their rounding is q's codes), as gptq_quantize's
    return q, stats


__all__ = ["gptq_fixed_grid"]
