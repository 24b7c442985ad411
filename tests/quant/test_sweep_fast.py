"""The fast exact NVFP4 sweep (``quant.nvfp4.sweep_fast``, issue 18 item 5): its E2M1 rounding, its errors
and its choice are bit for bit the reference's (``round_magnitude``, ``weighted_block_error`` /
``candidate_error``, the ``quantize`` loop over 126 candidates), on tensors built to hit every edge: block
amaxes over many decades, zero / tiny (subnormal-scale) / constant blocks, ties, outliers, bf16 inputs, a
fused group's shared S, channel weights with zeros; 16x16 tiles keep the reference path."""
from __future__ import annotations

import pytest
import torch

from blockscale.formats.minifloat import E2M1, round_magnitude
from blockscale.quant import NVFP4, quantize
from blockscale.quant.nvfp4 import (block_amax, block_scales, candidate_error, e4m3_positive_values,
                                    shared_outer_scale, sweep_block_scales)
from blockscale.quant.nvfp4.scales import encode_scale_tensor
from blockscale.quant.nvfp4.sweep_fast import candidate_errors, e2m1_round_, fast_sweep_scales
from blockscale.quant.nvfp4.weighted import quantize_weighted, weighted_block_error, weighted_block_scales

pytestmark = pytest.mark.usefixtures("one_thread")


