"""FP8 (blockscale.quant.fp8): spec validation, scales per granularity against hand-computed ones,
quantize against the scalar reference, storage layout and its checks, stochastic rounding, and
the generic API (bs.quantize / dequantize / fake_quantize, QuantizedTensor.dequantize)."""
from dataclasses import replace

import pytest
import torch

import blockscale as bs
from blockscale.quant.fp8 import FP8, layout, quantize_fp8
from blockscale.quant.fp8.kernels import fp8_rows
from blockscale.quant.registry import format_named, format_of

from fp8_scalar_reference import f32, quantize_matrix

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")
BLOCK = FP8(granularity="block")
GROUP = FP8(granularity="block", block_shape=(1, 128))


def _u8(t):
    return t.view(torch.uint8)


# ---- spec -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"element": "e2m1"}, "element", "'e4m3', 'e5m2'"),
    ({"granularity": "row"}, "granularity", "'tensor', 'channel', 'token', 'block'"),
    ({"granularity": "block", "block_shape": (64, 64)}, "block_shape", "(128, 128), (1, 128)"),
    ({"granularity": "block", "block_shape": (128.0, 128)}, "block_shape", "(128, 128), (1, 128)"),
    ({"granularity": "block", "block_shape": "128x128"}, "block_shape", "(128, 128), (1, 128)"),
    ({"rounding": "up"}, "rounding", "'nearest', 'stochastic'"),
    ({"rounding": "stochastic", "sr_mode": "fast"}, "sr_mode", "'hardware', 'exact'"),
])
def test_bad_spec_names_field_and_allowed_values(kwargs, field, allowed):
    with pytest.raises(ValueError, match=f"{field}=.*allowed values: {allowed}".replace("(", r"\(").replace(")", r"\)")):
        FP8(**kwargs)


def test_block_shape_only_with_block_granularity_and_list_becomes_tuple():
    with pytest.raises(ValueError, match="block_shape=\\(1, 128\\) applies to granularity='block' only"):
        FP8(granularity="token", block_shape=(1, 128))
    spec = FP8(granularity="block", block_shape=[1, 128])  # as YAML gives it
    assert spec.block_shape == (1, 128) and spec == GROUP and hash(spec) == hash(GROUP)
    assert FP8().max_elem == 448.0 and FP8("e5m2").max_elem == 57344.0


def test_registered_as_fp8():
    assert format_of(FP8()) is format_named("fp8")
    fmt = format_named("fp8")
    assert fmt.spec_type is FP8 and not fmt.accepts_encode_scale
    assert [fmt.block_size(s) for s in (FP8(), FP8(granularity="channel"), BLOCK, GROUP)] == [0, 0, 128, 128]


# ---- scales -----------------------------------------------------------------------------------

def test_scales_per_granularity_hand_computed():
    x = torch.zeros(130, 260)
    for i in range(2):
        for j in range(3):  # tile (i, j) of 128x128: amax 10*i + j + 1 at one element
            x[128 * i + i, 128 * j + j] = -(10.0 * i + j + 1)
    x[5, 7] = 0.5
    m = 448.0
    assert quantize_fp8(x, FP8()).scales.item() == f32(13.0 / m)
    assert quantize_fp8(x, FP8("e5m2")).scales.item() == f32(13.0 / 57344.0)
    ch = quantize_fp8(x, FP8(granularity="channel")).scales
    assert ch.shape == (130, 1)
    assert ch[0, 0].item() == f32(3.0 / m) and ch[5, 0].item() == f32(0.5 / m) and ch[129, 0].item() == f32(13.0 / m)
    assert ch[2, 0].item() == 1.0  # a zero row: s = 1
    assert torch.equal(quantize_fp8(x, FP8(granularity="token")).scales, ch)
    tiles = quantize_fp8(x, BLOCK).scales
    assert tiles.tolist() == [[f32(a / m) for a in (1.0, 2.0, 3.0)], [f32(a / m) for a in (11.0, 12.0, 13.0)]]
    groups = quantize_fp8(x, GROUP).scales
    assert groups.shape == (130, 3)
    assert groups[0].tolist() == [f32(1.0 / m), f32(2.0 / m), f32(3.0 / m)]
    assert groups[5].tolist() == [f32(0.5 / m), 1.0, 1.0] and groups[129].tolist() == [f32(11 / m), f32(12 / m), f32(13 / m)]


