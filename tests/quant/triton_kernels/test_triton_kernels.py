"""Triton NVFP4 kernels == the PyTorch reference, bit for bit.

Without a GPU the kernels run on CPU tensors under Triton's interpreter. TRITON_INTERPRET=1 must
be set before ``import triton`` (triton's own library kernels, e.g. ``tl.randint``, are decorated
then) and while kernels run, so a CPU-only session keeps it set from here on (nothing else there
uses Triton). With CUDA available the same checks run on the GPU against the CPU reference.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import triton_interpreter  # noqa: E402  (sets TRITON_INTERPRET before triton is imported)
from triton_interpreter import DEV, ON_GPU, tl, triton  # noqa: E402

import blockscale as bs  # noqa: E402
from blockscale.formats.minifloat import E2M1, E4M3, round_magnitude  # noqa: E402
from blockscale.quant import nvfp4 as ref  # noqa: E402
from blockscale.quant.blocking import random_from_bits  # noqa: E402
from blockscale.quant.dispatch import quantize_with_values  # noqa: E402
from blockscale.quant.blocking import triton_seed  # noqa: E402
from blockscale.quant.triton_kernels import nvfp4_triton as nt  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


_skip_when_rerun = triton_interpreter._skip_when_rerun  # autouse fixture
test_rerun_in_a_fresh_interpreter = triton_interpreter.test_rerun_in_a_fresh_interpreter


def _i32(t):
    return t.contiguous().view(torch.int32)


def _hard(rows=32, cols=200, seed=0):
    """Wide dynamic range (E4M3-subnormal and zero block scales), zeros, -0.0, 4/6 ties, K % 16 != 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows, 8), max(cols, 64), generator=g) * torch.logspace(-6, 4, max(cols, 64))
    x[0, :40] = 0.0
    x[1, 7] = -0.0
    x[1, 20:24] = torch.tensor([-0.0, 0.0, -0.0, -0.0])
    x[2, :16] = torch.tensor([10.0, 20, 30, 40] + [0.0] * 12)  # 4/6 picks 4 (paper example)
    x[3, 16:32] = torch.tensor([12.0] + [0.0] * 15)  # an exact 4/6 tie: keeps 6
    x[4] *= 1e-20  # tiny rows next to a large tensor amax
    x[5, 32:48] = torch.tensor([6.0e4, 1e-10, -1e-20, 1e-40, -1e-42, 3.0, -0.0] + [0.5] * 9)
    x[6, 48:64] = torch.tensor([1e-38, -1e-39, 1e-44] + [0.0] * 13)  # an FP32-subnormal block
    return x[:rows, :cols].contiguous()