def _edge_weights(seed: int, n: int = 64, k: int = 128, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, k, generator=g) * torch.logspace(-9, 5, n).unsqueeze(1)[torch.randperm(n, generator=g)]
    W[0, :16] = 0  # zero block
    W[1, :16] = 0.01  # constant block: many candidates tie
    W[2, 16:32] = torch.tensor([1.0, -1.0] * 8) * 0.02  # +-a
    W[3] = torch.randint(-6, 7, (k,), generator=g).float() * 0.004  # on an E2M1-like grid: exact fits, ties
    W[4, 32:48] = 1e-7  # tiny block next to large ones: subnormal block scales
    W[5, 0] = 3e5  # an outlier
    W[6] = torch.tensor([0.5, -0.5, 0.25, 1.0] * (k // 4))  # powers of two: exact candidates tie
    W[7, :16] = torch.tensor([6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2) * 1e-3  # the E2M1 grid itself
    W[8, 48:64] = torch.tensor([5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, 0.0] * 2) * 1e-3  # rounding ties
    return W.to(dtype)


def test_e2m1_rounding_is_round_magnitude_bit_for_bit():
    """Every FP32 within 64 ulps of each rounding boundary and grid point in [0, 6] (ties, binade edges),
    subnormals, and a dense random sample."""
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    bits = pts.view(torch.int32).unsqueeze(1) + torch.arange(-64, 65, dtype=torch.int32)
    near = bits.clamp(min=0).view(torch.float32).reshape(-1)
    sub = torch.arange(0, 4096, dtype=torch.int32).view(torch.float32)  # 0 and subnormals
    rnd = torch.rand(1 << 18, generator=torch.Generator().manual_seed(0)) * 6
    y = torch.cat([near[(near >= 0) & (near <= 6)], sub, rnd])
    ref = round_magnitude(y, E2M1)
    assert torch.equal(e2m1_round_(y.clone()).view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("weighted", [False, True])
def test_candidate_errors_are_the_reference_errors(weighted):
    """All 126 candidates (and per-block scales) on edge blocks: the same FP32 bits as ``candidate_error``
    (unweighted) / ``weighted_block_error``."""
    W = _edge_weights(0, n=24, k=64)
    S = encode_scale_tensor(shared_outer_scale([W]))
    inv_s = 1.0 / S.reshape(1, 1, 1)
    xb = W.reshape(24, 4, 16)
    g = torch.Generator().manual_seed(1)
    d = torch.rand(64, generator=g) * (torch.rand(64, generator=g) > 0.3) * 5
    wb = d.reshape(4, 16)
    cand = e4m3_positive_values()
    s_all = cand.view(-1, 1, 1, 1).expand(126, 24, 4, 1)
    ax = xb.reshape(-1, 16).abs().T.contiguous()
    w = wb.unsqueeze(0).expand(24, 4, 16).reshape(-1, 16).T.contiguous() if weighted else None
    got = candidate_errors(ax, w, cand.view(-1, 1), inv_s.reshape(()))
    if weighted:
        ref = weighted_block_error(xb, s_all, inv_s, wb)
    else:
        ref = candidate_error(xb, s_all, inv_s, None, "nearest", "hardware", "mse")
    assert torch.equal(got.view(torch.int32), ref.reshape(126, -1).view(torch.int32))
    s6 = block_scales(block_amax(xb), S.reshape(1, 1, 1), 6)  # per-block scales [1, B]
    got6 = candidate_errors(ax, w, s6.reshape(1, -1), inv_s.reshape(()))
    ref6 = weighted_block_error(xb, s6, inv_s, wb) if weighted else candidate_error(xb, s6, inv_s)
    assert torch.equal(got6.view(torch.int32), ref6.reshape(1, -1).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fast_sweep_equals_the_reference_loop(seed, dtype):
    """Codes and scales of the PTQ route (``rtn_quantize``), ``quantize_weighted(.., ones)`` and
    ``sweep_block_scales`` against ``quantize``'s reference loop, with the tensor's own S and a fused group's
    shared S (larger and smaller amax partners)."""
    from blockscale.ptq.scheme_quantize import rtn_quantize

    W = _edge_weights(seed, dtype=dtype)
    spec = NVFP4(scale_rule="sweep")
    for S in (shared_outer_scale([W]), shared_outer_scale([W, 40 * W[:3]]), shared_outer_scale([W[9:]])):
        ref = quantize(W, spec, encode_scale=S)
        for got in (rtn_quantize(W, spec, S), quantize_weighted(W, "hessian", S, torch.ones(W.shape[1]))):
            assert torch.equal(got.codes, ref.codes)
            assert torch.equal(got.scales.view(torch.uint8), ref.scales.view(torch.uint8))
            assert got.spec == ref.spec and torch.equal(got.amax, ref.amax) and got.dtype == ref.dtype
        assert torch.equal(sweep_block_scales(W.float(), S), ref.scales.float())


def _reference_weighted_choice(W, S, d):
    """The sweep loop with the d-weighted error: start at scale-to-6, replace only on a strictly lower error,
    candidates in increasing order (vectorised over blocks, one candidate at a time)."""
    N, K = W.shape
    xb = W.float().reshape(N, K // 16, 16)
    S3 = encode_scale_tensor(S).reshape(1, 1, 1)
    inv_s = 1.0 / S3
    wb = d.reshape(K // 16, 16)
    best_s = block_scales(block_amax(xb), S3, 6)
    best = weighted_block_error(xb, best_s, inv_s, wb)
    for c in e4m3_positive_values():
        s = c.expand_as(best_s)
        err = weighted_block_error(xb, s, inv_s, wb)
        better = err < best
        best_s, best = torch.where(better.unsqueeze(-1), s, best_s), torch.where(better, err, best)
    return best_s.squeeze(-1)


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_weighted_sweep_equals_the_reference_loop(seed):
    """Rule "hessian" with channel weights (zeros included, so many errors tie at 0): the reference loop's
    choice, and the weights change it."""
    W = _edge_weights(seed, n=48, k=96)
    g = torch.Generator().manual_seed(seed + 10)
    d = torch.rand(96, generator=g) * 4 * (torch.rand(96, generator=g) > 0.25)
    d[:16] = 0  # a block whose every error is 0: scale-to-6 stays
    S = shared_outer_scale([W])
    got = weighted_block_scales(W, S, d, "hessian")
    assert torch.equal(got, _reference_weighted_choice(W, S, d))
    assert not torch.equal(got, weighted_block_scales(W, S, torch.ones(96), "hessian"))


def test_fast_sweep_chunking_does_not_change_the_choice(monkeypatch):
    """Tiny chunks (one block per window chunk) give the same scales as the default chunking."""
    import blockscale.quant.nvfp4.sweep_fast as sf

    W = _edge_weights(5, n=32, k=64)
    xf = W.reshape(-1, 16)
    S = encode_scale_tensor(shared_outer_scale([W]))
    ref = quantize(W, NVFP4(scale_rule="sweep"), encode_scale=S).scales.float().reshape(-1)
    assert torch.equal(fast_sweep_scales(xf, S), ref)
    monkeypatch.setattr(sf, "FAST_CHUNK", 1)
    assert torch.equal(fast_sweep_scales(xf, S), ref)


def test_block_2d_keeps_the_reference_path():
    """16x16 tiles are not on the fast path: ``sweep_block_scales(.., block_2d=True)`` is still
    ``quantize``'s choice, and rtn_quantize of a block_2d sweep spec goes to ``quantize``."""
    from blockscale.ptq.scheme_quantize import rtn_quantize

    W = _edge_weights(2, n=32, k=64)
    spec = NVFP4(scale_rule="sweep", block_2d=True)
    S = shared_outer_scale([W])
    ref = quantize(W, spec, encode_scale=S)
    assert torch.equal(sweep_block_scales(W, S, True), ref.scales.float())
    got = rtn_quantize(W, spec, S)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales.view(torch.uint8), ref.scales.view(torch.uint8))


def _heavy_tailed_blocks(seed: int, n: int, weighted: bool):
    """[n*n/16, 16] heavy-tailed random blocks, their encode scale S and random weights (or None)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, n, generator=g) * torch.exp(torch.randn(n, n, generator=g))
    xf = W.reshape(-1, 16)
    wf = torch.rand(xf.shape, generator=g) * 3 if weighted else None
    return xf, encode_scale_tensor(shared_outer_scale([W])), wf


def _all_candidate_choice(xf, S, wf, clip: bool = True):
    """The plain selection over the reference errors of all 126 candidates (those below each block's scale-to-6
    left out unless ``clip``): the lowest candidate of least error where it is strictly below scale-to-6's,
    else scale-to-6. Returns (choice, scale-to-6)."""
    inv_s = (1.0 / S).reshape(())
    cand = e4m3_positive_values()
    ax = xf.abs().T.contiguous()
    w = None if wf is None else wf.T.contiguous()
    err = torch.cat([candidate_errors(ax[:, i:i + 1024], None if w is None else w[:, i:i + 1024], cand.view(-1, 1),
                                      inv_s) for i in range(0, ax.shape[1], 1024)], dim=1)
    s6 = block_scales(block_amax(xf.view(-1, 1, 16)), S.reshape(1, 1, 1), 6).reshape(-1)
    err6 = candidate_errors(ax, w, s6.view(1, -1), inv_s)[0]
    if not clip:
        err[cand.view(-1, 1) < s6.view(1, -1)] = float("inf")
    best = err.amin(dim=0)
    first = torch.where(err == best, torch.arange(126).view(126, 1), 126).amin(dim=0)
    return torch.where(best < err6, cand[first], s6), s6


@pytest.mark.parametrize("weighted", [False, True])
def test_pruning_keeps_the_all_candidate_choice_on_many_blocks(weighted):
    """16K heavy-tailed random blocks: the pruned, sorted, chunked choice equals the plain selection over the
    errors of all 126 candidates (the errors are the reference's, see above)."""
    xf, S, wf = _heavy_tailed_blocks(7, 512, weighted)
    ref, s6 = _all_candidate_choice(xf, S, wf)
    got = fast_sweep_scales(xf, S, wf)
    assert (ref != s6).float().mean() > 0.3  # many blocks move off scale-to-6: the test has teeth
    assert torch.equal(got, ref)


def test_overflowing_errors_keep_the_reference_choice():
    """Weights near the FP32 limit: squared errors overflow to inf (inf - inf in the pruning keys is NaN);
    the choice is still the reference loop's."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(8, 64, generator=g) * 1e18
    W[0, :16] = 3e38
    W[1, :16] = torch.tensor([3e38, 1.0] * 8)
    W[2, :16] = 1e-30
    spec = NVFP4(scale_rule="sweep")
    S = shared_outer_scale([W])
    ref = quantize(W, spec, encode_scale=S)
    got = quantize_weighted(W, "hessian", S, torch.ones(64))
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales.view(torch.uint8), ref.scales.view(torch.uint8))


@pytest.mark.parametrize("weighted", [False, True])
def test_no_clip_sweep_is_the_selection_over_candidates_from_scale_to_6(weighted):
    """``clip=False`` (candidates >= each block's scale-to-6 only; experiments/sweep_clip_diagnosis.py): the
    plain selection over all 126 candidates' reference errors with those below scale-to-6 left out, ties as
    the sweep; never below scale-to-6; the same as ``clip=True`` on blocks where that chose no clipping scale."""
    xf, S, wf = _heavy_tailed_blocks(11, 256, weighted)
    ref, s6 = _all_candidate_choice(xf, S, wf, clip=False)
    got = fast_sweep_scales(xf, S, wf, clip=False)
    full = fast_sweep_scales(xf, S, wf)
    assert (full < s6).float().mean() > 0.1 and (got > s6).float().mean() > 0.1  # both kinds of move occur
    assert torch.equal(got, ref) and bool((got >= s6).all())
    assert torch.equal(got[full >= s6], full[full >= s6])
