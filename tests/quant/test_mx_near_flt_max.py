"""MX "ceil" near FLT_MAX (../shared/spec/numerics.md, MX section): the scale exponent keeps the
unsaturated rule and elements are saturated to the largest element v with v * 2**k <= FLT_MAX, so
finite inputs give finite outputs: exact codes and scales, RNE and both SR modes, the same bits from
the eager reference, the compiled path and the Triton kernels (the fused NVFP4 -> MX transposed one
too) and the wire codec; every other block is unchanged (outputs pinned from the code before the
rule changed).

The Triton checks run the kernels under Triton's interpreter on CPU (``triton_interpreter``); if triton
was imported without it, ``test_triton_checks_in_a_fresh_interpreter`` reruns them in a fresh process.
"""
import hashlib
import math
import os
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction

import pytest
import torch

try:  # sets TRITON_INTERPRET before triton is imported; the non-Triton tests need no triton
    import triton_interpreter as TI
except pytest.skip.Exception:
    TI = None

import blockscale as bs  # noqa: E402
from blockscale.formats.fp8 import FP8_FORMATS  # noqa: E402
from blockscale.formats.minifloat import E2M1, mul_pow2, round_to_format  # noqa: E402
from blockscale.formats.ue8m0 import scale_exponent_ceil  # noqa: E402
from blockscale.quant.transforms import requantize_transposed as fused  # noqa: E402
from blockscale.quant.blocking import random_from_bits  # noqa: E402
from blockscale.quant.dispatch import quantize_with_values  # noqa: E402
from blockscale.quant.mx import element_limit, quantize_mx  # noqa: E402
from blockscale.quant.transforms.wire import decode_rows, emulate, encode_rows  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

FLT_MAX = torch.finfo(torch.float32).max
ELEMENTS = ("e4m3", "e5m2", "e2m1")
MAX_ELEM = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}  # floor(log2 max_elem)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.float().view(torch.int32)


def _triton():
    """Skip unless the Triton kernels can run in this process (under the interpreter without a GPU)."""
    if TI is None:
        pytest.skip("triton is not installed")
    if TI.RERUN:
        pytest.skip("runs in test_triton_checks_in_a_fresh_interpreter (triton imported without the interpreter)")
    return TI.DEV


def test_triton_checks_in_a_fresh_interpreter(request):
    if TI is None or not TI.RERUN:
        pytest.skip("this process runs the Triton checks itself (or triton is not installed)")
    root = os.path.dirname(os.path.dirname(str(request.path)))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(request.path),
                          "-k", "triton"], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-6000:] + out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# MX "ceil" near FLT_MAX (spec, MX section): k is the unsaturated rule clamp(ceil(log2(amax /
# max_elem)), -127, 127); after rounding, |v| is saturated to v_lim(k), the largest element with
# v_lim * 2**k <= FLT_MAX = (2 - 2**-23) * 2**127, i.e. min(max_elem, (2 - 2**-m) * 2**(127 - k)).

