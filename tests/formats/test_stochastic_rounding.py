"""Stochastic rounding for every element format (E2M1, E4M3, E5M2, S2F6).

"hardware" mode (PTX cvt.rs): 8 random bits r are added to the top 8 discarded bits, so
P(round away from zero) = floor(256 f) / 256 with f the fractional position between the two grid
neighbours. "exact" mode: P(up) = f with 24-bit uniforms. Bounds below are 4 standard deviations
of the theoretical sampling distribution; every generator is seeded, so results are reproducible.
"""
from __future__ import annotations

import math

import pytest
import torch

import blockscale as bs
from blockscale.formats import (
    E2M1,
    E4M3,
    E5M2,
    decode_e2m1,
    decode_s2f6,
    encode_e2m1,
    encode_s2f6,
    round_magnitude,
    round_to_format,
    unpack_nibbles,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ALL_R = torch.arange(256, dtype=torch.uint8)


# A "format" here is (name, rounding function, positive grid). The rounding function maps FP32
# x -> FP32 rounded values, so E2M1/E4M3/E5M2 and S2F6 (int8 codes / 64) are tested alike.
def _minifloat(fmt):
    def rnd(x, rounding="stochastic", rand=None, sr_mode="hardware"):
        return round_to_format(x, fmt, rounding, rand, sr_mode)

    return rnd


def _s2f6(x, rounding="stochastic", rand=None, sr_mode="hardware"):
    return decode_s2f6(encode_s2f6(x, rounding, rand, sr_mode))


def _grid(name) -> torch.Tensor:
    if name == "e2m1":
        return torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    if name == "s2f6":
        return torch.arange(0, 128, dtype=torch.float32) / 64.0
    dtype = torch.float8_e4m3fn if name == "e4m3" else torch.float8_e5m2
    v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return torch.unique(v[torch.isfinite(v) & (v >= 0)])


FORMATS = {
    "e2m1": _minifloat(E2M1),
    "e4m3": _minifloat(E4M3),
    "e5m2": _minifloat(E5M2),
    "s2f6": _s2f6,
}

# (format, lower grid neighbour lo): intervals [lo, hi) in several binades, incl. subnormal ones
INTERVALS = [
    ("e2m1", 0.0), ("e2m1", 0.5), ("e2m1", 1.0), ("e2m1", 1.5), ("e2m1", 2.0), ("e2m1", 3.0), ("e2m1", 4.0),
    ("e4m3", 0.0), ("e4m3", 5 * 2.0 ** -9), ("e4m3", 2.0 ** -6), ("e4m3", 1.0), ("e4m3", 1.875),
    ("e4m3", 240.0), ("e4m3", 416.0),
    ("e5m2", 0.0), ("e5m2", 3 * 2.0 ** -16), ("e5m2", 2.0 ** -14), ("e5m2", 1.0), ("e5m2", 1.75),
    ("e5m2", 40960.0), ("e5m2", 49152.0),
    ("s2f6", 0.0), ("s2f6", 1 / 64), ("s2f6", 0.5), ("s2f6", 1.0), ("s2f6", 126 / 64),
]


def _neighbours(name, lo):
    g = _grid(name)
    i = int((g == lo).nonzero().item())
    return lo, g[i + 1].item()


def _ids(p):
    return f"{p[0]}-{p[1]:g}"


def _lattice(case, offset=0.0):
    """(name, lo, hi, x64, x): the 256 inputs lo + (j + offset)/256 * ulp, exact in FP32."""
    name, lo = case
    lo, hi = _neighbours(name, lo)
    x64 = lo + (torch.arange(256, dtype=torch.float64) + offset) / 256.0 * (hi - lo)
    x = x64.float()
    assert torch.equal(x.double(), x64), "inputs must be exact in FP32"
    return name, lo, hi, x64, x


@pytest.mark.parametrize("case", INTERVALS, ids=_ids)
def test_hardware_sr_mean_over_all_r_is_exact(case):
    name, lo, hi, x64, x = _lattice(case)
    rnd = FORMATS[name]
    for sign in (1.0, -1.0):
        xs = (sign * x).unsqueeze(0).expand(256, 256)
        r = ALL_R.unsqueeze(1).expand(256, 256)
        out = rnd(xs, "stochastic", r, "hardware")
        assert set(out.abs().unique().tolist()) <= {lo, hi}
        mean = out.double().mean(dim=0)
        assert torch.equal(mean, sign * x64), f"{name} [{lo}, {hi}] sign {sign}: mean over r != x"
        # exactly j of the 256 values of r round away from zero
        ups = (out.abs() == hi).sum(dim=0)
        assert torch.equal(ups, torch.arange(256))


@pytest.mark.parametrize("case", INTERVALS, ids=_ids)
def test_exact_sr_mean_over_uniform_lattice_is_exact(case):
    """u = i/256, i = 0..255 (a legal set of 24-bit uniforms, 0 included): up iff u < f, so for f a
    multiple of 1/256 exactly 256 f of them round up and the mean equals the input exactly."""
    name, lo, hi, x64, x = _lattice(case)
    u = (torch.arange(256, dtype=torch.float32) / 256.0).unsqueeze(1).expand(256, 256)
    for sign in (1.0, -1.0):
        out = FORMATS[name]((sign * x).unsqueeze(0).expand(256, 256), "stochastic", u, "exact")
        assert torch.equal(out.double().mean(dim=0), sign * x64)
        assert torch.equal((out.abs() == hi).sum(dim=0), torch.arange(256))


@pytest.mark.parametrize("case", INTERVALS, ids=_ids)
def test_hardware_sr_truncates_below_8_bits(case):
    """Off the 1/256 lattice, P(up) = floor(256 f)/256: the lower bits are discarded."""
    name, lo, hi, x64, x = _lattice(case, offset=0.5)  # halfway between lattice points: 9 bits below the grid
    ulp = hi - lo
    assert torch.equal(x.double(), x64)
    out = FORMATS[name](x.unsqueeze(0).expand(256, 256), "stochastic", ALL_R.unsqueeze(1).expand(256, 256))
    mean = out.double().mean(dim=0)
    assert torch.equal(mean, lo + torch.arange(256, dtype=torch.float64) / 256.0 * ulp)  # bias exactly -ulp/512
    assert torch.equal(mean - x64, torch.full_like(x64, -ulp / 512))


def _brackets(name, x, out):
    """out is one of the two grid neighbours of x (with x's sign); max where |x| is beyond the grid."""
    g = _grid(name)
    a = x.abs()
    i = torch.searchsorted(g, a, right=True) - 1  # g[i] <= a
    lo = g[i.clamp(max=g.numel() - 1)]
    hi = g[(i + 1).clamp(max=g.numel() - 1)]
    hi = torch.where(lo == a, lo, hi)
    o = out.abs()
    assert bool(((o == lo) | (o == hi)).all()), f"{name}: output not a neighbour of the input"
    sign_ok = (torch.signbit(out) == torch.signbit(x)) | (out == 0)
    assert bool(sign_ok.all())
    assert bool((o <= g[-1]).all())


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("sr_mode", ["hardware", "exact"])
def test_sr_outputs_bracket_input_and_lie_on_grid(name, sr_mode):
    gen = torch.Generator().manual_seed(42)
    g = _grid(name)
    top = g[-1].item()
    n = 50_000
    # log-uniform magnitudes from deep subnormal to 2x the format max, random signs
    lo_exp = math.log2(g[1].item()) - 3
    mag = torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * (math.log2(2 * top) - lo_exp) + lo_exp)
    x = (mag * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()).float()
    x = torch.cat([x, g, -g, torch.tensor([0.0, -0.0])])
    if sr_mode == "hardware":
        rand = torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8)
    else:
        rand = torch.rand(x.shape, generator=gen)
    out = FORMATS[name](x, "stochastic", rand, sr_mode)
    _brackets(name, x, out)
    # grid values are never moved
    k = g.numel()
    assert torch.equal(out[n:n + k], g) and torch.equal(out[n + k:n + 2 * k], -g)


