"""The public NVFP4 primitives (``blockscale.quant.nvfp4``) reproduce ``quantize`` bit for bit.

They are what GPTQ, AWQ, LSQ and export call instead of private copies, so each is checked against
the quantizer's own outputs on the same input.
"""
from __future__ import annotations

import pytest
import torch

import blockscale as bs
from blockscale.formats.e2m1 import pack_nibbles
from blockscale.quant import nvfp4 as nv


def _x(n=32, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)
    x[1, :16] = 0.0
    return x


@pytest.mark.parametrize("rule", ["6", "4", "4over6"])
@pytest.mark.parametrize("block_2d", [False, True])
def test_block_scales_and_encode_match_quantize(rule, block_2d):
    x = _x()
    spec = bs.NVFP4(scale_rule=rule, block_2d=block_2d)
    S = nv.shared_outer_scale([x], spec.outer_bound)
    q = bs.quantize(x, spec, encode_scale=S)
    xb = x.reshape(32, 4, 16)
    inv_s = 1.0 / S
    amax = nv.block_amax(xb, block_2d)
    if rule == "4over6":
        s = nv.choose_4over6(xb, nv.block_scales(amax, S, 6), nv.block_scales(amax, S, 4), inv_s, block_2d=block_2d)
    else:
        s = nv.block_scales(amax, S, int(rule))
    assert torch.equal(s.squeeze(-1), q.scales.float())
    codes = nv.encode_blocks(xb, s, inv_s)
    assert torch.equal(pack_nibbles(codes.reshape(32, 64)), q.codes)
    assert torch.equal(nv.reconstruct_blocks(xb, s, inv_s).reshape(32, 64), q.dequantize())
    assert torch.equal(nv.e2m1_codes(*nv.rounded_magnitudes(xb, s, inv_s)), codes)
    assert torch.equal(q.amax, nv.amax_of_outer_scale(S, spec.outer_bound))


@pytest.mark.parametrize("block_2d", [False, True])
def test_sweep_block_scales_match_quantize(block_2d):
    x = _x(20, 32, seed=1)
    S = torch.tensor(3.0)
    q = bs.quantize(x, bs.NVFP4(scale_rule="sweep", block_2d=block_2d), encode_scale=S)
    assert torch.equal(nv.sweep_block_scales(x, S, block_2d), q.scales.float())


def test_outer_scales():
    a, b = _x(8, 32), 3.0 * _x(4, 32, seed=2)
    S = nv.shared_outer_scale([a, b, torch.empty(0, 32)], 256.0)
    assert S.shape == () and torch.equal(S, nv.outer_scale(torch.maximum(a.abs().max(), b.abs().max()), 256.0))
    assert torch.equal(nv.outer_scale(torch.tensor([0.0])), torch.tensor([1.0]))
    w = torch.stack([a, 2 * a, torch.zeros_like(a)])
    q = bs.quantize(w, bs.NVFP4(outer="group"))
    assert torch.equal(q.amax.reshape(-1), nv.group_amax(w))
    assert torch.equal(q.outer_scale.reshape(-1), nv.outer_scale(nv.group_amax(w)))


def test_input_encode_scale_and_validation():
    S = nv.input_encode_scale(3.7, "4over6")
    assert S.shape == (1,) and torch.equal(nv.reciprocal_fixed_point(S), S)
    assert torch.equal(S, nv.reciprocal_fixed_point(nv.outer_scale(torch.tensor([3.7]), 256.0)))
    with pytest.raises(ValueError, match="scale_rule='sweep'"):
        nv.input_encode_scale(1.0, "sweep")
    assert nv.encode_scale_tensor(2).dtype == torch.float32
    for bad in (0.0, 2.0**-130, float("inf")):
        with pytest.raises(ValueError, match="encode_scale"):
            nv.encode_scale_tensor(bad)
    with pytest.raises(TypeError, match="encode_scale"):
        nv.encode_scale_tensor("1.0")
