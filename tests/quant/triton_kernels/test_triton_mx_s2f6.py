"""Triton MX (MXFP8 / MXFP4) and S2F6 (+ 32-point RHT) kernels == the PyTorch reference, bit for bit.

Same setup as ``test_triton_kernels.py``: without a GPU the kernels run on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1 set before ``import triton``); if triton was already imported without
it, the file reruns itself in a fresh interpreter. With CUDA the same checks run on the GPU.
"""
import math

import pytest
import torch

import triton_interpreter  # noqa: E402  (sets TRITON_INTERPRET before triton is imported)
from triton_interpreter import DEV, tl, triton  # noqa: E402

import blockscale as bs  # noqa: E402
from blockscale.formats.ue8m0 import scale_exponent_ceil, scale_exponent_floor  # noqa: E402
from blockscale.quant import mx as mx_ref  # noqa: E402
from blockscale.quant import s2f6 as s2f6_ref  # noqa: E402
from blockscale.quant.dispatch import quantize_with_values  # noqa: E402
from blockscale.quant.transforms.hadamard import (hadamard, hadamard_gemm, inverse_rht_blocks, random_signs,  # noqa: E402
                                       rht_blocks)
from blockscale.quant.blocking import triton_seed  # noqa: E402
from blockscale.quant.triton_kernels import mx_triton as mt  # noqa: E402
from blockscale.quant.triton_kernels import s2f6_triton as st  # noqa: E402


# dequantizing arbitrary code / scale bytes may overflow to inf exactly as in the reference (e.g. an
# E4M3 code 448 with b = 254); the interpreter's numpy then warns
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")]

ELEMENTS = ["e4m3", "e5m2", "e2m1"]
MODES = [("nearest", "hardware"), ("stochastic", "hardware"), ("stochastic", "exact")]


_skip_when_rerun = triton_interpreter._skip_when_rerun  # autouse fixture
test_rerun_in_a_fresh_interpreter = triton_interpreter.test_rerun_in_a_fresh_interpreter


def _i32(t):
    return t.contiguous().float().view(torch.int32)


def _pad(n):
    return -(-n // 32) * 32


def _hard(rows=64, cols=100, seed=0):
    """Wide dynamic range, zero blocks, -0.0, tiny blocks next to huge ones, FP32 subnormals, K % 32 != 0."""
    g = torch.Generator().manual_seed(seed)
    R, C = max(rows, 8), max(cols, 64)
    x = torch.randn(R, C, generator=g) * torch.logspace(-30, 30, C)
    x[0, :64] = 0.0
    x[1, 7] = -0.0
    x[1, 32:64] = -0.0  # an all-negative-zero block
    x[2, :32] *= 1e-20  # tiny block next to huge ones
    x[3, 32:64] = torch.tensor([1e-38, -1e-39, 1e-44, -1.4e-45] + [0.0] * 28)  # FP32 subnormals
    x[4, :32] = torch.tensor([3e38, -1e-30] + [1.0] * 30)  # near FLT_MAX
    x[5] = x[5].to(torch.bfloat16).float()  # bf16-valued
    x[6, :32] = 2.0 ** torch.arange(-16, 16).float()
    x[:, 0] = torch.where(torch.arange(R) % 7 == 0, torch.tensor(-0.0), x[:, 0])
    return x[:rows, :cols].contiguous()


def _rotatable(x):
    """The 32-point butterfly needs |x| < FLT_MAX / 32 (S2F6 with hadamard=True refuses larger values)."""
    return x.clamp(-1e37, 1e37)


def _ties(element):
    """Rows of one block (32 values) whose "ceil" scale is exactly 2**0 (block amax = max_elem): values at
    every kind of rounding tie of the element grid (normal, subnormal, their border), both signs."""
    if element == "e4m3":
        sub = 2.0**-9
        ties = [448.0, 1.0625, 1.1875, 1.5 * sub, 0.5 * sub, 2.5 * sub, 2.0**-6 - 2.0**-10, 2.0**-6 + 2.0**-10,
                416.0, 432.0, 3.0 * 2.0**-8, 240.0, 7.5 * sub, 13.0, 2.0**-10, 2.0**-12]
    elif element == "e5m2":
        sub = 2.0**-16
        ties = [57344.0, 1.125, 1.375, 1.5 * sub, 0.5 * sub, 2.5 * sub, 2.0**-14 - 2.0**-17, 2.0**-14 + 2.0**-17,
                53248.0, 61440.0 / 2, 3.0 * 2.0**-15, 40960.0 + 4096.0, 3.5 * sub, 10.0, 2.0**-17, 2.0**-18]
    else:
        ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 1.26, 1.74, 2.6, 3.4, 5.1, 1e-30]
    row = torch.tensor(ties + [-v for v in ties], dtype=torch.float32)
    return torch.stack([row, -row, row.flip(0), row * 0.5 + 0.0])