@pytest.mark.parametrize("name", list(FORMATS))
def test_sr_saturates_after_rounding(name):
    g = _grid(name)
    top, below = g[-1].item(), g[-2].item()
    # just below the max: only the two neighbours; the largest r (or u) rounds up to max, never beyond
    x = torch.tensor([torch.nextafter(torch.tensor(top), torch.tensor(0.0)).item(), (top + below) / 2])
    xs = x.unsqueeze(0).expand(256, 2)
    out = FORMATS[name](xs, "stochastic", ALL_R.unsqueeze(1).expand(256, 2), "hardware")
    assert set(out.unique().tolist()) == {below, top}
    assert out[255, 0].item() == top
    # beyond the max (between max and where the next grid value would be): always max, any r
    beyond = {"e2m1": [6.5, 7.0, 7.999, 100.0], "e4m3": [449.0, 470.0, 479.0, 1000.0],
              "e5m2": [57345.0, 61440.0, 65000.0, 1e6], "s2f6": [127.5 / 64, 2.0, 2.01, 5.0]}[name]
    for sign in (1.0, -1.0):
        b = sign * torch.tensor(beyond)
        for sr_mode, rand in (("hardware", ALL_R.unsqueeze(1).expand(256, len(beyond))),
                              ("exact", torch.linspace(0, 1 - 2.0 ** -24, 256).unsqueeze(1).expand(256, len(beyond)))):
            out = FORMATS[name](b.unsqueeze(0).expand(256, len(beyond)), "stochastic", rand, sr_mode)
            assert bool((out == sign * top).all()), f"{name} {sr_mode}: {out.unique().tolist()}"


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("sr_mode", ["hardware", "exact"])
def test_sr_matches_reference_element_by_element(name, sr_mode):
    """Independent float64 reference: up iff floor(256 f) + r >= 256 (hardware) or u < f (exact)."""
    gen = torch.Generator().manual_seed(77)
    g = _grid(name)
    n = 20_000
    top = g[-1].item()
    x = (torch.rand(n, generator=gen, dtype=torch.float64) * 1.1 * top).float()
    x = torch.where(torch.rand(n, generator=gen) < 0.5, -x, x)
    a = x.abs().double()
    g64 = g.double()
    i = (torch.searchsorted(g64, a, right=True) - 1).clamp(max=g.numel() - 2)
    lo, hi = g64[i], g64[i + 1]
    f = (a - lo) / (hi - lo)
    if sr_mode == "hardware":
        rand = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        up = torch.floor(256 * f) + rand.double() >= 256
    else:
        rand = torch.rand(n, generator=gen)
        up = rand.double() < f
    mag = torch.where(up, hi, lo).clamp(max=top)  # saturation after rounding
    expected = torch.where(x < 0, -mag, mag)
    out = FORMATS[name](x, "stochastic", rand, sr_mode)
    bad = (out.double() != expected).nonzero().flatten()
    assert bad.numel() == 0, list(zip(x[bad[:5]].tolist(), out[bad[:5]].tolist(), expected[bad[:5]].tolist()))


