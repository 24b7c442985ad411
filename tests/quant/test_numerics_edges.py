"""Numerics edge cases: API misuse ends in one typed error, and nothing finite becomes inf/NaN.

* float64 inputs beyond the FP32 range are a ValueError (not NaN scales / inf values).
* encode_scale, S2F6 seeds, empty outer="group" tensors, meta tensors, non-QuantizedTensor and
  non-float dtype arguments, and QuantizedTensors whose codes / scales do not fit their shape.

MX "ceil" near FLT_MAX: tests/quant/test_mx_near_flt_max.py.
"""
import re
from dataclasses import replace

import pytest
import torch

import blockscale as bs
from blockscale.quant.dispatch import quantize_with_values
from blockscale.quant.layout import check_layout, expected_layout
from blockscale.quant.transforms.wire import emulate, encode_rows

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

FLT_MAX = torch.finfo(torch.float32).max


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.float().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# float64 beyond the FP32 range

SPECS = [bs.NVFP4(), bs.NVFP4(outer="row"), bs.NVFP4(scale_rule="4over6", block_2d=True), bs.MX(),
         bs.MX(element="e2m1", scale_rule="floor", dim=0), bs.S2F6(), bs.S2F6(hadamard=False)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_float64_beyond_fp32_range_is_an_error(spec):
    x = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[2, 7] = -1e39
    match = r"max \|x\| = 1e\+39.*FP32 range \(\|x\| <= 3\.40282e\+38\)"
    for fn in (bs.quantize, bs.fake_quantize, quantize_with_values):
        with pytest.raises(ValueError, match=match):
            fn(x, spec)
    x[2, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf"):
        bs.quantize(x, spec)


def test_float64_up_to_flt_max_is_accepted():
    x = torch.zeros(2, 32, dtype=torch.float64)
    x[0, 0], x[1, 1] = FLT_MAX, -FLT_MAX  # exactly FP32 values
    for spec in (bs.NVFP4(), bs.MX(), bs.S2F6(hadamard=False)):
        y = bs.fake_quantize(x, spec)
        assert y.dtype == torch.float64 and torch.isfinite(y).all()
    with pytest.raises(ValueError, match=r"max \|x\| = 3\.40282e\+38"):
        bs.quantize(torch.tensor([FLT_MAX * (1 + 2**-30)], dtype=torch.float64), bs.MX())


@pytest.mark.parametrize("payload", ["nvfp4", "mxfp8", "s2f6"])
def test_wire_float64_beyond_fp32_range_is_an_error(payload):
    x = torch.zeros(2, 32, dtype=torch.float64)
    x[1, 3] = 2e40
    for fn in (encode_rows, emulate):
        with pytest.raises(ValueError, match=r"max \|x\| = 2e\+40.*FP32 range"):
            fn(x, payload)


# ---------------------------------------------------------------------------------------------
# encode_scale

def _same_q(a, b):
    assert torch.equal(a.codes, b.codes) and torch.equal(_bits(a.scales), _bits(b.scales))
    assert torch.equal(_bits(a.outer_scale), _bits(b.outer_scale)) and torch.equal(_bits(a.amax), _bits(b.amax))


@pytest.mark.parametrize("value", [2.5, 0.1, 3, 1e-30, 3.0e38])
def test_encode_scale_python_number_equals_fp32_tensor(value):
    x = torch.randn(8, 48, generator=torch.Generator().manual_seed(1))
    t = torch.tensor(float(value), dtype=torch.float32)
    with bs.use_backend("reference"):
        _same_q(bs.quantize(x, bs.NVFP4(), encode_scale=value), bs.quantize(x, bs.NVFP4(), encode_scale=t))
        a = bs.fake_quantize(x, bs.NVFP4(scale_rule="4over6"), encode_scale=value)
        b = bs.fake_quantize(x, bs.NVFP4(scale_rule="4over6"), encode_scale=t.reshape(1))  # shape [1] works too
    assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("bad, err, match", [
    (torch.tensor([1.0, 2.0]), ValueError, r"encode_scale has shape \(2,\).*one FP32 scalar"),
    (torch.ones(2, 3), ValueError, r"encode_scale has shape \(2, 3\)"),
    (torch.empty(0), ValueError, r"encode_scale has shape \(0,\)"),
    (True, TypeError, "encode_scale=True"),
    ("2.0", TypeError, "encode_scale='2.0'"),
    ([2.0], TypeError, r"encode_scale=\[2\.0\]"),
    (float("inf"), ValueError, "encode_scale=inf: must be a positive, normal, finite FP32 scalar"),
    (1e39, ValueError, "encode_scale=inf"),  # overflows FP32
    (-1.0, ValueError, "encode_scale=-1.0"),
    (0.0, ValueError, "encode_scale=0.0"),
    (1e-45, ValueError, "encode_scale=1.401298464324817e-45: must be a positive, normal"),  # 1/S = inf
    (torch.tensor(1e-40), ValueError, "normal"),
])
def test_encode_scale_bad_values(bad, err, match):
    x = torch.randn(4, 32)
    with pytest.raises(err, match=match):
        bs.quantize(x, bs.NVFP4(), encode_scale=bad)


def test_encode_scale_smallest_normal_gives_finite_values():
    x = torch.randn(4, 32)
    y = bs.fake_quantize(x * 1e36, bs.NVFP4(), encode_scale=2.0**-126)  # 1/S = 2**126
    assert torch.isfinite(y).all() and (y != 0).any()


# ---------------------------------------------------------------------------------------------
# S2F6 seeds

@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_s2f6_seed_out_of_range_fails_at_construction(seed):
    with pytest.raises(ValueError, match=rf"seed={seed}: expected an int in \[-2\*\*63, 2\*\*64 - 1\]"):
        bs.S2F6(seed=seed)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_s2f6_seed_at_the_range_ends_works(seed):
    x = torch.randn(3, 64)
    q = bs.quantize(x, bs.S2F6(seed=seed))
    assert torch.isfinite(q.dequantize()).all()


# ---------------------------------------------------------------------------------------------
# empty tensors with outer="group"

@pytest.mark.parametrize("shape", [(0, 16), (3, 0), (0,), (0, 5, 16), (2, 0, 16), (0, 0)])
@pytest.mark.parametrize("block_2d", [False, True])
def test_group_outer_on_empty_tensors(shape, block_2d):
    spec = bs.NVFP4(outer="group", block_2d=block_2d)
    x = torch.empty(shape)
    if block_2d and len(shape) < 3:
        match = "block_2d=True (with outer='group' )?needs a tensor with at least [23] dims"
        with pytest.raises(ValueError, match=match):
            bs.quantize(x, spec)
        return
    q = bs.quantize(x, spec)
    G = shape[0] if len(shape) >= 2 else 1
    want_outer = (G,) + (1,) * (len(shape) - 1) if len(shape) >= 2 else ()
    assert q.outer_scale.shape == want_outer and q.amax.shape == want_outer
    assert (q.outer_scale == 1).all()  # zero amax -> S = 1
    assert q.dequantize().shape == shape and bs.fake_quantize(x, spec).shape == shape


# ---------------------------------------------------------------------------------------------
# meta tensors, argument types and dtypes

@pytest.mark.parametrize("spec", [bs.NVFP4(), bs.MX(), bs.S2F6()], ids=str)
def test_meta_tensors_are_a_clear_error(spec):
    x = torch.empty(4, 32, device="meta")
    for fn in (bs.quantize, bs.fake_quantize):
        with pytest.raises(ValueError, match="x is a meta tensor: meta tensors have no values"):
            fn(x, spec)
    # dequantizing a meta QuantizedTensor still propagates shapes (no values are read), as before
    qm = bs.quantize(torch.randn(4, 32), spec).to("meta")
    out = qm.dequantize(torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (4, 32) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="q.codes has shape"):
        replace(qm, codes=qm.codes[:, :3]).dequantize()  # its layout is still checked


def test_meta_encode_scale_is_a_clear_error():
    with pytest.raises(ValueError, match="encode_scale is a meta tensor: meta tensors have no values"):
        bs.quantize(torch.randn(4, 32), bs.NVFP4(), encode_scale=torch.tensor(1.0, device="meta"))


@pytest.mark.parametrize("bad", ["x", None, torch.zeros(4), 3.0])
def test_dequantize_needs_a_quantized_tensor(bad):
    with pytest.raises(TypeError, match="q must be a blockscale.QuantizedTensor, got"):
        bs.dequantize(bad)


FLOATS = "torch.float32, torch.bfloat16, torch.float16, torch.float64"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn,
                                   torch.complex64, "float32", float])
