"""MX (MXFP8 / MXFP4) and S2F6 block quantizers against independent references."""
import math

import pytest
import torch

import blockscale as bs
from blockscale.formats import decode_e2m1, unpack_nibbles

from reference_impl import E2M1_GRID, fp_grid, mx_reference

pytestmark = pytest.mark.usefixtures("reference_backend")

E4M3 = fp_grid(3, -6, 448.0)
E5M2 = fp_grid(2, -14, 57344.0)
S2F6_GRID = [i / 64 for i in range(128)]
GRIDS = {"e4m3": (448.0, 8, E4M3), "e5m2": (57344.0, 15, E5M2), "e2m1": (6.0, 2, E2M1_GRID)}


def _wide(rows=6, cols=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-8, 8, cols)
    x[0, :32] = 0.0
    x[1, :32] = torch.tensor([448.0 * 2**-3] + [1.0] * 31)  # amax exactly max * 2^k
    return x


def _values(q):
    if q.spec.element == "e2m1":
        return decode_e2m1(unpack_nibbles(q.codes))
    return q.codes.float()


def test_grids_have_the_right_sizes():
    assert len(E4M3) == 127 and E4M3[-1] == 448.0 and E4M3[1] == 2.0**-9
    assert len(E5M2) == 124 and E5M2[-1] == 57344.0 and E5M2[1] == 2.0**-16


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_mx_matches_reference(element, rule):
    x = _wide()
    q = bs.quantize(x, bs.MX(element=element, scale_rule=rule))
    max_elem, emax, grid = GRIDS[element]
    vals, ks = mx_reference(x.numpy(), max_elem, emax, grid, rule)
    assert torch.equal(q.scales.long() - 127, torch.from_numpy(ks))
    assert torch.equal(_values(q).double(), torch.from_numpy(vals))
    k = q.scales.long().repeat_interleave(32, dim=-1) - 127
    expect = (torch.from_numpy(vals) * torch.pow(2.0, k.double())).float()
    assert torch.equal(q.dequantize(), expect)


def test_mx_ceil_never_saturates_floor_does():
    x = torch.tensor([[480.0] + [1.0] * 31])
    qc = bs.quantize(x, bs.MX(element="e4m3"))
    assert qc.scales[0, 0].item() - 127 == 1  # 480/448 -> 2^1, 480 = 240 * 2 exactly
    assert qc.dequantize()[0, 0].item() == 480.0
    qf = bs.quantize(x, bs.MX(element="e4m3", scale_rule="floor"))
    assert qf.scales[0, 0].item() - 127 == 0  # floor(log2 480) - 8 = 0
    assert qf.dequantize()[0, 0].item() == 448.0  # saturated


def test_mx_zero_block_and_dims():
    x = torch.zeros(2, 64)
    q = bs.quantize(x, bs.MX())
    assert q.scales.eq(0).all() and q.dequantize().eq(0).all()
    g = torch.Generator().manual_seed(4)
    y = torch.randn(64, 40, 3, generator=g)
    for dim in (0, 1, -1):
        q = bs.quantize(y, bs.MX(dim=dim))
        moved = y.movedim(dim, -1).contiguous()
        q_last = bs.quantize(moved, bs.MX())
        assert torch.equal(q.scales, q_last.scales)
        assert torch.equal(q.dequantize(), q_last.dequantize().movedim(-1, dim))
        assert q.dequantize().shape == y.shape


def test_mx_block_along_dim0_is_32_rows():
    y = torch.ones(64, 3)
    y[31, 0] = 1000.0
    q = bs.quantize(y, bs.MX(dim=0))
    assert q.scales.shape == (3, 2)
    assert q.scales[0, 0] != q.scales[0, 1] and q.scales[1, 0] == q.scales[1, 1]