def test_s2f6_sr_never_minus_128():
    x = torch.full((256,), -2.0)
    c = encode_s2f6(x, "stochastic", ALL_R, "hardware")
    assert bool((c == -127).all())
    x = torch.full((256,), -127.5 / 64)
    c = encode_s2f6(x, "stochastic", ALL_R, "hardware")
    assert bool((c == -127).all())


@pytest.mark.parametrize("case", INTERVALS, ids=_ids)
def test_exact_sr_is_unbiased(case):
    name, lo = case
    lo, hi = _neighbours(name, lo)
    ulp = hi - lo
    gen = torch.Generator().manual_seed(2024)
    fracs = torch.tensor([0.1, 0.37, 0.5, 0.77, 0.9, 1 / 3, 0.01], dtype=torch.float64)
    x = (lo + fracs * ulp).float()
    f = (x.double() - lo) / ulp  # the actual fractional positions of the FP32 inputs
    n = 20_000
    xs = x.unsqueeze(0).expand(n, x.numel())
    u = torch.rand(xs.shape, generator=gen)
    out = FORMATS[name](xs, "stochastic", u, "exact")
    assert set(out.unique().tolist()) <= {lo, hi}
    mean = out.double().mean(dim=0)
    sigma = ulp * torch.sqrt(f * (1 - f) / n)
    assert bool(((mean - x.double()).abs() <= 4 * sigma).all()), ((mean - x.double()) / sigma).tolist()
    # negative inputs are rounded by magnitude: the mirror image
    outn = FORMATS[name](-xs, "stochastic", u, "exact")
    assert torch.equal(outn, -out)