def test_output_dtype_must_be_floating(dtype):
    x = torch.randn(4, 32)
    q = bs.quantize(x, bs.NVFP4())
    match = f"dtype={dtype!r}".replace("(", r"\(").replace(")", r"\)") + f".*allowed: {FLOATS}"
    with pytest.raises(TypeError, match=match):
        bs.fake_quantize(x, bs.NVFP4(), dtype=dtype)
    with pytest.raises(TypeError, match=match):
        q.dequantize(dtype)
    with pytest.raises(TypeError, match=match):
        bs.dequantize(q, dtype)


def test_output_dtypes_that_work():
    x = torch.randn(4, 32)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert bs.fake_quantize(x, bs.MX(), dtype=dt).dtype == dt
        assert bs.quantize(x, bs.MX()).dequantize(dt).dtype == dt


# ---------------------------------------------------------------------------------------------
# QuantizedTensor layout: codes / scales that do not fit the shape and spec

LAYOUT_CASES = [  # (spec, shape, codes shape, codes dtype, scales shape, scales dtype)
    (bs.NVFP4(), (4, 40), (4, 24), torch.uint8, (4, 3), torch.float8_e4m3fn),
    (bs.NVFP4(block_2d=True), (2, 20, 16), (2, 20, 8), torch.uint8, (2, 20, 1), torch.float8_e4m3fn),
    (bs.NVFP4(outer="row"), (), (8,), torch.uint8, (1,), torch.float8_e4m3fn),
    (bs.MX(), (3, 50), (3, 64), torch.float8_e4m3fn, (3, 2), torch.uint8),
    (bs.MX(element="e2m1"), (3, 50), (3, 32), torch.uint8, (3, 2), torch.uint8),
    (bs.MX(element="e5m2", dim=0), (40, 3, 2), (3, 2, 64), torch.float8_e5m2, (3, 2, 2), torch.uint8),
    (bs.S2F6(), (5, 33), (5, 64), torch.int8, (5, 2), torch.uint8),
    (bs.S2F6(hadamard=False), (7,), (32,), torch.int8, (1,), torch.uint8),
]


