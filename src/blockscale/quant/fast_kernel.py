"""A quantizer kernel with its compiled twin: eager reference, foreground or background compilation.

Every kernel is written once, as eager torch code (the specification). ``fast_kernel(fn)`` returns a
``FastKernel``: calling it runs ``fn`` compiled by TorchInductor (shape-generic: ``dynamic=True``, so one
compilation serves every size; bit for bit the eager code, tested), ``.eager`` runs ``fn`` itself.

When compilation happens depends on the backend (``quant.backend``):

- "compiled": in the foreground, on the first call (``COMPILE_NOTICE`` is printed once per process).
- "auto": never in the foreground. A kernel runs eagerly until it has spent ``compile_after_seconds()``
  (default 30 s, ``BLOCKSCALE_COMPILE_AFTER``; ``never`` turns background compilation off) of eager time
  on tensors large enough for the fast path; then one background thread compiles it on a copy of the
  arguments of that eager call (the caller may free or change its tensors meanwhile: FSDP2 frees gathered
  parameters right after a unit's forward) while the reference keeps serving, and later calls run the compiled code as soon as it
  is ready (``torch._dynamo.run``: cached code only; a call the compiled code does not cover runs
  eagerly and queues that variant). A one-off ``bs.quantize`` of a 4096 x 4096 matrix therefore costs
  what the eager reference costs, while a training loop that calls the same kernels every step
  switches to the compiled ones once they have proven hot, without ever waiting for the compiler.

Results are the same bits on every path, so when the switch happens does not change any output. At
interpreter exit an unfinished background compilation is abandoned (``stop_background_compiles``).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import os
import queue
import sys
import threading
import time
import warnings
from typing import Callable

import torch

from .backend import _raise_recompile_limit, _state, announce_compile, get_backend

DEFAULT_COMPILE_AFTER_S = 30.0  # see compile_after_seconds
# TorchInductor options of every blockscale kernel. No vectorised tail loop: the tails run the scalar loop
# (the same IEEE operations, so the same bits: tested), which halves the compile time of a kernel
# (4/6 NVFP4: 46 s instead of 68-99 s on 2 cores) and costs no speed on these kernels (4096 x 4096:
# 0.09 s either way, docs/results/first-run.md).
INDUCTOR_OPTIONS = {"cpp.enable_loop_tail_vec": False}
_kernels: list = []


def compile_after_seconds() -> float:
    """Seconds of eager time a kernel spends (on fast-path sizes, under "auto") before it is compiled in the
    background: ``BLOCKSCALE_COMPILE_AFTER`` (a number >= 0, or ``never``), default 30.

    30 s is about what compiling one kernel costs on 2 CPU cores with an empty cache (10-50 s), and a compile
    in the background slows the caller while it runs (it takes a core and the GIL: SmolLM2's first
    scale-learning step took 27-30 s with a compile started at once, 10.7 s without). Compiling once the eager
    time spent equals the compile's cost is the ski-rental rule: whatever the work ahead, at most about twice
    the time of the better of "never compile" and "compile at once"."""
    raw = os.environ.get("BLOCKSCALE_COMPILE_AFTER", "").strip()
    if raw == "":
        return DEFAULT_COMPILE_AFTER_S
    if raw.lower() == "never":
        return float("inf")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ValueError(f"BLOCKSCALE_COMPILE_AFTER={raw!r}; allowed values: a number of seconds >= 0, or 'never'")
    return value


def _signature(args, kwargs) -> tuple:
    """What a compiled variant is specialised on (dtypes, ranks, layout, sizes 0 / 1, the static options)."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("T", a.dtype, a.dim(), a.is_contiguous(), tuple(min(s, 2) for s in a.shape), a.device.type,
                    a.requires_grad)
        try:
            hash(a)
            return a
        except TypeError:
            return ("?", type(a).__name__)
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


class FastKernel:
    """``fn`` and its compiled twin (see the module docstring). ``reference`` is ``fn``."""

    def __init__(self, fn: Callable):
        functools.update_wrapper(self, fn)
        self.reference = fn
        self._compiled = None
        self._run_only = None
        self._ready: set = set()   # variants compiled (in either thread)
        self._queued: set = set()  # variants handed to the background thread
        self._eager_s = 0.0
        self.demand = False        # set by ``backend.want_compiled``: the last call was of fast-path size
        _kernels.append(self)

    def compiled(self) -> Callable:
        if self._compiled is None:
            _raise_recompile_limit()
            self._compiled = torch.compile(self.reference, dynamic=True, options=INDUCTOR_OPTIONS)
            self._run_only = torch._dynamo.run(self.reference)
        return self._compiled

    def ready(self) -> bool:
        """Whether calling now runs compiled code without compiling in the foreground ("auto": some
        variant has been compiled in the background; "compiled": always)."""
        return get_backend() == "compiled" or bool(self._ready)

    def __call__(self, *args, **kwargs):
        if _state["compile_failed"]:
            return self.reference(*args, **kwargs)
        _report_background_failure()
        if get_backend() == "compiled" or torch.compiler.is_compiling():
            return self._foreground(args, kwargs)
        sig = _signature(args, kwargs)
        if sig not in self._ready:
            if sig not in self._queued and compile_after_seconds() != float("inf"):
                _enqueue(self, sig, args, kwargs)
            return self.reference(*args, **kwargs)
        return self._run_only(*args, **kwargs)

    def eager(self, *args, **kwargs):
        """The reference, timed: under "auto", a kernel that has spent ``compile_after_seconds()`` here on
        fast-path sizes is queued for background compilation with these arguments."""
        if not self.demand or _state["compile_failed"] or get_backend() not in ("auto", "triton"):
            return self.reference(*args, **kwargs)
        t0 = time.perf_counter()
        out = self.reference(*args, **kwargs)
        self._eager_s += time.perf_counter() - t0
        if self._eager_s >= compile_after_seconds():
            sig = _signature(args, kwargs)
            if sig not in self._queued and sig not in self._ready:
                _enqueue(self, sig, args, kwargs)
        return out

    def _foreground(self, args, kwargs):
        compiled = self.compiled()
        if not torch.compiler.is_compiling():
            announce_compile()
        try:
            out = compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the reference
            _fail(exc, stacklevel=4)
            return self.reference(*args, **kwargs)
        self._ready.add(_signature(args, kwargs))
        return out


