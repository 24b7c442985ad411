"""Every fast (torch.compile) path is bit-identical to the eager reference, and falls back to it."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import blockscale as bs


def _hard(rows=48, cols=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-5, 4, cols)
    x[0, :40] = 0.0
    x[1, 7] = -0.0
    x[2, :16] = torch.tensor([10.0, 20, 30, 40] + [0.0] * 12)
    x[3, 16:32] = torch.tensor([12.0] + [0.0] * 15)  # an exact 4/6 tie
    x[4] *= 1e-20  # tiny rows next to a large tensor amax
    return x


FAST_SPECS = [
    bs.NVFP4(),
    bs.NVFP4(scale_rule="4"),
    bs.NVFP4(scale_rule="4over6", error="mse"),
    bs.NVFP4(scale_rule="4over6", error="mae"),
    bs.NVFP4(scale_rule="4over6", error="maxabs", outer="row"),
    bs.NVFP4(scale_rule="4over6", error="mse", block_2d=True),
    bs.NVFP4(block_2d=True, outer=50.0),
    bs.NVFP4(scale_rule="sweep"),
    bs.NVFP4(scale_rule="sweep", block_2d=True),
    bs.NVFP4(rounding="stochastic", sr_mode="hardware", outer="row"),
    bs.NVFP4(scale_rule="4over6", rounding="stochastic", sr_mode="exact"),
    bs.MX(element="e4m3"),
    bs.MX(element="e5m2", scale_rule="floor", dim=0),
    bs.MX(element="e2m1", rounding="stochastic"),
    bs.MX(element="e4m3", rounding="stochastic", sr_mode="exact"),
    bs.S2F6(),
    bs.S2F6(hadamard=False, scale_rule="floor", rounding="stochastic"),
]


def _bits(t):
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.element_size() == 4 else t


def _run(x, spec, backend):
    with bs.use_backend(backend):
        q = bs.quantize(x, spec, generator=torch.Generator().manual_seed(11))
        return q, q.dequantize()


# half-precision inputs, once per kernel (each input dtype is one more compilation of a kernel variant, 10-50 s
# with an empty cache): the kernels see their FP32 values, so one rule per kernel shows the cast is the
# reference's (the sweep's three kernels are checked on FP32 inputs only: 76 s of compiling for bf16)
HALF_CASES = [(bs.NVFP4(), torch.bfloat16),
              (bs.NVFP4(), torch.float16),
              (bs.NVFP4(scale_rule="4over6", error="mse"), torch.bfloat16),
              (bs.MX(element="e4m3"), torch.bfloat16),
              (bs.S2F6(), torch.float16)]


def _assert_compiled_equals_reference(x, spec):
    (qa, da), (qb, db) = _run(x, spec, "reference"), _run(x, spec, "compiled")
    for name in ("codes", "scales", "outer_scale", "amax"):
        a, b = getattr(qa, name), getattr(qb, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(_bits(a), _bits(b)), name
    assert torch.equal(da.view(torch.int32), db.view(torch.int32))


@pytest.mark.parametrize("spec", FAST_SPECS, ids=str)
def test_compiled_equals_reference(spec):
    # one compilation per kernel variant serves every shape: a second shape with other tails checks that,
    # and for the NVFP4 rules, plain randn rows: many near-ties, one fixed summation order in both paths
    _assert_compiled_equals_reference(_hard(), spec)
    second = _hard(rows=21, cols=72, seed=2)
    if isinstance(spec, bs.NVFP4):
        second = torch.cat([second, torch.randn(235, 72, generator=torch.Generator().manual_seed(3))])
    _assert_compiled_equals_reference(second, spec)


@pytest.mark.parametrize("spec, dtype", HALF_CASES, ids=str)
def test_compiled_equals_reference_on_half_inputs(spec, dtype):
    _assert_compiled_equals_reference(_hard(seed=1).clamp(-60000, 60000).to(dtype), spec)  # finite in fp16


def test_falls_back_with_one_warning_when_compilation_is_unavailable(tmp_path):
    code = textwrap.dedent("""
        import warnings, torch, blockscale as bs
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = bs.quantize(x, bs.NVFP4()).dequantize()
            b = bs.quantize(x, bs.MX()).dequantize()
            c = bs.quantize(x, bs.S2F6()).dequantize()
        ours = [str(m.message) for m in w if "blockscale" in str(m.message)]
        assert len(ours) == 1 and "torch.compile is unavailable" in ours[0], ours
        with bs.use_backend("reference"):
            assert torch.equal(a, bs.quantize(x, bs.NVFP4()).dequantize())
            assert torch.equal(b, bs.quantize(x, bs.MX()).dequantize())
            assert torch.equal(c, bs.quantize(x, bs.S2F6()).dequantize())
        print("OK")
    """)
    env = dict(os.environ, CXX="/nonexistent/c++", BLOCKSCALE_BACKEND="compiled",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("spec", [bs.MX(dim=0, rounding="stochastic")], ids=str)
def test_compiled_blocks_along_dim0_read_the_strided_layout(spec):
    """Whole blocks along dim 0: the compiled kernel reads the transposed view without a copy."""
    x = _hard(rows=64, cols=72)
    (qa, da), (qb, db) = _run(x, spec, "reference"), _run(x, spec, "compiled")
    assert torch.equal(_bits(qa.codes), _bits(qb.codes)) and torch.equal(qa.scales, qb.scales)
    assert torch.equal(da.view(torch.int32), db.view(torch.int32))
    with bs.use_backend("compiled"):
        v = bs.fake_quantize(x, spec, torch.Generator().manual_seed(11))
    assert torch.equal(v.view(torch.int32), da.view(torch.int32))