def test_zero_blocks_scale_one_and_zero_codes():
    x = torch.zeros(130, 200)
    x[0, 0] = 3.0
    for spec in (FP8(), FP8(granularity="channel"), BLOCK, GROUP, FP8("e5m2", "block")):
        q = quantize_fp8(x, spec)
        s = q.scales.flatten()
        assert (s[1:] == 1.0).all() if s.numel() > 1 else True
        assert _u8(q.codes).flatten()[1:].eq(0).all() and bs.dequantize(q)[1:].eq(0).all()
    q = quantize_fp8(torch.zeros(3, 5), FP8())
    assert q.scales.item() == 1.0 and bs.dequantize(q).eq(0).all()


def test_tiny_amax_underflow_counts_as_zero_and_flt_max_stays_finite():
    tiny = torch.tensor([[1e-45, -1e-45], [1e-40, 0.0]])  # 2**-149 / 448 underflows to 0 -> s = 1
    q = quantize_fp8(tiny, FP8(granularity="channel"))
    assert q.scales[0, 0].item() == 1.0 and q.scales[1, 0].item() == f32(f32(1e-40) / 448)
    assert torch.isfinite(bs.dequantize(q)).all()
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 1.0])
    for el in ("e4m3", "e5m2"):
        d = bs.dequantize(quantize_fp8(big, FP8(el)))
        assert torch.isfinite(d).all() and d[0].item() == torch.finfo(torch.float32).max


# ---- against the scalar reference --------------------------------------------------------------

@pytest.mark.parametrize("spec", [FP8(), FP8("e5m2", "channel"), FP8("e4m3", "token"), BLOCK,
                                  FP8("e5m2", "block"), GROUP], ids=str)
def test_quantize_matches_scalar_reference(spec):
    g = torch.Generator().manual_seed(7)
    rows, cols = (130, 140) if spec.granularity == "block" else (5, 140)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    x[1, :] = 0.0
    x[2, 3] = -0.0
    scales, codes, values = quantize_matrix(x.tolist(), spec.element, spec.granularity, spec.block_shape)
    q, v = bs.quantize(x, spec), bs.fake_quantize(x, spec)
    assert _u8(q.codes).tolist() == codes
    assert q.dequantize().tolist() == values and v.tolist() == values
    assert sorted(q.scales.flatten().tolist()) == sorted(scales.values())


def test_half_precision_inputs_are_their_fp32_values():
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(2))
    for dt in (torch.bfloat16, torch.float16):
        xh = x.to(dt)
        q = bs.quantize(xh, GROUP)
        assert q.dtype == dt and torch.equal(_u8(q.codes), _u8(bs.quantize(xh.float(), GROUP).codes))
        assert q.dequantize(None).dtype == dt and bs.fake_quantize(xh, GROUP).dtype == dt


# ---- layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, spec, scales", [
    ((), FP8(), ()), ((), FP8(granularity="channel"), (1,)), ((), GROUP, (1,)), ((), BLOCK, (1, 1)),
    ((300,), BLOCK, (1, 3)), ((300,), GROUP, (3,)), ((2, 3, 130, 140), BLOCK, (2, 3, 2, 2)),
    ((2, 3, 130, 140), GROUP, (2, 3, 130, 2)), ((2, 3, 7), FP8(granularity="token"), (2, 3, 1)),
    ((4, 0), GROUP, (4, 0)), ((0, 5), FP8(granularity="channel"), (0, 1)),
])
def test_layout_shapes_and_round_trip(shape, spec, scales):
    lay = layout(spec, shape)
    assert lay["codes"] == (shape, torch.float8_e4m3fn) and lay["scales"] == (scales, torch.float32)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100
    q = bs.quantize(x, spec)
    assert tuple(q.codes.shape) == shape and tuple(q.scales.shape) == scales
    d = q.dequantize()
    assert d.shape == x.shape and torch.equal(d, bs.fake_quantize(x, spec))
    if x.numel():  # E4M3: 3 mantissa bits, subnormal step 2**-9 of the largest scale
        assert (torch.abs(d - x) <= torch.abs(x) * 2**-4 + x.abs().max() / 448 * 2**-10).all()