def fast_kernel(fn: Callable) -> FastKernel:
    """``fn`` with a compiled twin (``FastKernel``); on a compile failure: one warning, then ``fn`` itself."""
    return FastKernel(fn)


def _fail(exc: BaseException, stacklevel: int = 2) -> None:
    _state["compile_failed"] = True
    warnings.warn(
        f"blockscale: torch.compile is unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
        "using the eager reference kernels (same results, slower)",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


# ---- the background thread ---------------------------------------------------------------------------

class _Stop(BaseException):
    """Raised inside the background thread at interpreter exit."""


_jobs: "queue.Queue" = queue.Queue()
_worker: dict = {"thread": None, "busy": 0, "error": None}
_lock = threading.Lock()


def _own_copy(a):
    """A tensor argument copied (values, strides and requires_grad kept) for the background thread: the
    caller's tensor may be freed or changed in place while the compiled kernel runs there (FSDP2 frees a
    unit's gathered parameters right after its forward: the kernel would read freed memory)."""
    if not isinstance(a, torch.Tensor):
        return a
    c = a.detach().clone(memory_format=torch.preserve_format)
    return c.requires_grad_(a.requires_grad) if a.requires_grad else c


def _enqueue(kernel: FastKernel, sig, args, kwargs) -> None:
    kernel._queued.add(sig)
    args = tuple(_own_copy(a) for a in args)
    kwargs = {k: _own_copy(v) for k, v in kwargs.items()}
    with _lock:
        _worker["busy"] += 1
        _jobs.put((kernel, sig, args, kwargs, torch.is_grad_enabled(), torch.get_num_threads()))
        if _worker["thread"] is None:
            t = threading.Thread(target=_work, name="blockscale-compile", daemon=True)
            _worker["thread"] = t
            t.start()


def _work() -> None:
    try:
        while True:
            job = _jobs.get()
            if job is None:
                return
            kernel, sig, args, kwargs, grad, threads = job
            try:
                if torch.get_num_threads() != threads:  # dynamo guards on the thread count
                    torch.set_num_threads(threads)
                with torch.set_grad_enabled(grad):
                    kernel.compiled()(*args, **kwargs)
                kernel._ready.add(sig)
            except Exception as exc:  # noqa: BLE001 - reported from the caller's thread
                _worker["error"] = exc
            finally:
                del args, kwargs, job
                with _lock:
                    _worker["busy"] -= 1
    except _Stop:
        return


def _report_background_failure() -> None:
    exc = _worker["error"]
    if exc is not None and not _state["compile_failed"]:
        _worker["error"] = None
        _fail(exc, stacklevel=4)


def wait_for_background_compiles(timeout: float | None = None) -> bool:
    """Block until the background thread has compiled everything queued so far (or ``timeout`` seconds
    passed); returns whether it is idle. For tests and benchmarks: nothing else needs to wait."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while _worker["busy"]:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    _report_background_failure()
    return True


def stop_background_compiles(timeout: float = 60.0) -> None:
    """Abandon the background compilation (registered with ``atexit``): a thread still inside torch's C++ code
    when the interpreter finalises aborts the process, so it is stopped between two Python bytecodes first."""
    t = _worker["thread"]
    if t is None or not t.is_alive():
        return
    _jobs.put(None)  # wakes an idle thread
    previous_hook = sys.unraisablehook

    def quiet(unraisable):  # the stop may land inside a weakref callback: not worth a message
        if not isinstance(unraisable.exc_value, _Stop):
            previous_hook(unraisable)

    previous_thread_hook = threading.excepthook

    def quiet_thread(args):
        if not isinstance(args.exc_value, _Stop):
            previous_thread_hook(args)

    sys.unraisablehook = quiet
    threading.excepthook = quiet_thread
    deadline = time.monotonic() + timeout
    while t.is_alive() and time.monotonic() < deadline:
        if _worker["busy"]:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(_Stop))
        t.join(0.05)


def _after_fork_in_child() -> None:
    global _jobs, _lock
    _jobs, _lock = queue.Queue(), threading.Lock()
    _worker.update(thread=None, busy=0, error=None)
    for kernel in _kernels:
        kernel._queued -= kernel._queued - kernel._ready


atexit.register(stop_background_compiles)
os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["DEFAULT_COMPILE_AFTER_S", "INDUCTOR_OPTIONS", "FastKernel", "compile_after_seconds", "fast_kernel",
           "stop_background_compiles", "wait_for_background_compiles"]