def test_mx_stochastic_is_unbiased():
    """Ceil scales never saturate, so SR's mean converges to the input (4-sigma bound)."""
    x = torch.tensor([[1.1, -3.3, 0.01, 100.7] * 8])
    n = 4000
    xs = x.expand(n, 32).contiguous()
    for element, mode in (("e4m3", "exact"), ("e2m1", "exact"), ("e5m2", "hardware")):
        q = bs.quantize(xs, bs.MX(element=element, rounding="stochastic", sr_mode=mode),
                        generator=torch.Generator().manual_seed(0))
        d = q.dequantize().double()
        k = q.scales[0, 0].item() - 127
        max_elem, _, grid = GRIDS[element]
        for i in range(4):
            v = abs(x[0, i].item()) * 2.0**-k
            hi = min(g for g in grid if g >= v)
            lo = max(g for g in grid if g <= v)
            ulp = (hi - lo) * 2.0**k
            sigma = ulp * 0.5 / math.sqrt(n)
            bias = ulp / 512 if mode == "hardware" else 0.0
            assert abs(d[:, i].mean().item() - x[0, i].item()) <= 4 * sigma + bias + 1e-12


def test_s2f6_without_hadamard_matches_reference():
    x = _wide(cols=64)
    q = bs.quantize(x, bs.S2F6(hadamard=False))
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.uint8
    vals, ks = mx_reference(x.numpy(), 127 / 64, 0, S2F6_GRID, "ceil")
    assert torch.equal(q.scales.long() - 127, torch.from_numpy(ks))
    assert torch.equal(q.codes.double() / 64, torch.from_numpy(vals))
    assert q.codes.min().item() >= -127


def test_s2f6_floor_rule_saturates_symmetrically():
    x = torch.tensor([[-1.999] + [0.5] * 31])
    q = bs.quantize(x, bs.S2F6(hadamard=False, scale_rule="floor"))
    assert q.scales[0, 0].item() == 127  # floor(log2 1.999) = 0
    assert q.codes[0, 0].item() == -127


def test_s2f6_hadamard_rotates_then_quantizes_and_undoes():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 100, generator=g)
    spec = bs.S2F6(hadamard=True, seed=3)
    q = bs.quantize(x, spec)
    signs = bs.random_signs(32, seed=3)
    rot = bs.hadamard(torch.nn.functional.pad(x, (0, 28)), n=32, signs=signs)
    plain = bs.quantize(rot, bs.S2F6(hadamard=False))
    assert torch.equal(q.codes, plain.codes) and torch.equal(q.scales, plain.scales)
    back = bs.inverse_hadamard(plain.dequantize(), n=32, signs=signs)[:, :100]
    assert torch.equal(q.dequantize(), back)
    # error bound: RNE error <= half a step 2^k/64 per rotated value; the rotation is orthogonal
    step = torch.pow(2.0, q.scales.double() - 127) / 64
    bound = ((step / 2).pow(2) * 32).sum(-1).sqrt()  # per row: 32 values per block
    err = (q.dequantize().double() - x.double()).pow(2).sum(-1).sqrt()
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    # 8.25 bits per value on the wire for whole blocks
    assert q.nbytes * 8 / q.codes.numel() == pytest.approx(8.25)


def test_s2f6_extreme_magnitudes():
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0**127  # block exponent k = 127: must saturate, not flush to zero
    x[0, 1] = -(2.0**126)
    q = bs.quantize(x, bs.S2F6(hadamard=False))
    assert q.scales[0, 0].item() == 254
    assert q.dequantize()[0, :2].tolist() == [2.0**127, -(2.0**126)]
    qf = bs.quantize(x, bs.S2F6(hadamard=False, scale_rule="floor"))
    assert qf.codes[0, 0].item() == 64 and qf.dequantize()[0, 0].item() == 2.0**127
    with pytest.raises(ValueError, match="FLT_MAX/32"):
        bs.quantize(torch.full((32,), 3e38), bs.S2F6(hadamard=True))