def _grid(element: str) -> list:
    """Every non-negative finite element value, exactly."""
    if element == "e2m1":
        return [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
    m, emin, top = {"e4m3": (3, -6, 448), "e5m2": (2, -14, 57344)}[element]
    out = [Fraction(j, 2**m) * Fraction(2) ** emin for j in range(2**m)]  # zero and subnormals
    e = emin
    while Fraction(2) ** e <= top:
        out += [v for j in range(2**m) if (v := (1 + Fraction(j, 2**m)) * Fraction(2) ** e) <= top]
        e += 1
    return out


@pytest.mark.parametrize("element", ELEMENTS)
def test_element_limit_is_the_largest_element_below_flt_max(element):
    grid = _grid(element)
    assert max(grid) == MAX_ELEM[element] and len(grid) == {"e4m3": 127, "e5m2": 124, "e2m1": 8}[element]
    ks = torch.arange(-127, 128, dtype=torch.int32)
    want = [float(max(v for v in grid if v * Fraction(2) ** k <= Fraction(FLT_MAX))) for k in ks.tolist()]
    assert element_limit(ks, element).tolist() == want
    assert element_limit(ks.reshape(5, 51, 1), element).reshape(-1).tolist() == want  # per-block shape
    # below k = 128 - emax_elem (120 / 113 / 126) v_lim = max_elem: nothing changes; from there on it
    # is the top of binade 127 - k, (2 - 2**-m) * 2**(127 - k)
    first = 128 - EMAX[element]
    assert want[:first + 127] == [MAX_ELEM[element]] * (first + 127)
    assert want[first + 127:] == {
        "e4m3": [240.0, 120.0, 60.0, 30.0, 15.0, 7.5, 3.75, 1.875],  # k = 120..127: 1.875 * 2**(127 - k)
        "e5m2": [28672.0 / 2**j for j in range(15)],                  # k = 113..127: 1.75 * 2**(127 - k)
        "e2m1": [3.0, 1.5],                                            # k = 126, 127: 1.5 * 2**(127 - k)
    }[element]


def _near_flt_max() -> torch.Tensor:
    """Three blocks: amax FLT_MAX (with 3.3e38, -3.26e38, 3.0e38, 1, -0, 0); amax just above
    edge = 1.75 * 2**127 = 448 * 2**119 = 57344 * 2**112 (with -1); amax exactly -edge (with 2)."""
    first = [FLT_MAX, -FLT_MAX, 3.3e38, -3.26e38, 3.0e38, 1.0, -0.0, 0.0] + [0.0] * 24
    edge = 1.75 * 2.0**127
    above = torch.nextafter(torch.tensor(edge), torch.tensor(math.inf)).item()  # edge * (1 + 2**-23)
    second = [above, -1.0] + [0.0] * 30
    third = [-edge, 2.0] + [0.0] * 30
    return torch.tensor([first + second + third], dtype=torch.float32)


# Worked by hand (2**120 = 1.329e36, 2**113 = 1.038e34, 2**126 = 8.507e37):
# E4M3: FLT_MAX / 448 = 1.14 * 2**119 -> k = 120 (b = 247), v_lim = 1.875 * 2**7 = 240 (0x77).
#   FLT_MAX * 2**-120 = 255.99998 -> 256 -> 240 (0x77); 3.3e38 -> 248.26 -> 256 -> 240; -3.26e38 ->
#   -245.25 -> -240 (0xF7, no saturation needed); 3.0e38 -> 225.69 -> 224 (1.75 * 2**7: 0x76);
#   1.0 * 2**-120 -> 0; -0.0 -> 0x80. Block 2: above / 448 > 2**119 -> k = 120; above * 2**-120 =
#   224.00003 -> 224 (0x76); -1.0 -> -0 (0x80). Block 3: edge / 448 = 2**119 -> k = 119 (b = 246),
#   -edge -> -448 (0xFE, v_lim = max_elem); 2.0 * 2**-119 -> 0.
# E5M2: FLT_MAX / 57344 -> k = 113 (b = 240), v_lim = 1.75 * 2**14 = 28672 (0x77: exponent 14 + 15 =
#   0b11101, mantissa 0b11). FLT_MAX -> 32767.998 -> 32768 -> 28672; 3.3e38 -> 31777.8 -> 32768 ->
#   28672; -3.26e38 -> -31392.6 -> -28672 (0xF7); 3.0e38 -> 28888.9 -> 28672. Block 2: k = 113,
#   28672.003 -> 28672 (0x77). Block 3: k = 112 (b = 239), -edge -> -57344 (0xFB).
# E2M1: FLT_MAX / 6 = 1.33 * 2**125 -> k = 126 (b = 253), v_lim = 1.5 * 2**1 = 3 (index 5).
#   FLT_MAX -> 3.99999 -> 4 -> 3; 3.3e38 -> 3.879 -> 4 -> 3; -3.26e38 -> -3.832 -> -3 (0xD); 3.0e38 ->
#   3.527 -> 4 -> 3; 1.0 -> 0; -0.0 -> 8. Block 2: above / 6 = 1.17 * 2**125 -> k = 126: 3.5000004 ->
#   4 -> 3; -1.0 -> -0 (8). Block 3: k = 126 too: -3.5 -> tie, to even -> -4 -> -3 (0xD); 2.0 -> 0.
#   Nibbles pack element 2i low, 2i+1 high: 0xD5 0xD5 0x05 0x08 | 0x85 | 0x0D.
SCALES = {"e4m3": [247, 247, 246], "e5m2": [240, 240, 239], "e2m1": [253, 253, 253]}
CODES = {  # (block 1 first 8 codes, block 2 first 2, block 3 first 2); the rest are 0
    "e4m3": ([0x77, 0xF7, 0x77, 0xF7, 0x76, 0x00, 0x80, 0x00], [0x76, 0x80], [0xFE, 0x00]),
    "e5m2": ([0x77, 0xF7, 0x77, 0xF7, 0x77, 0x00, 0x80, 0x00], [0x77, 0x80], [0xFB, 0x00]),
    "e2m1": ([0xD5, 0xD5, 0x05, 0x08], [0x85], [0x0D]),
}
P = 2.0**127
VALUES = {  # x^ = v * 2**k of the same elements, in units of 2**127
    "e4m3": ([1.875, -1.875, 1.875, -1.875, 1.75, 0.0, -0.0, 0.0], [1.75, -0.0], [-1.75, 0.0]),
    "e5m2": ([1.75, -1.75, 1.75, -1.75, 1.75, 0.0, -0.0, 0.0], [1.75, -0.0], [-1.75, 0.0]),
    "e2m1": ([1.5, -1.5, 1.5, -1.5, 1.5, 0.0, -0.0, 0.0], [1.5, -0.0], [-1.5, 0.0]),
}


def _expected_codes(element: str) -> list:
    width = 16 if element == "e2m1" else 32
    out = []
    for part in CODES[element]:
        out += part + [0] * (width - len(part))
    return out


@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_ceil_near_flt_max_exact_codes_and_scales(element):
    x = _near_flt_max()
    with bs.use_backend("reference"):
        q, v = quantize_with_values(x, bs.MX(element))
        d = q.dequantize()
        f = bs.fake_quantize(x, bs.MX(element))
    assert q.scales.tolist() == [SCALES[element]]
    assert _bits(q.codes)[0].tolist() == _expected_codes(element)
    for got in (v, d, f):
        assert torch.isfinite(got).all() and torch.equal(_bits(got), _bits(v))
    want = torch.zeros(96)
    for start, part in zip((0, 32, 64), VALUES[element]):
        want[start:start + len(part)] = torch.tensor(part) * P
    assert torch.equal(_bits(v[0]), _bits(want))  # -0.0 kept where the input was -0.0 or rounded to 0
    if element == "e4m3":  # the spec's example: amax = FLT_MAX, E4M3, ceil: 255.99 -> 256 -> 240
        assert q.codes[0, 0].item() == 240.0 and q.scales[0, 0] == 127 + 120


@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_ceil_scale_bytes_are_the_unsaturated_rule(element):
    """The scale exponent is not capped: amax in (max_elem * 2**(127 - emax), FLT_MAX] keeps
    k = ceil(log2(amax / max_elem)) (E4M3 120, E5M2 113, E2M1 126 at FLT_MAX)."""
    amax = torch.tensor([2.0**127, 1.75 * 2**127, 1.5 * 2**127, 3.0e38, FLT_MAX])
    x = torch.zeros(5, 32)
    x[:, 7] = amax
    q = bs.quantize(x, bs.MX(element))
    want = {"e4m3": [119, 119, 119, 120, 120], "e5m2": [112, 112, 112, 113, 113],
            "e2m1": [125, 126, 125, 126, 126]}[element]  # 2**127 / 448 = 1.14 * 2**118 -> 119, ...
    assert q.scales.reshape(-1).tolist() == [127 + k for k in want]
    assert torch.isfinite(q.dequantize()).all()


def _round_unsaturated(x, element, rounding, sr_mode, bits):
    """x^ of the rule without the FLT_MAX saturation (peers' behaviour; may be inf), and v_lim * 2**k."""
    xb = x.reshape(x.shape[0], -1, 32)
    k = scale_exponent_ceil(xb.abs().amax(-1, keepdim=True), MAX_ELEM[element])
    rand = None if bits is None else random_from_bits(bits, xb.shape, sr_mode)
    fmt = E2M1 if element == "e2m1" else FP8_FORMATS[element]
    v = round_to_format(mul_pow2(xb, -k), fmt, rounding, rand, sr_mode)
    scale = 2.0 ** k.double()  # exact; v * scale in float64 may exceed FLT_MAX
    lim = element_limit(k, element).double() * scale
    return (v.double() * scale).reshape(x.shape), lim.expand_as(xb).reshape(x.shape)


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("rounding, sr_mode", [("nearest", "hardware"), ("stochastic", "hardware"),
                                               ("stochastic", "exact")])
def test_mx_ceil_near_flt_max_saturates_only_what_would_overflow(element, rounding, sr_mode):
    """Blocks holding ±FLT_MAX and random values of up to 1e38 .. FLT_MAX (RNE and both SR modes, the
    same draws): x^ is the unsaturated rule's value clamped to ±v_lim(k) * 2**k: finite, and unchanged
    wherever that was <= FLT_MAX."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(64, 256, generator=g, dtype=torch.float64) * 2 - 1
    x = (x / x.abs().amax(-1, keepdim=True) * torch.linspace(1e38, FLT_MAX, 64, dtype=torch.float64)[:, None]).float()
    x[:, ::32] = torch.where(torch.arange(64) % 2 == 0, FLT_MAX, -FLT_MAX)[:, None]  # a FLT_MAX in every block
    bits = None
    if rounding == "stochastic":
        bits = torch.randint(-2**31, 2**31, (64 * 256,), generator=g, dtype=torch.int64)
    with bs.use_backend("reference"):
        q, v = quantize_mx(x, bs.MX(element, rounding=rounding, sr_mode=sr_mode), outputs="both", rand_bits=bits)
    free, lim = _round_unsaturated(x, element, rounding, sr_mode, bits)
    assert torch.isfinite(v).all() and torch.isfinite(q.dequantize()).all()
    assert torch.equal(v.double(), torch.maximum(torch.minimum(free, lim), -lim))
    overflowed = free.abs() > FLT_MAX
    assert overflowed.any() and (v[overflowed].abs().double() == lim[overflowed]).all()


def _all_paths_equal(x, spec, backends, fake=True, seed=None):
    gen = (lambda: torch.Generator().manual_seed(seed)) if seed is not None else (lambda: None)
    with bs.use_backend("reference"):
        q, v = quantize_with_values(x, spec, generator=gen())
        d = q.dequantize()
    assert torch.isfinite(v).all() and torch.isfinite(d).all()
    for backend in backends:
        xb = x.to(TI.DEV) if backend == "triton" else x
        with bs.use_backend(backend):
            qb, vb = quantize_with_values(xb, spec, generator=gen())
            db = qb.dequantize()
            fb = bs.fake_quantize(xb, spec, generator=gen()) if fake else vb
        assert torch.equal(_bits(qb.codes.cpu()), _bits(q.codes)), backend
        assert torch.equal(qb.scales.cpu(), q.scales), backend
        for got in (vb, db, fb):
            assert torch.equal(_bits(got.cpu()), _bits(v)), backend
    assert torch.equal(_bits(d), _bits(v))


@pytest.mark.parametrize("element, rounding, sr_mode", [(e, "nearest", "hardware") for e in ELEMENTS]
                         + [("e4m3", "stochastic", "exact")])  # each case one more compiled variant
def test_mx_ceil_near_flt_max_compiled_equals_reference(element, rounding, sr_mode):
    x = _near_flt_max().repeat(4, 1) * torch.tensor([1.0, 0.99, 0.97, 0.9]).unsqueeze(1)
    _all_paths_equal(x, bs.MX(element, rounding=rounding, sr_mode=sr_mode), ["compiled"], fake=False, seed=3)


@pytest.mark.parametrize("element", ELEMENTS)
def test_triton_mx_ceil_near_flt_max_equals_reference(element):
    _triton()
    x = _near_flt_max().repeat(2, 1)
    _all_paths_equal(x, bs.MX(element), ["triton"])
    _all_paths_equal(x.T.contiguous(), bs.MX(element, dim=0), ["triton"])  # the strided kernel


def _random_bits(n: int, seed: int) -> torch.Tensor:
    """The Triton kernels' Philox draws for counters 0 .. n-1 (``mx_triton.random_bits``), on the CPU."""
    from blockscale.quant.triton_kernels import mx_triton as mt

    return mt.random_bits(n, seed, 0, TI.DEV).cpu()


def _sr_inputs() -> torch.Tensor:
    return _near_flt_max().repeat(8, 1) * torch.linspace(0.95, 1.0, 8).unsqueeze(1)


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("sr_mode", ["hardware", "exact"])
def test_triton_mx_ceil_near_flt_max_stochastic_rounding_equals_reference(element, sr_mode):
    """The rows and strided kernels' Philox draws, fed to the reference through rand_bits."""
    _triton()
    from blockscale.quant.triton_kernels import mx_triton as mt

    spec = bs.MX(element, rounding="stochastic", sr_mode=sr_mode)
    x = _sr_inputs()  # [8, 96]; the strided kernel reads x.T [96, 8] along dim 0: the same [8, 96] layout
    bits = _random_bits(x.numel(), 11)
    with bs.use_backend("reference"):
        q, v = quantize_mx(x, spec, outputs="both", rand_bits=bits)
        qt, vt = quantize_mx(x.T.contiguous(), replace(spec, dim=0), outputs="both", rand_bits=bits)
    assert torch.equal(_bits(qt.codes), _bits(q.codes)) and torch.isfinite(v).all()
    rows = mt.quantize_mx_rows(x.to(TI.DEV), spec, 11, 0, want_values=True)
    cols = mt.quantize_mx_strided(x.T.contiguous().unsqueeze(0).to(TI.DEV), spec, 11, 0, want_values=True)
    for got, (qq, vv) in ((rows, (q, v)), (cols, (qt, vt.T))):
        codes, scales, values = (t.cpu() for t in got)
        assert torch.equal(codes, _bits(qq.codes)) and torch.equal(scales, qq.scales)
        assert torch.equal(_bits(values), _bits(vv))


def test_triton_mx_ceil_near_flt_max_rows_cols_kernel():
    _triton()
    from blockscale.quant.triton_kernels import mx_triton as mt

    x = torch.cat([_near_flt_max()[:, :64]] * 32) * torch.linspace(0.9, 1.0, 32).unsqueeze(1)  # [32, 64]
    Kp = 64  # rows layout [32, 64], cols layout [64, 32]: SR counters m*Kp + k, then 32*Kp + k*32 + m
    for element in ELEMENTS:
        for rounding, sr_mode in (("nearest", "hardware"), ("stochastic", "hardware"), ("stochastic", "exact")):
            spec_r = bs.MX(element, rounding=rounding, sr_mode=sr_mode)
            spec_c = replace(spec_r, dim=0)
            bits = _random_bits(32 * Kp + 64 * 32, 5)
            (rc, rs, rv), (cc, cs, cv) = (tuple(t.cpu() for t in part) for part in mt.quantize_mx_rows_cols(
                x.to(TI.DEV), spec_r, spec_c, 5, 0, want_values=True))
            with bs.use_backend("reference"):
                qr, vr = quantize_mx(x, spec_r, outputs="both", rand_bits=bits[:32 * Kp])
                qc, vc = quantize_mx(x, spec_c, outputs="both", rand_bits=bits[32 * Kp:])
            assert torch.equal(rc, _bits(qr.codes)) and torch.equal(rs, qr.scales), (element, rounding, sr_mode)
            assert torch.equal(cc, _bits(qc.codes)) and torch.equal(cs, qc.scales), (element, rounding, sr_mode)
            assert torch.equal(_bits(rv), _bits(vr)) and torch.equal(_bits(cv.T), _bits(vc))
            assert torch.isfinite(rv).all() and torch.isfinite(cv).all()


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding, sr_mode", [("nearest", "hardware"), ("stochastic", "hardware"),
                                               ("stochastic", "exact")])