@pytest.mark.parametrize("name, lo", [("e2m1", 2.0), ("e4m3", 1.0), ("e5m2", 2.0 ** -14), ("s2f6", 0.5)])
def test_hardware_sr_bias_with_random_bits(name, lo):
    """With random bits hardware SR has a bias of -(256 f - floor(256 f))/256 ulp: -1/512 ulp on
    average over f; exact mode has none. 4 sigma bounds on a few million samples."""
    lo, hi = _neighbours(name, lo)
    ulp = hi - lo
    # f = (i + 0.5)/4096: inside each 1/256 cell the offsets average 1/512 exactly
    f = (torch.arange(4096, dtype=torch.float64) + 0.5) / 4096
    x = (lo + f * ulp).float()
    assert torch.equal(x.double(), lo + f * ulp)
    reps = 1024
    gen = torch.Generator().manual_seed(5)
    xs = x.unsqueeze(0).expand(reps, x.numel())

    r = torch.randint(0, 256, xs.shape, generator=gen, dtype=torch.uint8)
    out = FORMATS[name](xs, "stochastic", r, "hardware")
    err = (out.double() - xs.double()).mean().item() / ulp
    p = torch.floor(256 * f) / 256
    sigma = math.sqrt((p * (1 - p)).sum().item() * reps) / (reps * x.numel())
    assert abs(err - (-1 / 512)) <= 4 * sigma, (err, sigma)
    assert err < -1 / 1024  # clearly biased: 1/512 is > 8 sigma

    u = torch.rand(xs.shape, generator=gen)
    out = FORMATS[name](xs, "stochastic", u, "exact")
    err = (out.double() - xs.double()).mean().item() / ulp
    sigma = math.sqrt((f * (1 - f)).sum().item() * reps) / (reps * x.numel())
    assert abs(err) <= 4 * sigma + 2.0 ** -24, (err, sigma)


def test_round_magnitude_directly():
    # the primitive the formats share: non-negative input, same semantics
    x = torch.tensor([2.25]).expand(256)
    out = round_magnitude(x, E2M1, "stochastic", ALL_R, "hardware")
    assert (out == 3.0).sum().item() == 64 and (out == 2.0).sum().item() == 192
    u = torch.linspace(0, 1 - 2.0 ** -24, 256)
    out = round_magnitude(x, E2M1, "stochastic", u, "exact")
    assert set(out.unique().tolist()) == {2.0, 3.0}
    assert out[0].item() == 3.0 and out[-1].item() == 2.0  # up iff u < f


def test_encode_e2m1_stochastic_codes():
    x = torch.tensor([2.25, -2.25]).unsqueeze(0).expand(256, 2)
    c = encode_e2m1(x, "stochastic", ALL_R.unsqueeze(1).expand(256, 2), "hardware")
    assert set(c[:, 0].tolist()) == {4, 5} and set(c[:, 1].tolist()) == {12, 13}
    assert decode_e2m1(c).double().mean(dim=0).tolist() == [2.25, -2.25]


# --------------------------------------------------------------------------------------------
# Through the quantizers: determinism and the spec's 4.5 example
# --------------------------------------------------------------------------------------------

SR_SPECS = [
    bs.NVFP4(rounding="stochastic"),
    bs.NVFP4(rounding="stochastic", sr_mode="exact"),
    bs.NVFP4(scale_rule="4over6", rounding="stochastic"),
    bs.MX("e4m3", rounding="stochastic"),
    bs.MX("e5m2", rounding="stochastic", sr_mode="exact"),
    bs.MX("e2m1", rounding="stochastic"),
    bs.S2F6(rounding="stochastic"),
    bs.S2F6(hadamard=False, rounding="stochastic", sr_mode="exact"),
]


