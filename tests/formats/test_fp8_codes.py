"""FP8 element codes, exhaustively: all 256 codes of E4M3 / E5M2 against the independent scalar
reference (decode; encode of every value and of every midpoint), torch's own casts where they agree
with RNE, and compressed-tensors' quantize (x / s, not x * (1/s))."""
import math

import pytest
import torch

from blockscale.formats.fp8 import FP8_DTYPES, encode_fp8
from blockscale.quant.fp8 import FP8, encode_with_scale, quantize_fp8

from fp8_scalar_reference import decode, f32, f32_step, magnitudes, max_elem, neighbours, rne_code

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")
ELEMENTS = ("e4m3", "e5m2")


def _codes(values, element, s=1.0):
    """Our codes (as ints) of FP32 ``values`` with the FP32 scale ``s``."""
    v = encode_with_scale(torch.tensor(values, dtype=torch.float32), torch.tensor(s), element)
    return v.to(FP8_DTYPES[element]).view(torch.uint8).tolist()


def _grid_and_midpoints(element):
    """Every finite value (both signs), every midpoint between neighbours, FP32 neighbours of each
    midpoint, and values beyond max: the inputs that pin the rounding rule down."""
    table = [v for _, v in magnitudes(element)]
    mids = [(a + b) / 2 for a, b in zip(table, table[1:])]
    near = [f32_step(f32(m), up) for m in mids for up in (False, True)]
    big = [max_elem(element) * 1.0625, max_elem(element) * 2, 1e30, 3.4e38]
    pos = table + mids + near + big
    return pos + [-v for v in pos]


@pytest.mark.parametrize("element", ELEMENTS)
def test_decode_all_256_codes(element):
    ours = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPES[element]).float().tolist()
    for code, v in enumerate(ours):
        want = decode(code, element)
        if math.isnan(want):
            assert math.isnan(v), code
        else:
            assert v == want and math.copysign(1, v) == math.copysign(1, want), (code, v, want)
    assert max_elem(element) == {"e4m3": 448.0, "e5m2": 57344.0}[element]
    assert sum(math.isnan(decode(c, element)) for c in range(256)) == {"e4m3": 2, "e5m2": 6}[element]


@pytest.mark.parametrize("element", ELEMENTS)
def test_encode_every_representable_value(element):
    codes = [c for c in range(256) if math.isfinite(decode(c, element))]
    values = [decode(c, element) for c in codes]
    assert _codes(values, element) == codes  # including -0.0 -> 0x80
    x = torch.tensor(values)
    assert encode_fp8(x, element).view(torch.uint8).tolist() == codes
    assert len(codes) == {"e4m3": 254, "e5m2": 248}[element]


@pytest.mark.parametrize("element", ELEMENTS)
def test_rne_midpoints_tie_to_even_and_saturate(element):
    inputs = _grid_and_midpoints(element)
    want = [rne_code(y, element) for y in inputs]
    assert _codes(inputs, element) == want
    table = [v for _, v in magnitudes(element)]
    mids = [(a + b) / 2 for a, b in zip(table, table[1:])]
    up = sum(rne_code(m, element) & 0x7F == i + 1 for i, m in enumerate(mids))
    assert 0 < up < len(mids)  # ties go both ways: to the even code, not always up or down
    assert rne_code(1e30, element) == 0x7E if element == "e4m3" else rne_code(1e30, element) == 0x7B


@pytest.mark.parametrize("element", ELEMENTS)
def test_torch_casts_agree_with_rne(element):
    """E4M3: torch's cast is saturating RNE; E5M2: after the clamp (its cast overflows to inf)."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-24, 20, (20000,), generator=g).float())
    x = torch.cat([torch.tensor(_grid_and_midpoints(element)), rand])
    m = max_elem(element)
    cast = (x if element == "e4m3" else torch.clamp(x, -m, m)).to(FP8_DTYPES[element])
    ours = _codes(x.tolist(), element)
    assert ours == cast.view(torch.uint8).tolist()
    sample = x[::97].tolist()  # the scalar reference is slow: a sample of the same inputs
    assert [ours[i * 97] for i in range(len(sample))] == [rne_code(y, element) for y in sample]


def test_e5m2_cast_alone_does_not_saturate():
    """Why the clamp comes before the cast: torch's E5M2 cast maps 61440 to inf, FP8 gives 57344."""
    x = torch.tensor([61440.0, -1e6])
    assert torch.isinf(x.to(torch.float8_e5m2).float()).all()
    q = quantize_fp8(x, FP8("e5m2"))  # per-tensor s = 1e6 / 57344
    assert torch.isfinite(q.codes.float()).all() and q.codes.float()[1].item() == -57344.0


@pytest.mark.parametrize("element", ELEMENTS)
def test_stochastic_outputs_bracket_input(element):
    x = torch.tensor(_grid_and_midpoints(element)[:-8] * 4)
    for mode in ("hardware", "exact"):
        g = torch.Generator().manual_seed(3)
        rand = (torch.randint(0, 256, x.shape, generator=g, dtype=torch.int32).to(torch.uint8)
                if mode == "hardware" else torch.rand(x.shape, generator=g))
        v = encode_with_scale(x, torch.tensor(1.0), element, "stochastic", rand, mode).tolist()
        for y, got in zip(x.tolist(), v):
            lo, hi = neighbours(min(max(y, -max_elem(element)), max_elem(element)), element)
            assert got in (lo, hi), (y, got, lo, hi)


def _ct_quantize(x, s):
    ct = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward_helpers")
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    return ct._quantize(x, s, None, torch.tensor(-448.0), torch.tensor(448.0), args, dtype=torch.float8_e4m3fn)


def test_matches_compressed_tensors_division_not_reciprocal():
    """compressed-tensors computes ``x / scale`` (forward_helpers._quantize); x * (1/s) differs on
    rare ties: inputs built at E4M3 midpoints times random scales tell the two apart."""
    g = torch.Generator().manual_seed(0)
    table = [v for _, v in magnitudes("e4m3")]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(table, table[1:])])
    rows = 256
    s_want = torch.rand(rows, 1, generator=g) * 4 + 0.01
    x = (mids.expand(rows, -1) * s_want).float()
    x[:, -1] = s_want[:, 0] * 448  # the row amax maps to 448
    q = quantize_fp8(x, FP8("e4m3", "channel"))
    s = q.scales
    assert torch.equal(s, torch.abs(x).amax(1, keepdim=True) / 448)
    ct = _ct_quantize(x, s)
    assert torch.equal(q.codes.view(torch.uint8), ct.view(torch.uint8))
    recip = torch.clamp(x * (1 / s), -448, 448).to(torch.float8_e4m3fn)
    assert (recip.view(torch.uint8) != q.codes.view(torch.uint8)).sum() > 0  # the choice matters


def test_matches_compressed_tensors_on_random_weights():
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    for spec in (FP8("e4m3", "channel"), FP8("e4m3", "tensor")):
        q = quantize_fp8(x, spec)
        s = q.scales.reshape(-1, 1) if spec.granularity == "channel" else q.scales.reshape(1)
        assert torch.equal(q.codes.view(torch.uint8), _ct_quantize(x, s).view(torch.uint8))
