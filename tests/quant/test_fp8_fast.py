"""FP8's compiled fast path (torch.compile of the same kernels) is bit-identical to the eager
reference: codes, scales, fused values and dequantize, over shapes, input dtypes, granularities
and roundings (each new combination is one compilation: the grid is chosen to stay small)."""
import pytest
import torch

import blockscale as bs
from blockscale.quant.dispatch import quantize_with_values
from blockscale.quant.fp8 import FP8

pytestmark = pytest.mark.usefixtures("one_thread")
GROUP = FP8("e4m3", "block", (1, 128))

SPECS = [
    FP8("e4m3", "tensor"),
    FP8("e5m2", "channel", rounding="stochastic"),
    FP8("e4m3", "block"),
    FP8("e5m2", "block", rounding="stochastic", sr_mode="exact"),
    FP8("e4m3", "block", (1, 128)),
]


def _hard(shape, seed=0, binades=50):
    """Magnitudes over ``binades`` binades along the last dim, zero / tiny / huge rows, a -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-binades * 0.15, binades * 0.15, shape[-1])
    x2 = x.reshape(-1, shape[-1])
    x2[0, : shape[-1] // 3] = 0.0
    x2[min(1, len(x2) - 1)] *= 1e-3
    x2[-1, 0] = -0.0
    return x


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def _run(x, spec, backend):
    with bs.use_backend(backend):
        q, v = quantize_with_values(x, spec, torch.Generator().manual_seed(11))
        return q.codes, q.scales, v, q.dequantize()


def _assert_same(a, b):
    for ta, tb in zip(a, b):
        assert ta.shape == tb.shape and ta.dtype == tb.dtype and torch.equal(_bits(ta), _bits(tb))
    assert torch.equal(a[2], a[3])  # the fused values are the dequantized codes


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_compiled_equals_reference(spec):
    x = _hard((260, 300))
    x[-1, -1] = 3.0e38
    _assert_same(_run(x, spec, "reference"), _run(x, spec, "compiled"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_compiled_equals_reference_half_inputs(dtype):
    x = _hard((260, 300), seed=1, binades=20).to(dtype)
    _assert_same(_run(x, GROUP, "reference"), _run(x, GROUP, "compiled"))


@pytest.mark.parametrize("shape, spec", [((1,), FP8("e5m2", "block")), ((7, 129), FP8("e4m3", "block")),
                                         ((3, 2, 130), GROUP), ((2, 131, 5), FP8("e4m3", "block"))], ids=str)
def test_compiled_equals_reference_on_shapes(shape, spec):
    x = _hard(shape, seed=len(shape)) if len(shape) > 1 else torch.tensor([-3.0])
    _assert_same(_run(x, spec, "reference"), _run(x, spec, "compiled"))


def test_compiled_codes_only_and_values_only_paths():
    x = _hard((64, 256), seed=3)
    with bs.use_backend("reference"):
        q, v = bs.quantize(x, GROUP), bs.fake_quantize(x, GROUP)
    with bs.use_backend("compiled"):
        qc, vc = bs.quantize(x, GROUP), bs.fake_quantize(x, GROUP)
    assert torch.equal(_bits(q.codes), _bits(qc.codes)) and torch.equal(q.scales, qc.scales) and torch.equal(v, vc)