def test_triton_fused_nvfp4_to_mx_transposed_near_flt_max(element, rounding, sr_mode):
    """NVFP4 values near FLT_MAX (amax FLT_MAX: x^ up to 6 * 448 / S) requantized to MX of the transpose."""
    _triton()
    from blockscale.quant.triton_kernels.requantize_transposed_triton import nvfp4_to_mx_t

    x = torch.cat([_near_flt_max()[:, :64]] * 32)  # [32, 64] -> MX of the [64, 32] transpose
    spec = bs.MX(element, rounding=rounding, sr_mode=sr_mode)
    with bs.use_backend("reference"):
        q = bs.quantize(x, bs.NVFP4())
    bits = _random_bits(64 * 32, 13)  # one per element of the [K = 64, Mp = 32] output
    want, wv = fused.nvfp4_to_mx_transposed_reference(q, spec, rand_bits=bits, outputs="both")
    assert torch.isfinite(wv).all()
    assert want.scales[0, 0] == {"e4m3": 247, "e5m2": 240}[element]  # amax ~FLT_MAX: k = 120 / 113
    qd = q.to(TI.DEV)
    inv_s = 1.0 / qd.outer_scale  # one per-tensor outer scale (a 0-d tensor)
    codes, scales, values = (t.cpu() for t in nvfp4_to_mx_t(
        qd.codes, qd.scales, inv_s, 64, element, "ceil", rounding, sr_mode, 13, 0, True, True))
    assert torch.equal(_bits(codes), _bits(want.codes)) and torch.equal(scales, want.scales)
    assert torch.equal(_bits(values), _bits(wv))
    if rounding == "nearest":
        with bs.use_backend("triton"):
            assert fused.fused_supported(qd, spec)
            got, gv = fused.nvfp4_to_mx_transposed(qd, spec, outputs="both")
        assert torch.equal(_bits(got.codes.cpu()), _bits(want.codes)) and torch.equal(_bits(gv.cpu()), _bits(wv))


