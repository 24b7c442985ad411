"""Reference (eager) vs fast (torch.compile) execution of the quantizer kernels.

Every kernel is written once, as eager torch code: that code is the specification. The fast path
compiles the same function with TorchInductor (which keeps IEEE semantics: no FMA contraction, no
unsafe math), and the tests check both give identical bits. If compilation fails (no C++
compiler, unsupported platform) we warn once and run the reference from then on.

Backend choice: ``set_backend("auto" | "reference" | "compiled" | "triton")`` or the environment
variable ``BLOCKSCALE_BACKEND``. "auto" compiles for tensors of at least ``AUTO_MIN_NUMEL`` elements,
where the one-off compile time pays for itself, and sends CUDA tensors to the Triton kernels
(``quant/triton_kernels``, bit-identical) where one exists for the spec and triton is installed;
``BLOCKSCALE_TRITON=0`` turns that off. "triton" forces the Triton kernels wherever they exist (CPU
tensors too when Triton's interpreter is on, ``TRITON_INTERPRET=1``: that is how they are tested);
"reference" and "compiled" never use Triton. Specs without a Triton kernel take the auto path.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from typing import Callable

import torch

BACKENDS = ("auto", "reference", "compiled", "triton")
AUTO_MIN_NUMEL = 1 << 20

_state = {"backend": os.environ.get("BLOCKSCALE_BACKEND", "auto"), "compile_failed": False}
if _state["backend"] not in BACKENDS:
    raise ValueError(f"BLOCKSCALE_BACKEND={_state['backend']!r}; allowed values: {', '.join(BACKENDS)}")


def set_backend(name: str) -> None:
    """Select "auto", "reference" (eager, chunked), "compiled" (torch.compile) or "triton" kernels."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not supported; allowed values: {', '.join(map(repr, BACKENDS))}")
    _state["backend"] = name


def get_backend() -> str:
    return _state["backend"]


@contextlib.contextmanager
def use_backend(name: str):
    """Context manager form of ``set_backend``."""
    old = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def want_compiled(numel: int, min_numel: int = AUTO_MIN_NUMEL) -> bool:
    """Whether the fast path should run for a tensor of ``numel`` elements ("auto": at least ``min_numel``;
    kernels called again and again, such as scale learning's, pay for their compile at smaller sizes)."""
    if _state["compile_failed"]:
        return False
    b = _state["backend"]
    return b == "compiled" or (b in ("auto", "triton") and numel >= min_numel)


def triton_available() -> bool:
    """Whether ``triton`` imports (checked once, lazily: importing triton takes a while)."""
    if "triton" not in _state:
        from .triton_kernels import TRITON_AVAILABLE

        _state["triton"] = TRITON_AVAILABLE
    return _state["triton"]


def want_triton(x: torch.Tensor) -> bool:
    """Whether a Triton kernel should run for tensor ``x`` (the caller checks the spec is covered).

    "auto": CUDA tensors, unless BLOCKSCALE_TRITON=0. "triton": CUDA tensors, and CPU tensors when
    Triton's interpreter is on (TRITON_INTERPRET=1). Never without triton installed ("triton" then
    warns once and runs the torch kernels).
    """
    b = _state["backend"]
    if b == "triton":
        if not triton_available():
            if not _state.get("triton_warned"):
                _state["triton_warned"] = True
                warnings.warn("blockscale: backend 'triton' selected but triton is not installed "
                              "(pip install 'blockscale[triton]'); using the torch kernels", RuntimeWarning,
                              stacklevel=3)
            return False
        return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if b == "auto" and x.is_cuda and os.environ.get("BLOCKSCALE_TRITON", "1") != "0":
        return triton_available()
    return False


def _raise_recompile_limit(at_least: int = 64) -> None:
    """Each kernel is compiled once per (static options, shape) combination; dynamo's default of 8
    recompiles per function would silently drop later combinations back to eager."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < at_least:
            setattr(dynamo_config, name, at_least)


COMPILE_NOTICE = "blockscale: compiling kernels (first run only) ..."


def announce_compile() -> bool:
    """Print ``COMPILE_NOTICE`` to stderr once per process, when the first blockscale kernel is about to be
    compiled (its first call: 25-75 s on CPU with a cold cache); ``BLOCKSCALE_QUIET=1`` silences it.
    Returns whether it printed."""
    if _state.get("compile_announced") or os.environ.get("BLOCKSCALE_QUIET", "0") not in ("", "0"):
        return False
    _state["compile_announced"] = True
    print(COMPILE_NOTICE, file=sys.stderr, flush=True)
    return True


def fast_kernel(fn: Callable) -> Callable:
    """``fn`` compiled with torch.compile; on a compile failure: one warning, then ``fn`` itself. The first
    call of the first kernel compiled in a process prints ``COMPILE_NOTICE`` (``announce_compile``)."""
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        if _state["compile_failed"]:
            return fn(*args, **kwargs)
        if compiled is None:
            _raise_recompile_limit()
            compiled = torch.compile(fn)
            if not torch.compiler.is_compiling():
                announce_compile()
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the reference
            _state["compile_failed"] = True
            warnings.warn(
                f"blockscale: torch.compile is unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                "using the eager reference kernels (same results, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
            return fn(*args, **kwargs)

    run.reference = fn
    return run