def _saturating(element, seed=1):
    """Blocks with amax = 1.9 * 2**e: the "floor" rule maps them above the element max (saturation)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(8, 64, generator=g) * 2 - 1
    x[:, 3] = 1.9
    x[:, 40] = -1.99
    return x * torch.tensor([1.0, 2.0**40, 2.0**-60, 1.0, 2.0**-100, 2.0**100, 8.0, 0.125]).unsqueeze(1)


def _mx_ref(x, spec, bits=None):
    with bs.use_backend("reference"):
        return mx_ref.quantize_mx(x, spec, outputs="both", rand_bits=bits)


def _check_rows(x, spec, seed=0, offset=0):
    """quantize_mx_rows (+ its dequantize) vs the reference with dim=-1, bitwise."""
    R, K = x.shape
    bits = mt.random_bits(R * _pad(K), seed, offset, DEV).cpu() if spec.rounding == "stochastic" else None
    q, v = _mx_ref(x, spec, bits)
    codes, sb, values = (t.cpu() for t in mt.quantize_mx_rows(x.to(DEV), spec, seed, offset, want_values=True))
    assert torch.equal(codes, q.codes.view(torch.uint8)), "codes"
    assert torch.equal(sb, q.scales), "scales"
    assert torch.equal(_i32(values[:, :K]), _i32(v)), "values"
    deq = mt.dequantize_mx_2d(codes.to(DEV), sb.to(DEV), spec.element).cpu()
    with bs.use_backend("reference"):
        want = q.dequantize()
    assert torch.equal(_i32(deq[:, :K]), _i32(want)), "dequantize"
    return q


def _check_strided(x, spec, dim, seed=0, offset=0):
    """quantize_mx_strided on x viewed [A, D, B] vs the reference with blocks along ``dim``, bitwise."""
    shape = x.shape
    A, D = math.prod(shape[:dim]), shape[dim]
    B = x.numel() // (A * D)
    bits = mt.random_bits(A * B * _pad(D), seed, offset, DEV).cpu() if spec.rounding == "stochastic" else None
    q, v = _mx_ref(x, spec, bits)
    codes, sb, values = (t.cpu() for t in mt.quantize_mx_strided(x.reshape(A, D, B).to(DEV), spec, seed, offset,
                                                                   want_values=True))
    assert torch.equal(codes, q.codes.reshape(A * B, -1).view(torch.uint8)), "codes"
    assert torch.equal(sb, q.scales.reshape(A * B, -1)), "scales"
    want_v = v.movedim(dim, -1).reshape(A * B, D)
    assert torch.equal(_i32(values[:, :D]), _i32(want_v)), "values"
    return q


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_mx_rows_and_cols_nearest(element, rule):
    spec = bs.MX(element, rule)
    x = _hard()
    _check_rows(x, spec)
    _check_rows(x.to(torch.bfloat16), spec)  # bf16 loads: the kernel sees the same FP32 values
    _check_strided(x, bs.MX(element, rule, dim=0), 0)
    _check_strided(x[:40].clamp(-6e4, 6e4).to(torch.float16), bs.MX(element, rule, dim=0), 0)  # finite fp16
    _check_strided(x.reshape(4, 16, 100)[:, :, :50].contiguous(), bs.MX(element, rule, dim=1), 1)  # 3-D, D % 32 != 0


@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_ties_and_known_codes(element):
    x = _ties(element)
    q = _check_rows(x, bs.MX(element))
    _check_strided(x.T.contiguous(), bs.MX(element, dim=0), 0)
    assert int(q.scales[0, 0]) == 127  # block amax = max_elem: scale 2**0
    if element == "e4m3":  # 1.0625 -> 1.0 (0x38), 1.1875 -> 1.25 (0x3A), 1.5*2**-9 -> 2**-8 (0x02), 0.5*2**-9 -> 0
        assert q.codes.view(torch.uint8)[0, :5].tolist() == [0x7E, 0x38, 0x3A, 0x02, 0x00]
    elif element == "e5m2":  # 1.125 -> 1.0 (0x3C), 1.375 -> 1.5 (0x3E), 1.5*2**-16 -> 2**-15 (0x02)
        assert q.codes.view(torch.uint8)[0, :5].tolist() == [0x7B, 0x3C, 0x3E, 0x02, 0x00]
    else:  # 6, 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (nibbles, 2i low)
        assert q.codes[0, :4].tolist() == [0x07, 0x22, 0x44, 0x66]


@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_floor_rule_saturates(element):
    x = _saturating(element)
    q = _check_rows(x, bs.MX(element, "floor"))
    _check_strided(x.T.contiguous(), bs.MX(element, "floor", dim=0), 0)
    top = {"e4m3": 0x7E, "e5m2": 0x7B}.get(element)
    if top is not None:  # 1.9 * 2**e / 2**(e - emax) > max: saturated, never inf/NaN
        assert (q.codes.view(torch.uint8)[:, 3] == top).all() and (q.codes.view(torch.uint8)[:, 40] == top | 0x80).all()
    else:
        assert (q.codes[:, 1] >> 4 == 0x7).all()  # element 3: high nibble of byte 1 = +6
    _check_rows(x, bs.MX(element, "floor", "stochastic", "hardware"), seed=3)


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("rounding, sr_mode", MODES[1:])
def test_mx_stochastic_rounding_consumes_the_same_bits(element, rounding, sr_mode):
    for rule in ("ceil", "floor"):
        spec = bs.MX(element, rule, rounding, sr_mode)
        _check_rows(_hard(32, 100), spec, seed=1234)
        _check_strided(_hard(40, 64, seed=2), bs.MX(element, rule, rounding, sr_mode, dim=0), 0, seed=7,
                       offset=2**32 - 1000)  # the counter wraps mod 2**32
    x = torch.full((4, 64), 4.5) * torch.tensor([1.0, -1.0, 3.0, 1e-3]).unsqueeze(1)
    _check_rows(x, bs.MX(element, "ceil", rounding, sr_mode), seed=5)


@pytest.mark.parametrize("specs", [
    (bs.MX("e4m3"), bs.MX("e4m3", dim=0)),
    (bs.MX("e5m2", "floor"), bs.MX("e2m1", dim=0)),
    (bs.MX("e2m1", rounding="stochastic"), bs.MX("e4m3", "floor", "stochastic", "exact", dim=0)),
    (bs.MX("e4m3", rounding="stochastic", sr_mode="exact"), bs.MX("e5m2", rounding="stochastic", dim=0)),
], ids=lambda s: f"{s[0].element}-{s[0].scale_rule}-{s[0].rounding}-{s[0].sr_mode}")
@pytest.mark.parametrize("shape", [(64, 100), (50, 64), (33, 7), (1, 40)])
def test_rows_cols_one_pass_matches_two_reference_calls(specs, shape):
    spec_r, spec_c = specs
    M, K = shape
    x = _hard(max(M, 8), max(K, 64), seed=M + K)[:M, :K].contiguous()
    Mp, Kp = _pad(M), _pad(K)
    seed, offset = 9, 123
    bits = mt.random_bits(M * Kp + K * Mp, seed, offset, DEV).cpu()
    qr, vr = _mx_ref(x, spec_r, bits[:M * Kp])
    qc, vc = _mx_ref(x, spec_c, bits[M * Kp:])
    (rc, rs, rv), (cc, cs, cv) = (tuple(t.cpu() for t in part) for part in mt.quantize_mx_rows_cols(
        x.to(DEV), spec_r, spec_c, seed, offset, want_values=True))
    assert torch.equal(rc, qr.codes.view(torch.uint8)) and torch.equal(rs, qr.scales)
    assert torch.equal(_i32(rv[:, :K]), _i32(vr))
    assert torch.equal(cc, qc.codes.view(torch.uint8)) and torch.equal(cs, qc.scales)
    assert torch.equal(_i32(cv[:, :M].T), _i32(vc))
    # codes only, a transposed (strided) input view
    (rc2, rs2, rv2), (cc2, cs2, _) = mt.quantize_mx_rows_cols(x.T.contiguous().T.to(DEV), spec_r, spec_c, seed, offset)
    assert rv2 is None and torch.equal(rc2.cpu(), rc) and torch.equal(cc2.cpu(), cc) and torch.equal(cs2.cpu(), cs)


def test_dequantize_every_code_and_scale_byte():
    g = torch.Generator().manual_seed(0)
    for element in ELEMENTS:
        width = 16 if element == "e2m1" else 32
        codes = torch.arange(256, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(-1, width)
        codes = torch.cat([codes, codes.flip(0)])
        sb = torch.randint(0, 256, (codes.shape[0], 1), generator=g).to(torch.uint8)
        sb[:4, 0] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)
        q = bs.QuantizedTensor(spec=bs.MX(element), codes=codes if element == "e2m1" else
                               codes.view(mx_ref.FP8_DTYPES[element]), scales=sb,
                               shape=torch.Size((codes.shape[0], 32)), dtype=torch.float32)
        with bs.use_backend("reference"):
            want = q.dequantize()
        got = mt.dequantize_mx_2d(q.codes.to(DEV), sb.to(DEV), element).cpu()
        nan = torch.isnan(want)
        assert torch.equal(nan, torch.isnan(got))
        assert torch.equal(_i32(got)[~nan], _i32(want)[~nan])


@triton.jit
def _exponent_kernel(a_ptr, out_ptr, n, RULE: tl.constexpr, MC: tl.constexpr, EC: tl.constexpr,
                     EMAX: tl.constexpr, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    a = tl.load(a_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, mt.scale_exponent(a, RULE, MC, EC, EMAX), mask=i < n)


@pytest.mark.parametrize("max_elem, emax", [(448.0, 8), (57344.0, 15), (6.0, 2), (127 / 64, 0)])
def test_scale_exponent_matches_reference_over_the_fp32_range(max_elem, emax):
    """Integer UE8M0 exponent == the reference's FP32 ratio + corrections, for amax from 0 and FP32
    subnormals to FLT_MAX: random, powers of two, max_elem * 2**k and its FP32 neighbours."""
    g = torch.Generator().manual_seed(6)
    rnd = torch.exp2(torch.rand(2048, generator=g, dtype=torch.float64) * 277 - 149).float()
    k = torch.arange(-140, 128, dtype=torch.float64)
    edges = (max_elem * torch.exp2(k)).float()
    edges = edges[torch.isfinite(edges) & (edges > 0)]
    ints = edges.view(torch.int32)
    near = torch.cat([ints - 1, ints, ints + 1]).view(torch.float32)
    a = torch.cat([rnd, near, torch.exp2(k).float(), torch.tensor([0.0, 1.4e-45, 2.0**-127, 2.0**-126,
                                                                    3.4028234663852886e38])])
    a = a[torch.isfinite(a) & (a >= 0)]
    mc, ec = mt.max_bits(max_elem)
    for rule in ("ceil", "floor"):
        want = scale_exponent_ceil(a, max_elem) if rule == "ceil" else scale_exponent_floor(a, emax)
        out = torch.empty(a.numel(), dtype=torch.int32, device=DEV)
        _exponent_kernel[(triton.cdiv(a.numel(), 1024),)](a.to(DEV), out, a.numel(), mt.RULES[rule], mc, ec, emax,
                                                          B=1024)
        assert torch.equal(out.cpu(), want.to(torch.int32)), rule


# ---- dispatch: backend "triton" routes CPU tensors to the kernels under the interpreter ----

def _quantize_all(x, spec, backend, seed=11):
    if backend == "triton":
        x = x.to(DEV)
    with bs.use_backend(backend):
        q = bs.quantize(x, spec, generator=torch.Generator().manual_seed(seed))
        qv, v = quantize_with_values(x, spec, generator=torch.Generator().manual_seed(seed))
        f = bs.fake_quantize(x, spec, generator=torch.Generator().manual_seed(seed))
        d = q.dequantize()
        d16 = q.dequantize(torch.bfloat16)
    return q.to("cpu"), qv.to("cpu"), v.cpu(), f.cpu(), d.cpu(), d16.cpu()


def _same_q(a, b):
    assert a.codes.dtype == b.codes.dtype and a.codes.shape == b.codes.shape
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
    assert torch.equal(a.scales, b.scales) and a.shape == b.shape and a.dtype == b.dtype
    assert (a.signs is None) == (b.signs is None) and (a.signs is None or torch.equal(a.signs, b.signs))


def _same_all(got, want):
    _same_q(got[0], want[0])
    _same_q(got[1], want[1])
    for a, b in zip(got[2:], want[2:]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_i32(a), _i32(b))


@pytest.mark.parametrize("spec", [bs.MX(), bs.MX("e5m2", "floor", dim=0), bs.MX("e2m1", dim=1),
                                  bs.MX("e2m1", "floor", dim=-2), bs.S2F6(), bs.S2F6(hadamard=False, seed=4),
                                  bs.S2F6(seed=7, scale_rule="floor")], ids=str)
def test_backend_triton_dispatch_matches_reference(spec):
    x = _rotatable(_hard(24, 72)).reshape(2, 12, 72)  # 3-D, K % 32 != 0
    for xi in (x, x.to(torch.bfloat16)):
        _same_all(_quantize_all(xi, spec, "triton"), _quantize_all(xi, spec, "reference"))
    if isinstance(spec, bs.MX):
        _same_all(_quantize_all(torch.tensor(-3.0), spec if spec.dim in (0, -1) else bs.MX(), "triton"),
                  _quantize_all(torch.tensor(-3.0), spec if spec.dim in (0, -1) else bs.MX(), "reference"))


@pytest.mark.parametrize("spec", [bs.MX("e4m3", rounding="stochastic", dim=0),
                                  bs.MX("e2m1", "floor", "stochastic", "exact"),
                                  bs.S2F6(seed=3, rounding="stochastic", sr_mode="exact"),
                                  bs.S2F6(hadamard=False, rounding="stochastic")], ids=str)
def test_backend_triton_sr_uses_a_seed_from_the_generator(spec):
    x = _rotatable(_hard(8, 40))
    with bs.use_backend("triton"):
        q = bs.quantize(x.to(DEV), spec, generator=torch.Generator().manual_seed(3)).to("cpu")
    seed = triton_seed(torch.Generator().manual_seed(3), x.device)
    R = 40 if isinstance(spec, bs.MX) and spec.dim == 0 else 8
    n = R * _pad(8 if R == 40 else 40)
    bits = mt.random_bits(n, seed, device=DEV).cpu()
    with bs.use_backend("reference"):
        if isinstance(spec, bs.MX):
            want = mx_ref.quantize_mx(x, spec, rand_bits=bits)
        else:
            want = s2f6_ref.quantize_s2f6(x, spec, rand_bits=bits)
    _same_q(q, want)
    with bs.use_backend("triton"):  # a different generator state: other bits
        other = bs.quantize(x.to(DEV), spec, generator=torch.Generator().manual_seed(4)).to("cpu")
    assert not torch.equal(other.codes.view(torch.uint8), q.codes.view(torch.uint8))


def test_auto_on_cpu_and_rand_bits_keep_the_torch_path(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the Triton kernel must not run here")

    for name in ("quantize_mx_rows", "quantize_mx_strided", "dequantize_mx_2d"):
        monkeypatch.setattr(mt, name, boom)
    for name in ("quantize_s2f6_2d", "dequantize_s2f6_2d"):
        monkeypatch.setattr(st, name, boom)
    x = _rotatable(_hard(8, 64))
    for spec in (bs.MX(rounding="stochastic"), bs.S2F6(rounding="stochastic")):
        a = _quantize_all(x, spec, "auto")  # CPU tensors: no Triton under "auto"
        _same_all(a, _quantize_all(x, spec, "reference"))
        bits = (torch.arange(8 * 64, dtype=torch.int64) * 2654435761) & 0xFFFFFFFF
        fn = mx_ref.quantize_mx if isinstance(spec, bs.MX) else s2f6_ref.quantize_s2f6
        with bs.use_backend("triton"):
            got = fn(x, spec, rand_bits=bits)  # rand_bits forces the torch kernels
        with bs.use_backend("reference"):
            _same_q(got, fn(x, spec, rand_bits=bits))
            _same_q(fn(x, spec, torch.Generator().manual_seed(9)), bs.quantize(x, spec, torch.Generator().manual_seed(9)))
        with pytest.raises(ValueError, match="rand_bits"):
            fn(x, spec, rand_bits=torch.zeros(5, dtype=torch.int32))


# ---- S2F6 with the 32-point random Hadamard transform ----

def _check_s2f6(x, spec, seed=0, offset=0):
    R, K = x.shape
    bits = mt.random_bits(R * _pad(K), seed, offset, DEV).cpu() if spec.rounding == "stochastic" else None
    with bs.use_backend("reference"):
        q = s2f6_ref.quantize_s2f6(x, spec, rand_bits=bits)
        want = q.dequantize()
    codes, sb = (t.cpu() for t in st.quantize_s2f6_2d(x.to(DEV), None if q.signs is None else q.signs.to(DEV),
                                                       spec.scale_rule, spec.rounding, spec.sr_mode, seed, offset))
    assert torch.equal(codes, q.codes) and torch.equal(sb, q.scales)
    deq = st.dequantize_s2f6_2d(codes.to(DEV), sb.to(DEV), None if q.signs is None else q.signs.to(DEV)).cpu()
    assert torch.equal(_i32(deq[:, :K]), _i32(want))
    return q


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
@pytest.mark.parametrize("K", [100, 7, 64])
def test_s2f6_hadamard_nearest(seed, K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, K, generator=g) * torch.logspace(-3, 3, K)
    x[0] = 0.0
    x[1, : min(K, 32)] = -0.0
    x[2] *= 1e-38  # rotated values in the FP32 subnormal range
    x[3] = x[3].to(torch.bfloat16).float()
    for rule in ("ceil", "floor"):
        _check_s2f6(x, bs.S2F6(seed=seed, scale_rule=rule))
    _check_s2f6(x.to(torch.bfloat16), bs.S2F6(seed=seed))


@pytest.mark.parametrize("rounding, sr_mode", MODES[1:])
@pytest.mark.parametrize("hadamard", [True, False])
def test_s2f6_stochastic_rounding_consumes_the_same_bits(rounding, sr_mode, hadamard):
    x = _rotatable(_hard(16, 100))
    for rule in ("ceil", "floor"):
        _check_s2f6(x, bs.S2F6(hadamard, 5, rule, rounding, sr_mode), seed=77, offset=2**32 - 50)


def test_s2f6_without_rotation_saturates_floor_and_edges():
    x = _saturating("e2m1")
    for rule in ("ceil", "floor"):
        q = _check_s2f6(x, bs.S2F6(hadamard=False, scale_rule=rule))
        if rule == "floor":  # 1.9 * 2**e -> 121.6 -> 122; -1.99 * 2**e -> -127 (saturated symmetrically)
            assert (q.codes[:, 40] == -127).all()
    _check_s2f6(_hard(16, 100), bs.S2F6(hadamard=False))


@triton.jit
def _rht_kernel(x_ptr, s_ptr, out_ptr, INVERSE: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, N)
    i = tl.arange(0, 32)
    x = tl.load(x_ptr + r[:, None] * 32 + i[None, :])
    s = tl.load(s_ptr + i)[None, :]
    if INVERSE:
        y = (st._butterfly32(x, N) * st.INV_SQRT32) * s
    else:
        y = st._butterfly32(x * s, N) * st.INV_SQRT32
    tl.store(out_ptr + r[:, None] * 32 + i[None, :], y)


def test_rotation_matches_the_library_butterfly_bit_for_bit():
    """The kernels' RHT == ``hadamard.rht_blocks`` / ``inverse_rht_blocks`` in FP32 bits (quantized codes
    and the integer-valued dequantize sums hardly ever show the summation order; this does: a
    GEMM-order rotation differs in bits on the same data)."""
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 4, 32)
    for seed in (0, 1, 2):
        s = random_signs(32, seed)
        for inverse, ref_fn in ((False, rht_blocks), (True, inverse_rht_blocks)):
            out = torch.empty(256, 32, device=DEV)
            _rht_kernel[(1,)](x.to(DEV), s.to(DEV), out, INVERSE=inverse, N=256, enable_fp_fusion=False)
            assert torch.equal(_i32(out.cpu()), _i32(ref_fn(x, s)))
    a, b = hadamard(x, 32, s), hadamard_gemm(x, 32, s)
    assert not torch.equal(_i32(a), _i32(b))
    q = _check_s2f6(x, bs.S2F6(seed=2))
    assert q.signs is not None and torch.equal(q.signs, s)
