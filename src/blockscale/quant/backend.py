"""Reference (eager) vs fast (torch.compile) execution of the quantizer kernels.

Every kernel is written once, as eager torch code: that code is the specification. The fast path
compiles the same function with TorchInductor (which keeps IEEE semantics: no FMA contraction, no
unsafe math), and the tests check both give identical bits. If compilation fails (no C++
compiler, unsupported platform) we warn once and run the reference from then on.

Backend choice: ``set_backend("auto" | "reference" | "compiled" | "triton")`` or the environment
variable ``BLOCKSCALE_BACKEND``. "auto" runs the reference first and compiles, in a background thread,
the kernels that prove hot on tensors of at least ``AUTO_MIN_NUMEL`` elements (``fast_kernel``: the
one-off compile time must pay for itself, and no call waits for it), and sends CUDA tensors to the Triton kernels
(``quant/triton_kernels``, bit-identical) where one exists for the spec and triton is installed;
``BLOCKSCALE_TRITON=0`` turns that off. "triton" forces the Triton kernels wherever they exist (CPU
tensors too when Triton's interpreter is on, ``TRITON_INTERPRET=1``: that is how they are tested);
"reference" and "compiled" never use Triton. Specs without a Triton kernel take the auto path.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

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


def want_compiled(numel: int, *kernels, min_numel: int = AUTO_MIN_NUMEL) -> bool:
    """Whether the compiled ``kernels`` (``fast_kernel.FastKernel``) should run for a tensor of ``numel``
    elements: always under "compiled"; under "auto" (and "triton" for CPU tensors) from ``min_numel``
    elements on (kernels called again and again, such as scale learning's, pay at smaller sizes), and
    only once every one of them has been compiled in the background (until then the caller runs their
    ``.eager`` form, which queues that compilation once the kernel has proven hot)."""
    if _state["compile_failed"]:
        return False
    b = _state["backend"]
    if b == "compiled":
        return True
    if b not in ("auto", "triton"):
        return False
    big = numel >= min_numel
    for k in kernels:
        k.demand = big
    return big and all(k.ready() for k in kernels)


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
