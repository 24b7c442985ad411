"""QuantizedTensor.rows: a row slice of a 2-D quantized weight dequantizes to the same rows, bit for bit, for
every registered format (the export of fused gate/up experts writes gate and up rows as separate Linears)."""
from __future__ import annotations

import pytest
import torch

import blockscale as bs
from blockscale.quant import MX, NVFP4, QuantizedTensor
from blockscale.quant.fp8 import FP8
from blockscale.quant.registry import formats
from blockscale.quant.s2f6 import S2F6

SPECS = [NVFP4(), NVFP4(outer="row"), MX(element="e4m3"), MX(element="e2m1"), S2F6(hadamard=False),
         FP8(granularity="tensor"), FP8(granularity="channel"), FP8(granularity="block"),
         FP8(granularity="block", block_shape=(1, 128))]


def test_every_format_is_covered():
    assert {type(s) for s in SPECS} == {f.spec_type for f in formats()}


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("N,cut", [(256, (0, 128)), (256, (128, 256)), (300, (256, 300)), (320, (0, 320))])
def test_rows_dequantize_like_the_slice(spec, N, cut):
    g = torch.Generator().manual_seed(N + cut[0])
    w = torch.randn(N, 96, generator=g) * torch.logspace(-2, 2, N).unsqueeze(1)
    q = bs.quantize(w, spec)
    part = q.rows(*cut)
    assert isinstance(part, QuantizedTensor) and tuple(part.shape) == (cut[1] - cut[0], 96)
    assert torch.equal(part.dequantize(), q.dequantize()[cut[0]:cut[1]])
    assert part.codes.data_ptr() == q.codes[cut[0]].data_ptr()  # a view, not a copy


@pytest.mark.parametrize("spec", [s for s in SPECS if not (isinstance(s, FP8) and s.granularity == "block"
                                                           and s.block_shape == (128, 128))], ids=str)
def test_per_row_formats_slice_anywhere(spec):
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    q = bs.quantize(w, spec)
    for a, b in ((0, 1), (3, 17), (39, 40)):
        assert torch.equal(q.rows(a, b).dequantize(), q.dequantize()[a:b])


def test_fp8_tiles_refuse_a_cut_inside_a_tile():
    q = bs.quantize(torch.randn(300, 128), FP8(granularity="block"))
    for a, b in ((0, 100), (64, 256), (128, 200)):
        with pytest.raises(ValueError, match="multiples of 128"):
            q.rows(a, b)


@pytest.mark.parametrize("bad", [(5, 5), (-1, 3), (0, 41), (3, 2)])
def test_bad_ranges_are_refused(bad):
    q = bs.quantize(torch.randn(40, 64), NVFP4())
    with pytest.raises(ValueError, match="expected 0 <= start < stop <= 40"):
        q.rows(*bad)


def test_tensors_blocked_along_rows_are_refused():
    q = bs.quantize(torch.randn(64, 32), MX(element="e4m3", dim=0))
    with pytest.raises(ValueError, match="blocked along its last dim"):
        q.rows(0, 32)
    with pytest.raises(ValueError, match="2-D"):
        bs.quantize(torch.randn(2, 4, 32), NVFP4()).rows(0, 1)