def _e2m1_ties():
    """Rows whose block scale is exactly 1 (S = 1, block amax 6): every E2M1 tie, both signs."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
    above = [6.0, 0.26, 0.74, 1.26, 1.74, 2.6, 3.4, 5.1, 7.0, -7.0, 5.9, -0.0, 0.0, 1e-30, -1e-30, 6.0]
    return torch.tensor([ties, above, [-v for v in ties], [-v for v in above]], dtype=torch.float32)


def _e4m3_ties():
    """With S = 6, t = block amax exactly: block amaxes at E4M3 ties (normal, subnormal, the
    normal/subnormal border, 448 and beyond), one block per row."""
    sub = 2.0**-9
    amaxes = [1.0625, 1.1875, 1.5 * sub, 0.5 * sub, 2.5 * sub, 2.0**-6 - 2.0**-10, 2.0**-6 + 2.0**-10,
              416.0, 464.0, 480.0, 1e4, 3.0 * 2.0**-8, 0.0, 7.0, 13.0, 2.0**-10]
    g = torch.Generator().manual_seed(3)
    x = torch.rand(len(amaxes), 16, generator=g) * torch.tensor(amaxes).unsqueeze(1) * 0.9
    x[:, 5] = torch.tensor(amaxes)
    x[::2, 5] *= -1
    return x


def _reference(x, spec, rand_bits=None, encode_scale=None):
    with bs.use_backend("reference"):
        q, v = ref.quantize_nvfp4(x, spec, outputs="both", rand_bits=rand_bits, encode_scale=encode_scale)
    return q, v


def _check(x, spec, seed=0, offset=0, encode_scale=None):
    """Kernel vs reference: codes, scale bytes, fused values, dequantize kernel (all bitwise)."""
    R, K = x.shape
    Kp = -(-K // 16) * 16
    bits = nt.random_bits(R * Kp, seed, offset, DEV).cpu() if spec.rounding == "stochastic" else None
    q, v = _reference(x, spec, bits, encode_scale)
    S = q.outer_scale.reshape(-1)
    codes, sbytes, values = (t.cpu() for t in nt.quantize_nvfp4_2d(
        x.to(DEV), S.to(DEV), spec.scale_rule, spec.error, spec.rounding, spec.sr_mode, seed, offset,
        want_values=True))
    assert torch.equal(codes, q.codes), "codes"
    assert torch.equal(sbytes, q.scales.view(torch.uint8)), "scales"
    assert torch.equal(_i32(values[:, :K]), _i32(v)), "values"
    deq = nt.dequantize_nvfp4_2d(codes.to(DEV), sbytes.view(torch.float8_e4m3fn).to(DEV),
                                 (1.0 / q.outer_scale.reshape(-1)).to(DEV)).cpu()
    with bs.use_backend("reference"):
        want = q.dequantize()
    assert torch.equal(_i32(deq[:, :K]), _i32(want)), "dequantize"
    return q


RULES = [("6", "mse"), ("4", "mse"), ("4over6", "mse"), ("4over6", "mae"), ("4over6", "maxabs")]


@pytest.mark.parametrize("rule, error", RULES)
@pytest.mark.parametrize("outer", ["tensor", "row"])
def test_nearest_matches_reference(rule, error, outer):
    spec = bs.NVFP4(scale_rule=rule, error=error, outer=outer)
    x = _hard()
    _check(x, spec)
    _check(x.to(torch.bfloat16), spec)  # bf16 loads: the kernel sees the same FP32 values
    _check(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3, spec)


def _tiny_16bit(dtype, rows=6, cols=40, seed=0):
    """``dtype`` (bf16 / fp16) tensor of tiny values only, nearly all of them subnormal in ``dtype``
    (bf16: FP32 subnormals such as 1e-38 and -3e-39; fp16: below 2**-14), so each block gets its own
    small E4M3 scale and the values survive quantization. -0.0, zeros, the smallest normal and the
    smallest subnormal of the format included; K % 16 != 0."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    if dtype == torch.bfloat16:
        unit, special = 4e-39, [1e-38, -3e-39, 2.5e-38, -7.5e-39, -0.0, 0.0]
    else:
        unit, special = 2e-5, [6e-5, -3e-5, 1.2e-4, -7.5e-6, -0.0, 0.0]
    x = torch.randn(rows, cols, generator=g) * unit
    x[0, :6] = torch.tensor(special)
    x[1, 16:18] = torch.tensor([fi.smallest_normal, -fi.smallest_normal * fi.eps])  # smallest subnormal
    return x.to(dtype)


# S = FLT_MAX for the bf16 tensors: 1 / (s * inv_S) overflows to inf (then FLT_MAX), and numpy says so
@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("outer", ["tensor", "row"])
@pytest.mark.parametrize("rule, error", [("6", "mse"), ("4over6", "mse"), ("4over6", "maxabs")])
def test_16bit_subnormal_inputs_load_exactly(dtype, outer, rule, error):
    """bf16 / fp16 inputs holding subnormals of their own format: the kernel must see their exact FP32
    values (Triton's interpreter converts bf16 subnormals wrongly with ``.to(tl.float32)``)."""
    x = _tiny_16bit(dtype)
    assert int((x != 0).sum()) > 200 and bool((x.float().abs() < torch.finfo(dtype).smallest_normal).any())
    spec = bs.NVFP4(scale_rule=rule, error=error, outer=outer)
    q = _check(x, spec)
    with bs.use_backend("reference"):
        v = q.dequantize()
    assert int((v != 0).sum()) > 150  # the subnormal inputs are not flushed by the quantization
    sub = (x.float().abs() < torch.finfo(dtype).smallest_normal) & (x != 0)
    assert int((v[sub] != 0).sum()) > 50


