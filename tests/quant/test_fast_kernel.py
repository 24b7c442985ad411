"""``quant.fast_kernel``: "auto" never compiles in the foreground; hot kernels are compiled in one background
thread and later calls switch to them, bit for bit the reference; the switch covers every size (one
shape-generic compilation); an exit during a background compilation is clean."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import blockscale as bs
from blockscale.quant import backend
from blockscale.quant.fast_kernel import compile_after_seconds, fast_kernel, wait_for_background_compiles


def _kernel(x, scale: float, mode: str):
    """A pointwise kernel with the shape of the real ones: a tensor, a Python number, a static option."""
    y = x.float() * scale
    return torch.where(y.abs() > 1, (y * y - 1) * y.sign(), y) if mode == "square" else y + 1


def _frames_compiled():
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def test_auto_compiles_hot_kernels_in_the_background(monkeypatch):
    monkeypatch.setenv("BLOCKSCALE_COMPILE_AFTER", "0")
    monkeypatch.setitem(backend._state, "compile_failed", False)
    k = fast_kernel(_kernel)
    big = backend.AUTO_MIN_NUMEL
    x = torch.randn(64, 40, generator=torch.Generator().manual_seed(0))
    with bs.use_backend("auto"):
        assert not backend.want_compiled(big, k) and k.demand  # not compiled yet: the caller runs .eager
        assert torch.equal(k.eager(x, 0.5, "square"), _kernel(x, 0.5, "square"))  # the reference, and queued
        assert wait_for_background_compiles(600)
        assert k.ready() and backend.want_compiled(big, k)
        before = _frames_compiled()
        for shape in ((64, 40), (3, 7), (1000, 33)):  # one shape-generic compilation serves every size >= 2
            xs = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
            assert torch.equal(k(xs, 0.5, "square").view(torch.int32), _kernel(xs, 0.5, "square").view(torch.int32))
        assert _frames_compiled() == before  # nothing compiled in this thread
        # a variant never compiled (another dtype, another static option): the reference now, compiled later
        xb = x.bfloat16()
        assert torch.equal(k(xb, 0.5, "plus"), _kernel(xb, 0.5, "plus"))
        assert wait_for_background_compiles(600)
        before = _frames_compiled()
        assert torch.equal(k(xb, 0.5, "plus"), _kernel(xb, 0.5, "plus"))
        assert _frames_compiled() == before


def test_auto_compiles_nothing_for_small_tensors_or_before_the_threshold(monkeypatch):
    k = fast_kernel(_kernel)
    x = torch.randn(8, 8)
    with bs.use_backend("auto"):
        monkeypatch.setenv("BLOCKSCALE_COMPILE_AFTER", "0")
        assert not backend.want_compiled(10, k) and not k.demand  # below the fast-path size
        k.eager(x, 1.0, "plus")
        assert not k._queued
        monkeypatch.setenv("BLOCKSCALE_COMPILE_AFTER", "never")
        assert not backend.want_compiled(backend.AUTO_MIN_NUMEL, k) and k.demand
        k.eager(x, 1.0, "plus")
        assert not k._queued
    with bs.use_backend("reference"):
        assert not backend.want_compiled(backend.AUTO_MIN_NUMEL, k)


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_compile_after_setting_is_checked(monkeypatch, value):
    monkeypatch.setenv("BLOCKSCALE_COMPILE_AFTER", value)
    with pytest.raises(ValueError, match="BLOCKSCALE_COMPILE_AFTER=.*allowed values"):
        compile_after_seconds()


def test_exit_during_a_background_compilation_is_clean(tmp_path):
    """A thread inside torch's C++ code at interpreter exit aborts the process ("terminate called without an
    active exception"): the background compilation is stopped first, silently, with the program's exit code."""
    code = textwrap.dedent("""
        import sys, time, torch, blockscale as bs
        from blockscale.quant.nvfp4 import quantize as q
        x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
        a = bs.quantize(x, bs.NVFP4(scale_rule="4over6"))
        assert q._quantize_blocks_fast._queued, "not queued"
        time.sleep(float(sys.argv[1]))
        print("done", flush=True)
        sys.exit(3)
    """)
    env = dict(os.environ, BLOCKSCALE_COMPILE_AFTER="0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for wait in ("0", "2"):
        out = subprocess.run([sys.executable, "-c", code, wait], env=env, capture_output=True, text=True, timeout=300)
        assert (out.returncode, out.stdout, out.stderr) == (3, "done\n", "")


def test_background_compilation_runs_on_its_own_copy_of_the_arguments(tmp_path):
    """The background thread must not read the caller's tensors: FSDP2 frees a unit's gathered parameters
    (storage resized to 0) right after its forward, while the kernel compiled for them may still be running
    there. Before the fix this process died with SIGSEGV, or the compilation failed on the freed tensor."""
    code = textwrap.dedent("""
        import warnings, torch, blockscale as bs
        from blockscale.quant.fast_kernel import fast_kernel, wait_for_background_compiles
        k = fast_kernel(lambda w, a: torch.where(w.abs() > a, w * a, w + 1))
        w = torch.randn(512, 256, generator=torch.Generator().manual_seed(0), requires_grad=True)
        a = torch.full((), 0.5)
        with bs.use_backend("auto"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            k(w.detach(), a)
            assert k._queued, "not queued"
            w.data.untyped_storage().resize_(0)  # what FSDP2's reshard does to a gathered parameter
            assert wait_for_background_compiles(600) and k.ready()
            w2 = torch.randn(512, 256, generator=torch.Generator().manual_seed(1))
            assert torch.equal(k(w2, a), torch.where(w2.abs() > a, w2 * a, w2 + 1))
        failed = [str(c.message) for c in caught if "torch.compile is unavailable" in str(c.message)]
        assert not failed, failed
        print("ok", flush=True)
    """)
    env = dict(os.environ, BLOCKSCALE_COMPILE_AFTER="0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr[-3000:]
