"""FP8Linear / MXLinear (blockscale.nn): stored codes and scales against independent torch references,
forward = F.linear(reference-quantized input, reference-dequantized weight, bias), round trips,
argument errors, coverage."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import blockscale as bs
from blockscale.errors import UsageError
from blockscale.nn import FP8Linear, MXLinear, NVFP4Linear, QUANTIZED_LINEAR_TYPES, is_quantized_linear
from blockscale.nn.coverage import weight_coverage
from blockscale.quant import FP8, MX, NVFP4

N, K = 200, 160   # not multiples of 128: partial 128x128 tiles and 1x128 groups
E4M3 = torch.float8_e4m3fn


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# -- independent FP8 references -----------------------------------------------------------------
def _scale(amax: torch.Tensor) -> torch.Tensor:
    s = amax.float() / 448
    return torch.where(s == 0, torch.ones_like(s), s)


def _tiles(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """amax of each rows x cols tile of a 2-D tensor (partial tiles at the ends)."""
    nr, nc = -(-t.shape[0] // rows), -(-t.shape[1] // cols)
    out = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            out[i, j] = t[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max()
    return out


def _expand(s: torch.Tensor, rows: int, cols: int, shape) -> torch.Tensor:
    return s.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


def _ref_weight(w: torch.Tensor, granularity: str):
    """(codes, stored scales, full per-element scales) by torch's own E4M3 cast."""
    if granularity == "tensor":
        s = _scale(w.abs().max()).reshape(1)
        full = s.expand(w.shape)
    elif granularity == "channel":
        s = _scale(w.abs().amax(dim=1, keepdim=True))
        full = s.expand(w.shape)
    else:
        s = _scale(_tiles(w, 128, 128))
        full = _expand(s, 128, 128, w.shape)
    return (w / full).clamp(-448, 448).to(E4M3), s, full


def _ref_input(x: torch.Tensor, granularity, s_in=None) -> torch.Tensor:
    if granularity is None:
        return x
    if granularity == "tensor":
        full = s_in
    elif granularity == "token":
        full = _scale(x.abs().amax(dim=-1, keepdim=True))
    else:
        x2 = x.reshape(-1, x.shape[-1])
        full = _expand(_scale(_tiles(x2, 1, 128)), 1, 128, x2.shape).reshape(x.shape)
    return (x / full).clamp(-448, 448).to(E4M3).float() * full


def _weight_spec(granularity: str) -> FP8:
    return FP8("e4m3", "block", (128, 128)) if granularity == "block" else FP8("e4m3", granularity)


# -- FP8Linear ----------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_weight_codes_and_scales_match_torch_reference(granularity):
    w = _rand(N, K, seed=1)
    m = FP8Linear.from_quantized(bs.quantize(w, _weight_spec(granularity)))
    codes, s, _ = _ref_weight(w, granularity)
    want_shape = {"tensor": (1,), "channel": (N, 1), "block": (2, 2)}[granularity]
    assert m.weight.dtype == E4M3 and m.weight.shape == (N, K)
    assert m.weight_scale.dtype == torch.float32 and tuple(m.weight_scale.shape) == want_shape
    assert torch.equal(_bits(m.weight), _bits(codes)) and torch.equal(m.weight_scale, s)
    assert m.scheme_name == ("fp8-block" if granularity == "block" else "fp8-w8a16")


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("input_granularity", [None, "tensor", "token", "block"])
def test_fp8_forward_matches_reference(granularity, input_granularity):
    w, b = _rand(N, K, seed=2), _rand(N, seed=3)
    x = _rand(2, 3, K, seed=4, scale=2.0)
    # a calibrated static scale smaller than this batch needs: some inputs clamp to +-448 * s
    s_in = _scale(_rand(8, K, seed=5).abs().max()).reshape(1) if input_granularity == "tensor" else None
    m = FP8Linear.from_quantized(bs.quantize(w, _weight_spec(granularity)), b, input_granularity=input_granularity,
                                 input_scale=s_in)
    codes, _, full = _ref_weight(w, granularity)
    w_ref = codes.float() * full
    x_ref = _ref_input(x, input_granularity, s_in)
    assert torch.equal(m.dequantized_weight(), w_ref)
    assert torch.equal(m.quantize_input(x), x_ref)
    assert torch.equal(m(x), F.linear(x_ref, w_ref, b))
    if input_granularity == "tensor":
        assert bool((x_ref.abs() == 448 * s_in).any())   # clamping happened
        assert tuple(m.input_scale.shape) == (1,)
    else:
        assert m.input_scale is None
    if granularity != "block":
        assert m.scheme_name == ("fp8-w8a16" if input_granularity is None else "fp8-w8a8")


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_round_trip_and_state_dict(granularity):
    w = _rand(N, K, seed=6)
    q = bs.quantize(w, _weight_spec(granularity))
    m = FP8Linear.from_quantized(q, input_granularity="tensor", input_scale=torch.tensor([0.01]))
    q2 = m.quantized_weight()
    assert q2.spec == q.spec and q2.shape == q.shape and q2.scales.shape == q.scales.shape
    assert torch.equal(_bits(q2.codes), _bits(q.codes)) and torch.equal(q2.scales, q.scales)
    assert torch.equal(q2.dequantize(), q.dequantize())
    fresh = FP8Linear(K, N, weight_granularity=granularity, input_granularity="tensor")
    fresh.load_state_dict(m.state_dict())
    assert sorted(m.state_dict()) == ["input_scale", "weight", "weight_scale"]
    x = _rand(4, K, seed=7)
    assert torch.equal(fresh(x), m(x))