@pytest.mark.parametrize("rule, error", RULES)
def test_near_ties_of_the_4over6_error_on_randn(rule, error):
    """Many near-equal block errors: one FP32 summation order (no FMA, the pairwise tree)."""
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    q = _check(x, bs.NVFP4(scale_rule=rule, error=error))
    if rule == "4over6":  # both candidates are really exercised
        assert 0.2 < float((q.scales.float() > 0).float().mean()) <= 1.0


def _seq_error(d, error):
    v = d * d if error == "mse" else torch.abs(d)
    return v.cumsum(-1)[:, -1]


@pytest.mark.parametrize("error", ["mse", "mae"])
def test_block_error_summation_order_decides_near_ties(error):
    """Blocks of small integers where a sequential sum would flip the 4/6 choice made with
    ``block_error``'s pairwise tree: the kernel must pick what the tree picks."""
    from blockscale.quant.block_error import block_error

    x = torch.randint(-40, 41, (20000, 16), generator=torch.Generator().manual_seed(0)).float()
    S = ref.outer_scale(x.abs().amax(), 256.0)
    t = x.abs().amax(-1, keepdim=True) * (S * (1.0 / 6.0))
    d6, d4 = (ref.reconstruct_blocks(x, s, 1.0 / S, None, "nearest", "hardware") - x
              for s in (ref.e4m3_scale(t), ref.e4m3_scale(t * 1.5)))
    tree = block_error(d4, error) < block_error(d6, error)
    picked = tree != (_seq_error(d4, error) < _seq_error(d6, error))
    assert int(picked.sum()) >= 8
    _check(x[picked][:64], bs.NVFP4(scale_rule="4over6", error=error), encode_scale=S)


@pytest.mark.parametrize("rule", ["6", "4", "4over6"])
def test_rounding_ties_of_e2m1_and_e4m3(rule):
    spec = bs.NVFP4(scale_rule=rule, outer=bs.NVFP4(scale_rule=rule).outer_bound)  # S = 6
    q = _check(_e4m3_ties(), spec)
    if rule == "6":
        assert q.outer_scale.item() == 6.0
        got = q.scales.float().reshape(-1)[:6].tolist()
        assert got == [1.0, 1.25, 2 * 2.0**-9, 0.0, 2 * 2.0**-9, 2.0**-6]
    q = _check(_e2m1_ties(), bs.NVFP4(outer=2688.0))  # S = 1, block scale 1
    assert q.scales.float().reshape(-1)[0].item() == 1.0
    assert q.codes[0].tolist() == [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x8E]


def test_zeros_and_given_encode_scale():
    spec = bs.NVFP4()
    q = _check(torch.zeros(4, 48), spec)
    assert q.outer_scale.item() == 1.0 and not q.codes.any() and not q.scales.view(torch.uint8).any()
    x = -torch.zeros(2, 16)
    _check(x, spec)
    _check(_hard(8, 64), spec, encode_scale=torch.tensor(1e-3))  # saturating blocks: clamp to 448 / ±6
    _check(_hard(8, 64), bs.NVFP4(scale_rule="4over6"), encode_scale=torch.tensor(1e30))


@pytest.mark.parametrize("rule, error", [("6", "mse"), ("4", "mse"), ("4over6", "mse"), ("4over6", "maxabs")])
@pytest.mark.parametrize("sr_mode", ["hardware", "exact"])
def test_stochastic_rounding_consumes_the_same_bits(rule, error, sr_mode):
    spec = bs.NVFP4(scale_rule=rule, error=error, rounding="stochastic", sr_mode=sr_mode, outer="row")
    _check(_hard(16, 200), spec, seed=1234, offset=0)
    _check(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)), spec, seed=7, offset=2**32 - 100)


def test_sr_bits_really_vary_and_rne_differs():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    spec = bs.NVFP4(rounding="stochastic")
    x, S = x.to(DEV), ref.outer_scale(x.abs().amax()).to(DEV)
    a = nt.quantize_nvfp4_2d(x, S, rounding="stochastic", seed=1)[0]
    b = nt.quantize_nvfp4_2d(x, S, rounding="stochastic", seed=2)[0]
    c = nt.quantize_nvfp4_2d(x, S, rounding="stochastic", seed=1)[0]
    assert torch.equal(a, c) and not torch.equal(a, b)
    bits = nt.random_bits(100, seed=1, offset=5, device=DEV).cpu()
    assert torch.equal(bits[10:], nt.random_bits(95, seed=1, offset=10, device=DEV).cpu()[5:])
    assert len(set(bits.tolist())) == 100
    del spec