def test_layout_check_refuses_truncated_or_wrong_fields():
    q = bs.quantize(torch.randn(130, 260), BLOCK)
    with pytest.raises(ValueError, match=r"q.codes has shape \(130, 259\); expected \(130, 260\) for an FP8"):
        replace(q, codes=q.codes[:, :-1]).dequantize()
    with pytest.raises(ValueError, match=r"q.scales has shape \(2, 2\); expected \(2, 3\)"):
        bs.dequantize(replace(q, scales=q.scales[:, :2]))
    with pytest.raises(ValueError, match="q.scales has dtype torch.bfloat16; expected torch.float32"):
        bs.dequantize(replace(q, scales=q.scales.bfloat16()))
    with pytest.raises(ValueError, match="q.codes has dtype torch.float8_e5m2; expected torch.float8_e4m3fn"):
        bs.dequantize(replace(q, codes=q.codes.float().to(torch.float8_e5m2)))
    with pytest.raises(ValueError, match="q.outer_scale is set, but an FP8 tensor has none"):
        bs.dequantize(replace(q, outer_scale=torch.ones(())))
    with pytest.raises(ValueError, match=r"q.scales has shape \(130, 3\); expected \(2, 3\)"):
        bs.dequantize(replace(q, scales=torch.ones(130, 3)))  # 1x128 scales under a 128x128 spec


# ---- errors -----------------------------------------------------------------------------------

def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="NaN/inf"):
        bs.quantize(torch.tensor([1.0, float("inf")]), FP8())
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        bs.quantize(torch.tensor([1, 2]), FP8())
    with pytest.raises(ValueError, match="encode_scale is an outer encode scale"):
        bs.quantize(torch.randn(4), FP8(), encode_scale=1.0)
    with pytest.raises(ValueError, match="FP8 has none"):
        quantize_fp8(torch.randn(4), FP8(), encode_scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match="dtype=torch.int8 is not a supported output dtype"):
        bs.quantize(torch.randn(4), FP8()).dequantize(torch.int8)


# ---- stochastic rounding ----------------------------------------------------------------------

@pytest.mark.parametrize("element, lo, step", [("e4m3", 1.0, 0.125), ("e5m2", 256.0, 64.0)])
def test_hardware_sr_mean_over_all_256_bytes_is_exact_on_grid_inputs(element, lo, step):
    """f = k/256 between two neighbours: the mean over r = 0..255 of cvt.rs equals the input."""
    s = 4.0  # amax = 4 * max_elem: s = 4, an exact power of two
    ks = torch.arange(0, 256, 17)
    y = lo + ks.float() / 256 * step
    x = (y * s).reshape(-1, 1).expand(-1, 256).contiguous()
    rand = torch.arange(256, dtype=torch.int32).to(torch.uint8).expand(len(ks), -1).contiguous()
    amax = torch.tensor(4.0 * FP8(element).max_elem)
    _, scales, values = fp8_rows(x, amax, rand, element, 1, 256, "stochastic", "hardware", "both")
    assert scales.item() == s
    assert torch.equal(values.mean(dim=1, dtype=torch.float64), (y * s).double())
    assert (values.min(1).values >= lo * s).all() and (values.max(1).values <= (lo + step) * s).all()


def test_sr_deterministic_given_generator_brackets_and_is_unbiased():
    s = torch.linspace(-4, 4, 64).round().exp2().reshape(-1, 1)  # per-row scales: powers of two
    x = torch.full((64, 512), 1.0 + 77 / 256 * 0.125) * s  # f = 77/256 between 1 and 1.125 (in units of s)
    x[:, 0] = 448.0 * s[:, 0]  # the row amax: s = amax / 448
    for mode in ("hardware", "exact"):
        spec = FP8(granularity="channel", rounding="stochastic", sr_mode=mode)
        a, b, c = (bs.quantize(x, spec, torch.Generator().manual_seed(k)) for k in (5, 5, 6))
        assert torch.equal(a.scales, s)
        assert torch.equal(_u8(a.codes), _u8(b.codes)) and not torch.equal(_u8(a.codes), _u8(c.codes))
        d = a.dequantize()[:, 1:]
        lo, hi = s, 1.125 * s
        assert ((d == lo) | (d == hi)).all()  # outputs bracket the input
        frac = (d == hi).float().mean().item()  # P(up) = 77/256 ("exact") or floor(256 f)/256 (the same here)
        assert abs(frac - 77 / 256) < 0.015, (mode, frac)