@pytest.mark.parametrize("spec, shape, cs, cd, ss, sd", LAYOUT_CASES, ids=lambda v: str(v))
def test_expected_layout_is_what_quantize_stores(spec, shape, cs, cd, ss, sd):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) if shape else torch.tensor(0.3)
    q = bs.quantize(x, spec)
    lay = expected_layout(spec, torch.Size(shape))
    assert (lay["codes"], lay["scales"]) == ((cs, cd), (ss, sd))
    assert (tuple(q.codes.shape), q.codes.dtype, tuple(q.scales.shape), q.scales.dtype) == (cs, cd, ss, sd)
    check_layout(q)  # no error


def _corruptions(q):
    """(mis-laid copy of ``q``, expected message part) pairs for one quantized tensor."""
    cs, ss = tuple(q.codes.shape), tuple(q.scales.shape)
    short = cs[:-1] + (cs[-1] - 1,)
    other = torch.int8 if q.codes.dtype != torch.int8 else torch.uint8
    out = [(replace(q, codes=q.codes[..., :-1]), re.escape(f"q.codes has shape {short}; expected {cs}")),
           (replace(q, codes=q.codes.reshape(-1)), re.escape(f"q.codes has shape {(q.codes.numel(),)}; expected")),
           (replace(q, scales=q.scales[..., :-1]), re.escape(f"q.scales has shape {ss[:-1] + (ss[-1] - 1,)}")),
           (replace(q, scales=q.scales[:-1]), re.escape(f"q.scales has shape {(ss[0] - 1,) + ss[1:]}; expected {ss}")),
           (replace(q, shape=torch.Size((q.shape[0], q.shape[1] + 64))), "q.codes has shape"),
           (replace(q, codes=q.codes.view(other)), re.escape(f"q.codes has dtype {other}; expected {q.codes.dtype}"))]
    if isinstance(q.spec, bs.NVFP4):
        n = q.shape[0]
        out += [(replace(q, scales=q.scales.view(torch.uint8)),
                 "q.scales has dtype torch.uint8; expected torch.float8_e4m3fn"),
                (replace(q, outer_scale=None), "q.outer_scale is missing"),
                (replace(q, outer_scale=torch.ones(n + 1, 1)),
                 re.escape(f"q.outer_scale has shape {(n + 1, 1)}; expected a shape that broadcasts to {(n, 1)}"))]
    if isinstance(q.spec, bs.S2F6):
        out += [(replace(q, signs=None), "q.signs is missing"),
                (replace(q, signs=q.signs[:16]), re.escape("q.signs has shape (16,); expected (32,)"))]
    return out


@pytest.mark.parametrize("spec", [bs.NVFP4(), bs.NVFP4(outer="row"), bs.MX(), bs.MX(element="e2m1", dim=0),
                                  bs.S2F6()], ids=str)
def test_mislaid_quantized_tensor_is_a_value_error_on_dequantize(spec):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    q = bs.quantize(x, spec)
    for bad, match in _corruptions(q):
        with pytest.raises(ValueError, match=match):
            bad.dequantize()
        with pytest.raises(ValueError, match=match):
            check_layout(bad)
    assert torch.equal(q.dequantize(), bs.fake_quantize(x, spec))  # the untouched one still works
