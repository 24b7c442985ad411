"""Public API: specs, input checks, dtypes, shapes, empty tensors, QuantizedTensor."""
import dataclasses

import pytest
import torch

import blockscale as bs

pytestmark = pytest.mark.usefixtures("reference_backend")

SPECS = [bs.NVFP4(), bs.NVFP4(scale_rule="4over6", outer="row"), bs.NVFP4(block_2d=True), bs.MX(),
         bs.MX(element="e2m1"), bs.MX(element="e5m2", dim=0), bs.S2F6(), bs.S2F6(hadamard=False)]


def test_specs_are_frozen_dataclasses():
    for spec in SPECS:
        assert dataclasses.is_dataclass(spec)
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.rounding = "stochastic"
        assert hash(spec) == hash(dataclasses.replace(spec))


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale_rule="5"), "scale_rule='5'.*'6', '4over6', '4', 'sweep'"),
    (dict(error="l1"), "error='l1'.*'mse', 'mae', 'maxabs'"),
    (dict(outer="col"), "outer"),
    (dict(outer=-1.0), "outer"),
    (dict(outer=float("nan")), "outer"),
    (dict(rounding="up"), "rounding='up'.*'nearest', 'stochastic'"),
    (dict(sr_mode="fast"), "sr_mode='fast'.*'hardware', 'exact'"),
    (dict(block_2d=True, outer="row"), "block_2d"),
    (dict(block_2d="yes"), "block_2d"),
])
def test_nvfp4_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bs.NVFP4(**kwargs)


def test_mx_and_s2f6_bad_options():
    with pytest.raises(ValueError, match="element='e3m2'.*'e4m3', 'e5m2', 'e2m1'"):
        bs.MX(element="e3m2")
    with pytest.raises(ValueError, match="scale_rule='round'.*'ceil', 'floor'"):
        bs.MX(scale_rule="round")
    with pytest.raises(ValueError, match="dim"):
        bs.MX(dim=1.5)
    with pytest.raises(ValueError, match="dim=3 is out of range"):
        bs.quantize(torch.zeros(4, 4), bs.MX(dim=3))
    with pytest.raises(ValueError, match="seed"):
        bs.S2F6(seed="a")
    with pytest.raises(ValueError, match="hadamard"):
        bs.S2F6(hadamard=1)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_half_precision_inputs_equal_their_fp32_values(spec):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g)
    for dt in (torch.bfloat16, torch.float16):
        xl = x.to(dt)
        q = bs.quantize(xl, spec, generator=torch.Generator().manual_seed(1))
        q32 = bs.quantize(xl.float(), spec, generator=torch.Generator().manual_seed(1))
        assert q.dtype == dt and q32.dtype == torch.float32
        assert torch.equal(q.dequantize(), q32.dequantize())
        assert q.dequantize(dtype=None).dtype == dt
        assert bs.fake_quantize(xl, spec).dtype == dt


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_nan_inf_and_integer_inputs(spec):
    x = torch.randn(4, 32)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 3] = bad
        with pytest.raises(ValueError, match="NaN/inf"):
            bs.quantize(y, spec)
    for dt in (torch.int32, torch.int8, torch.uint8, torch.bool, torch.int64):
        with pytest.raises(TypeError, match="dtype"):
            bs.quantize(torch.zeros(4, 32, dtype=dt), spec)
    with pytest.raises(TypeError, match="torch.Tensor"):
        bs.quantize([1.0, 2.0], spec)


def test_bad_spec_type():
    with pytest.raises(TypeError, match="spec must be"):
        bs.quantize(torch.zeros(16), "nvfp4")


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape", [(0,), (0, 16), (5, 0), (3, 0, 7), (), (1,), (7,), (2, 3, 5, 33)])
def test_any_shape_including_empty_and_scalars(spec, shape):
    if getattr(spec, "block_2d", False) and len(shape) < 2:
        with pytest.raises(ValueError, match="block_2d"):
            bs.quantize(torch.zeros(shape), spec)
        return
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) if len(shape) else torch.tensor(1.7)
    q = bs.quantize(x, spec)
    xh = q.dequantize()
    assert xh.shape == x.shape and xh.dtype == torch.float32
    if x.numel():
        rel = ((xh - x).norm() / x.norm()).item()
        assert rel < 0.2


def test_padding_is_removed_and_does_not_change_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 50, generator=g)
    for spec in (bs.MX(), bs.S2F6(), bs.NVFP4(scale_rule="4over6")):
        block = spec.block_size
        padded = torch.nn.functional.pad(x, (0, (-50) % block))
        assert torch.equal(bs.fake_quantize(x, spec), bs.fake_quantize(padded, spec)[:, :50])


def test_quantized_tensor_fields_and_storage():
    x = torch.randn(256, 64)
    q = bs.quantize(x, bs.NVFP4())
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (256, 32)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (256, 4)
    assert q.outer_scale.dtype == torch.float32 and q.outer_scale.shape == ()
    assert q.bits_per_value == pytest.approx(4.5, abs=0.01)
    assert "NVFP4" in repr(q)
    sw = q.scales_swizzled()
    assert torch.equal(bs.unswizzle_scales(sw, 256, 4).view(torch.uint8), q.scales.view(torch.uint8))
    assert bs.quantize(x, bs.MX()).bits_per_value == pytest.approx(8.25)
    assert bs.quantize(x, bs.MX(element="e2m1")).bits_per_value == pytest.approx(4.25)
    assert q.to("cpu").dequantize().equal(q.dequantize())


def test_fake_quantize_equals_quantize_dequantize():
    x = torch.randn(32, 64)
    for spec in SPECS:
        g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
        assert torch.equal(bs.fake_quantize(x, spec, g1), bs.quantize(x, spec, g2).dequantize())


def test_stochastic_rounding_is_deterministic_per_generator():
    x = torch.randn(64, 64)
    for spec in (bs.NVFP4(rounding="stochastic"), bs.MX(rounding="stochastic", sr_mode="exact"),
                 bs.S2F6(rounding="stochastic")):
        a = bs.fake_quantize(x, spec, torch.Generator().manual_seed(1))
        b = bs.fake_quantize(x, spec, torch.Generator().manual_seed(1))
        c = bs.fake_quantize(x, spec, torch.Generator().manual_seed(2))
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_backend_selection():
    with pytest.raises(ValueError, match="backend='gpu'.*'auto', 'reference', 'compiled'"):
        bs.set_backend("gpu")
    with bs.use_backend("compiled"):
        assert bs.get_backend() == "compiled"
    assert bs.get_backend() == "reference"


def test_no_input_mutation():
    x = torch.randn(8, 32)
    x0 = x.clone()
    for spec in SPECS:
        bs.quantize(x, spec)
    assert torch.equal(x, x0)