def test_fp8_cache_follows_buffers_and_dtype_cast_keeps_codes():
    w = _rand(N, K, seed=8)
    m = FP8Linear.from_quantized(bs.quantize(w, FP8("e4m3", "channel")), _rand(N, seed=9))
    first = m.dequantized_weight().clone()
    m.weight_scale.mul_(2)
    assert torch.equal(m.dequantized_weight(), first * 2)
    m = m.to(torch.bfloat16)
    assert m.weight.dtype == E4M3 and m.weight_scale.dtype == torch.float32 and m.bias.dtype == torch.bfloat16
    x = _rand(3, K, seed=10).to(torch.bfloat16)
    assert m(x).dtype == torch.bfloat16
    assert torch.equal(m(x), F.linear(x, (first * 2).to(torch.bfloat16), m.bias))


def test_fp8_bad_arguments():
    with pytest.raises(UsageError, match="weight_granularity='row'"):
        FP8Linear(K, N, weight_granularity="row")
    with pytest.raises(UsageError, match="input_granularity='channel'"):
        FP8Linear(K, N, input_granularity="channel")
    q = bs.quantize(_rand(N, K), FP8("e4m3", "tensor"))
    with pytest.raises(UsageError, match="input_scale"):
        FP8Linear.from_quantized(q, input_granularity="tensor")
    with pytest.raises(UsageError, match="input_scale"):
        FP8Linear.from_quantized(q, input_granularity="token", input_scale=torch.ones(1))
    with pytest.raises(UsageError, match="element"):
        FP8Linear.from_quantized(bs.quantize(_rand(N, K), FP8("e5m2")))
    with pytest.raises(UsageError, match="block_shape"):
        FP8Linear.from_quantized(bs.quantize(_rand(N, K), FP8("e4m3", "block", (1, 128))))
    with pytest.raises(UsageError, match="2-D FP8"):
        FP8Linear.from_quantized(bs.quantize(_rand(N, K), MX("e4m3")))


# -- independent MX references ------------------------------------------------------------------
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MX_MAX = {"e4m3": 448.0, "e2m1": 6.0}


def _ref_mx(w: torch.Tensor, element: str):
    """("ceil" rule) biased exponents b = ceil(log2(amax / max_elem)) + 127 per 32 values and the
    dequantized weight v * 2**(b - 127), v = RNE(w * 2**(127 - b)) on the element grid."""
    blocks = w.reshape(w.shape[0], -1, 32)
    y = blocks.abs().amax(dim=-1) / MX_MAX[element]
    mant, e = torch.frexp(y)                       # y = mant * 2**e, mant in [0.5, 1)
    k = torch.where(mant == 0.5, e - 1, e)           # ceil(log2 y), exact
    scaled = blocks * torch.pow(2.0, -k.float()).unsqueeze(-1)
    if element == "e4m3":
        v = scaled.to(E4M3).float()
    else:
        d = (scaled.abs().unsqueeze(-1) - E2M1_GRID).abs()
        idx = d.argmin(dim=-1)
        nxt = (idx + 1).clamp(max=7)
        tie = (torch.gather(d, -1, nxt.unsqueeze(-1)).squeeze(-1) == torch.gather(d, -1, idx.unsqueeze(-1)).squeeze(-1))
        idx = torch.where(tie & (idx % 2 == 1) & (nxt != idx), nxt, idx)   # ties to the even code
        v = E2M1_GRID[idx] * torch.sign(scaled)
    deq = (v * torch.pow(2.0, k.float()).unsqueeze(-1)).reshape(w.shape)
    return (k + 127).to(torch.uint8), deq


def _decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1).long()
    return E2M1_GRID[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)