def test_wire_mxfp8_near_flt_max_is_finite():
    x = _near_flt_max()
    out = decode_rows(encode_rows(x, "mxfp8"), "mxfp8", x.shape[1])
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == 1.875 * P and out[0, 1].item() == -1.875 * P  # E4M3: 240 * 2**120
    assert torch.equal(_bits(out), _bits(emulate(x, "mxfp8")))


LIMIT = {"e4m3": 448.0 * 2.0**119, "e5m2": 57344.0 * 2.0**112, "e2m1": 6.0 * 2.0**125}


def _wide(element: str, seed: int = 12) -> torch.Tensor:
    """Random blocks from FP32 subnormals to 4e37, zeros, -0.0, powers of two, and blocks at
    max_elem * 2**(127 - emax_elem), the largest amax whose "ceil" k leaves v_lim = max_elem
    (``LIMIT``; 1e36 for S2F6), and just below it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 320, generator=g) * torch.logspace(-44, 37, 320)
    x[0, :40] = 0.0
    x[1, 5] = -0.0
    x[2, 32:64] = torch.tensor([1e-38, -1e-39, 1e-44, -1.4e-45] + [0.0] * 28)
    x[3, :32] = 2.0 ** torch.arange(-16, 16).float()
    lim = LIMIT.get(element, 1e36)
    x[4, 64:96] = lim
    x[5, 96:128] = -lim
    x[6, 128:160] = lim * torch.linspace(-1.0, 1.0, 32)
    x[7, 160:192] = torch.nextafter(torch.tensor(lim), torch.tensor(0.0))
    return x


def _digest(q, v) -> str:
    h = hashlib.sha256()
    for t in (q.codes, q.scales, v):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# sha256 (first 16 hex digits) of codes, scale bytes and FP32 values from the code before the
# saturation rule (blocks along dim -1, then dim 0), on ``_wide`` inputs
PINNED_MX = {
    "e4m3-ceil-nearest-hardware": ("ec33898a11ddae1f", "0cf986703ea8cb3a"),
    "e4m3-ceil-stochastic-hardware": ("687d3782c12379b0", "a9af92da4ebfbd07"),
    "e4m3-ceil-stochastic-exact": ("c6742d4733f4ec79", "133f7a50965fbb81"),
    "e4m3-floor-nearest-hardware": ("14828ec6820e060a", "6a2022129f006393"),
    "e4m3-floor-stochastic-hardware": ("0029fba10c0d3e4e", "3130ed99b69e7ebb"),
    "e4m3-floor-stochastic-exact": ("73b368d6a26fe002", "017406fba036df44"),
    "e5m2-ceil-nearest-hardware": ("c1157d10c68b9530", "3447e596504935a5"),
    "e5m2-ceil-stochastic-hardware": ("9d925b27162062fc", "8e4b81503acd5bd2"),
    "e5m2-ceil-stochastic-exact": ("b5d1c404271438a0", "0980e0d194f948c6"),
    "e5m2-floor-nearest-hardware": ("8610fa4db47e671a", "afed4bdf0083b359"),
    "e5m2-floor-stochastic-hardware": ("eb47ced5fec509af", "f1526ae32376619c"),
    "e5m2-floor-stochastic-exact": ("469023bbbb14867d", "6e82fbaa552ec138"),
    "e2m1-ceil-nearest-hardware": ("3e7ea39f3f2a3839", "c31f79fa85ad1340"),
    "e2m1-ceil-stochastic-hardware": ("a13361931eca5b4a", "6182955e46d83785"),
    "e2m1-ceil-stochastic-exact": ("d36d709f4f1ce208", "1513de5dd80d48a7"),
    "e2m1-floor-nearest-hardware": ("50b9f35fceb052b1", "d13ad20453498afa"),
    "e2m1-floor-stochastic-hardware": ("8b3ac69a4630335f", "c892556c16785888"),
    "e2m1-floor-stochastic-exact": ("88c495630876794b", "7d00e15f6d6821cf"),
}
PINNED_S2F6 = {"False-ceil": "8b61b31c985e81d8", "False-floor": "e956734048240977",
               "True-ceil": "ba884ea550a687af", "True-floor": "3450a7bb3085b254"}


@pytest.mark.parametrize("key", sorted(PINNED_MX))
def test_mx_in_range_outputs_unchanged(key):
    element, rule, rounding, sr_mode = key.split("-")
    x = _wide(element)
    got = []
    for dim in (-1, 0):
        with bs.use_backend("reference"):
            q, v = quantize_with_values(x, bs.MX(element, rule, rounding, sr_mode, dim),
                                        generator=torch.Generator().manual_seed(5))
        got.append(_digest(q, v))
    assert tuple(got) == PINNED_MX[key]


@pytest.mark.parametrize("key", sorted(PINNED_S2F6))
def test_s2f6_outputs_unchanged(key):
    hadamard, rule = key.split("-")
    x = _wide("s2f6")
    x = x.clamp(-1e36, 1e36) if hadamard == "True" else x
    with bs.use_backend("reference"):
        q = bs.quantize(x, bs.S2F6(hadamard=hadamard == "True", scale_rule=rule))
        v = q.dequantize()
    assert _digest(q, v) == PINNED_S2F6[key]