@triton.jit
def _round_kernel(a_ptr, bits_ptr, out_ptr, n, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr,
                  ROUND: tl.constexpr, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    a = tl.load(a_ptr + i, mask=m, other=0.0)
    r = tl.load(bits_ptr + i, mask=m, other=0)
    tl.store(out_ptr + i, nt.round_magnitude(a, r, MBITS, EMIN, MAXV, ROUND), mask=m)



@pytest.mark.parametrize("fmt", [E2M1, E4M3], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", ["nearest", "hardware", "exact"])
def test_integer_rounding_matches_minifloat_reference(fmt, mode):
    """``_round_magnitude`` on magnitudes from FP32 subnormals to beyond the format max, with edge
    random words (all zero, all one, 8/24-bit boundaries) and random ones."""
    g = torch.Generator().manual_seed(5)
    n = 4096
    a = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 160 - 150).float()
    grid = torch.arange(0, 2 * fmt.max, fmt.min_subnormal / 2)[:1024]  # exact grid points and midpoints
    a = torch.cat([a, grid, torch.tensor([0.0, 2.0**-149, 2.0**-126, fmt.max, 1e38])])
    edge = torch.tensor([0, -1, 0xFF, 0x100, 0xFFFFFF, 0x1000000 - 1, 0x01000000, 0x7FFFFFFF, -(2**31)],
                        dtype=torch.int64)
    words = torch.randint(-(2**31), 2**31, (a.numel(),), generator=g, dtype=torch.int64)
    words[: edge.numel() * 40] = edge.repeat(40)
    words = words.to(torch.int32)
    rounding = "nearest" if mode == "nearest" else "stochastic"
    sr_mode = "hardware" if mode == "nearest" else mode
    rand = None if mode == "nearest" else random_from_bits(words, a.shape, sr_mode)
    want = round_magnitude(a, fmt, rounding, rand, sr_mode)
    out = torch.empty_like(a, device=DEV)
    _round_kernel[(triton.cdiv(a.numel(), 1024),)](a.to(DEV), words.to(DEV), out, a.numel(), fmt.mbits, fmt.emin,
                                                   fmt.max, nt.rounding_id(rounding, sr_mode), B=1024,
                                                   enable_fp_fusion=False)
    assert torch.equal(_i32(out.cpu()), _i32(want))


# ---- dispatch: backend "triton" routes CPU tensors to the kernels under the interpreter ----

def _quantize_all(x, spec, backend, seed=11):
    """quantize, quantize_with_values, fake_quantize, dequantize (on DEV for backend "triton"), on CPU."""
    if backend == "triton":
        x = x.to(DEV)
    with bs.use_backend(backend):
        q = bs.quantize(x, spec, generator=torch.Generator().manual_seed(seed))
        qv, v = quantize_with_values(x, spec, generator=torch.Generator().manual_seed(seed))
        f = bs.fake_quantize(x, spec, generator=torch.Generator().manual_seed(seed))
        d = q.dequantize()
    return q.to("cpu"), qv.to("cpu"), v.cpu(), f.cpu(), d.cpu()


def _same_q(a, b):
    assert a.codes.shape == b.codes.shape and torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(_i32(a.outer_scale), _i32(b.outer_scale)) and torch.equal(_i32(a.amax), _i32(b.amax))
    assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("spec", [bs.NVFP4(), bs.NVFP4(scale_rule="4over6", outer="row"),
                                  bs.NVFP4(scale_rule="4", outer="group"), bs.NVFP4(outer=30.0)], ids=str)
def test_backend_triton_dispatch_matches_reference(spec):
    x = _hard(24, 72).reshape(2, 12, 72)  # 3-D, K % 16 != 0
    for xi in (x, x.to(torch.bfloat16)):
        got, want = _quantize_all(xi, spec, "triton"), _quantize_all(xi, spec, "reference")
        _same_q(got[0], want[0])
        _same_q(got[1], want[1])
        for a, b in zip(got[2:], want[2:]):
            assert a.dtype == b.dtype and torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


def test_backend_triton_sr_uses_a_seed_from_the_generator():
    spec = bs.NVFP4(scale_rule="4over6", rounding="stochastic", sr_mode="exact")
    x = _hard(8, 40)
    with bs.use_backend("triton"):
        q = bs.quantize(x.to(DEV), spec, generator=torch.Generator().manual_seed(3)).to("cpu")
    seed = triton_seed(torch.Generator().manual_seed(3), x.device)
    bits = nt.random_bits(8 * 48, seed, device=DEV).cpu()
    want, _ = _reference(x, spec, bits)
    _same_q(q, want)


def test_unsupported_specs_and_auto_on_cpu_keep_the_torch_path(monkeypatch):
    """Only scale_rule "sweep" has no Triton kernel (1x16 blocks or 16x16 tiles): it keeps the torch
    path under backend "triton". 16x16 tiles (block_2d=True) go to the tile kernel there."""
    x = _hard(32, 32)
    tiles = nt.quantize_nvfp4_tiles

    def boom(*a, **k):
        raise AssertionError("the Triton kernel must not run here")

    monkeypatch.setattr(nt, "quantize_nvfp4_2d", boom)
    monkeypatch.setattr(nt, "quantize_nvfp4_tiles", boom)
    for spec in (bs.NVFP4(scale_rule="sweep"), bs.NVFP4(scale_rule="sweep", block_2d=True)):
        assert not ref.triton_supports(spec)
        got, want = _quantize_all(x, spec, "triton"), _quantize_all(x, spec, "reference")
        _same_q(got[0], want[0])
        # stored bytes are plain NVFP4 whatever the scale rule: the dequantize kernel still applies
        assert torch.equal(_i32(got[4]), _i32(want[4]))
    calls = []  # 16x16 tiles: the tile kernel (the 1x16 one still must not run)
    monkeypatch.setattr(nt, "quantize_nvfp4_tiles", lambda *a, **k: calls.append(1) or tiles(*a, **k))
    spec = bs.NVFP4(block_2d=True)
    assert ref.triton_supports(spec)
    got, want = _quantize_all(x, spec, "triton"), _quantize_all(x, spec, "reference")
    _same_q(got[0], want[0])
    _same_q(got[1], want[1])
    for a, b in zip(got[2:], want[2:]):
        assert torch.equal(_i32(a), _i32(b))
    assert len(calls) == 3  # quantize, quantize_with_values, fake_quantize
    monkeypatch.setattr(nt, "dequantize_nvfp4_2d", boom)
    spec = bs.NVFP4(scale_rule="4over6")
    _same_q(_quantize_all(x, spec, "auto")[0], _quantize_all(x, spec, "reference")[0])  # CPU: no Triton
    if not ON_GPU:  # backend "triton" sends CPU tensors to the kernels only under the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with bs.use_backend("triton"):
            _same_q(bs.quantize(x, spec), _quantize_all(x, spec, "reference")[0])


def test_reference_rand_bits_keeps_default_behaviour():
    """rand_bits is opt-in: without it the reference draws from the generator exactly as before."""
    spec = bs.NVFP4(rounding="stochastic")
    x = _hard(8, 32)
    with bs.use_backend("reference"):
        a = ref.quantize_nvfp4(x, spec, torch.Generator().manual_seed(9))
        b = bs.quantize(x, spec, torch.Generator().manual_seed(9))
    _same_q(a, b)
    with pytest.raises(ValueError, match="rand_bits"):
        ref.quantize_nvfp4(x, spec, rand_bits=torch.zeros(5, dtype=torch.int32))


def test_package_imports_without_triton():
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch, blockscale as bs
        from blockscale.quant.triton_kernels import TRITON_AVAILABLE
        assert TRITON_AVAILABLE is False
        x = torch.randn(4, 32)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with bs.use_backend("triton"):
                a = bs.quantize(x, bs.NVFP4()).dequantize()
        assert any("triton is not installed" in str(m.message) for m in w)
        with bs.use_backend("reference"):
            assert torch.equal(a, bs.quantize(x, bs.NVFP4()).dequantize())
        print("OK")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