def _codes_bytes(q):
    c = q.codes
    return c.view(torch.uint8) if c.dtype != torch.uint8 else c


@pytest.mark.parametrize("spec", SR_SPECS, ids=lambda s: repr(s))
def test_sr_quantize_is_deterministic_given_generator(spec):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    with bs.use_backend("reference"):
        a = bs.quantize(x, spec, generator=torch.Generator().manual_seed(123))
        b = bs.quantize(x, spec, generator=torch.Generator().manual_seed(123))
        c = bs.quantize(x, spec, generator=torch.Generator().manual_seed(124))
    assert torch.equal(_codes_bytes(a), _codes_bytes(b))
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert not torch.equal(_codes_bytes(a), _codes_bytes(c))
    if not (isinstance(spec, bs.NVFP4) and spec.scale_rule == "4over6"):
        # block scales come from the block amax alone, not from the random bits
        # (4/6 picks its candidate by the stochastically rounded error, so it may differ)
        assert torch.equal(a.scales.view(torch.uint8), c.scales.view(torch.uint8))


def test_nvfp4_spec_example_4_5_in_block_with_scale_2():
    """4.5 in a block with scale 2 -> 2.25 -> E2M1 2 w.p. 3/4, 3 w.p. 1/4 (mean 4.5)."""
    rows = 256
    x = torch.full((rows, 16), 4.5)
    pos12 = torch.arange(rows) % 16  # block amax 12 at a varying position, 4.5 everywhere else
    x[torch.arange(rows), pos12] = 12.0
    x[1::2] *= -1  # half the rows negative
    spec = bs.NVFP4(outer=2688.0, rounding="stochastic")  # S = 2688/2688 = 1
    mask45 = torch.ones(rows, 16, dtype=torch.bool)
    mask45[torch.arange(rows), pos12] = False
    neg_row = (torch.arange(rows) % 2 == 1).unsqueeze(1).expand(rows, 16)

    n_low = n_total = 0
    deq_sum = 0.0
    with bs.use_backend("reference"):
        for seed in range(8):
            q = bs.quantize(x, spec, generator=torch.Generator().manual_seed(seed))
            assert q.outer_scale.item() == 1.0
            assert torch.equal(q.scales.float(), torch.full((rows, 1), 2.0))
            codes = unpack_nibbles(q.codes)
            assert codes.shape == (rows, 16)
            mag = codes & 7
            sgn = codes >> 3
            assert torch.equal(sgn.bool(), neg_row)
            assert bool((mag[~mask45] == 7).all())  # 12 / 2 = 6 exactly, never rounded
            m = mag[mask45]
            assert set(m.unique().tolist()) <= {4, 5}  # E2M1 indices of 2.0 and 3.0
            n_low += int((m == 4).sum())
            n_total += m.numel()
            deq = q.dequantize()
            assert torch.equal(decode_e2m1(codes) * 2.0, deq)
            deq_sum += deq.abs()[mask45].double().sum().item()
    p = 0.75
    freq = n_low / n_total
    assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / n_total), freq
    mean = deq_sum / n_total
    sigma = 2.0 * math.sqrt(p * (1 - p) / n_total)  # values 4 or 6
    assert abs(mean - 4.5) <= 4 * sigma, mean


def test_nvfp4_spec_example_hardware_mode_position_by_position():
    """Each position of the block gets its own random bits: every position sees both outcomes."""
    rows = 4096
    x = torch.full((rows, 16), 4.5)
    x[:, 0] = 12.0
    with bs.use_backend("reference"):
        q = bs.quantize(x, bs.NVFP4(outer=2688.0, rounding="stochastic"), generator=torch.Generator().manual_seed(99))
    codes = unpack_nibbles(q.codes)[:, 1:]
    p_hat = (codes == 4).double().mean(dim=0)  # per position, 4095 samples each
    bound = 4 * math.sqrt(0.75 * 0.25 / rows)
    assert bool(((p_hat - 0.75).abs() <= bound).all()), p_hat.tolist()