MX_CASES = [("e4m3", "e4m3", "mxfp8"), ("e2m1", "e2m1", "mxfp4"), ("e2m1", None, "mxfp4-w4a16"),
            ("e4m3", None, "mxfp8-w8a16")]
MN, MK = 48, 96


@pytest.mark.parametrize("element,input_element,scheme", MX_CASES)
def test_mx_codes_scales_and_forward(element, input_element, scheme):
    w, b = _rand(MN, MK, seed=11), _rand(MN, seed=12)
    q = bs.quantize(w, MX(element))
    m = MXLinear.from_quantized(q, b, input_element=input_element)
    assert m.scheme_name == scheme
    codes_name = "weight_packed" if element == "e2m1" else "weight"
    assert sorted(m.state_dict()) == sorted(["bias", "weight_scale", codes_name])
    codes = m.weight_packed if element == "e2m1" else m.weight
    assert codes.shape == ((MN, MK // 2) if element == "e2m1" else (MN, MK))
    assert m.weight_scale.dtype == torch.uint8 and m.weight_scale.shape == (MN, MK // 32)
    assert torch.equal(_bits(codes), _bits(q.codes)) and torch.equal(m.weight_scale, q.scales)
    b_ref, w_ref = _ref_mx(w, element)
    assert torch.equal(m.weight_scale, b_ref)
    values = _decode_e2m1(m.weight_packed) if element == "e2m1" else m.weight.float()
    assert torch.equal(values * torch.pow(2.0, m.weight_scale.float() - 127).repeat_interleave(32, 1), w_ref)
    assert torch.equal(m.dequantized_weight(), w_ref)
    x = _rand(2, 5, MK, seed=13, scale=3.0)
    x_ref = x if input_element is None else _ref_mx(x.reshape(-1, MK), input_element)[1].reshape(x.shape)
    assert torch.equal(m.quantize_input(x), x_ref)
    assert torch.equal(m(x), F.linear(x_ref, w_ref, b))


@pytest.mark.parametrize("element", ["e4m3", "e2m1"])
@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
def test_mx_round_trip(element, scale_rule):
    w = _rand(MN, MK, seed=14)
    q = bs.quantize(w, MX(element, scale_rule))
    m = MXLinear.from_quantized(q, input_element=element)
    assert m.scale_rule == scale_rule
    q2 = m.quantized_weight()
    assert q2.spec == q.spec and q2.shape == q.shape
    assert torch.equal(_bits(q2.codes), _bits(q.codes)) and torch.equal(q2.scales, q.scales)
    x = _rand(3, MK, seed=15)
    assert torch.equal(m.quantize_input(x), bs.fake_quantize(x, MX(element, scale_rule)))
    fresh = MXLinear(MK, MN, element=element, input_element=element, scale_rule=scale_rule)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh(x), m(x))


def test_mx_bad_arguments():
    with pytest.raises(UsageError, match="in_features=48"):
        MXLinear(48, 16)
    with pytest.raises(UsageError, match="element='e5m2'"):
        MXLinear(64, 16, element="e5m2")
    with pytest.raises(UsageError, match="input_element='e4m3'"):
        MXLinear(64, 16, element="e2m1", input_element="e4m3")
    with pytest.raises(UsageError, match="scale_rule='round'"):
        MXLinear(64, 16, scale_rule="round")
    with pytest.raises(UsageError, match="2-D MX"):
        MXLinear.from_quantized(bs.quantize(_rand(16, 64), FP8()))
    with pytest.raises(UsageError, match="dim"):
        MXLinear.from_quantized(bs.quantize(_rand(64, 64), MX("e4m3", dim=0)))


# -- all quantized Linears ----------------------------------------------------------------------
def test_quantized_linear_types_and_coverage():
    model = torch.nn.Sequential(
        NVFP4Linear.from_quantized(bs.quantize(_rand(32, 64), NVFP4())),
        FP8Linear.from_quantized(bs.quantize(_rand(64, 32), FP8("e4m3", "channel")), input_granularity="token"),
        MXLinear.from_quantized(bs.quantize(_rand(16, 64), MX("e2m1"))),
        torch.nn.Linear(16, 8),
    )
    assert QUANTIZED_LINEAR_TYPES == (NVFP4Linear, FP8Linear, MXLinear)
    assert [is_quantized_linear(m) for m in model] == [True, True, True, False]
    assert [getattr(m, "scheme_name", None) for m in model] == ["nvfp4-w4a16", "fp8-w8a8", "mxfp4-w4a16", None]
    cov = weight_coverage(model)
    assert cov.quantized == {"0": 32 * 64, "1": 64 * 32, "2": 16 * 64}
    assert cov.high_precision == {"3": 16 * 8}
    assert model(_rand(2, 64)).shape == (2, 8)
