"""Where a blockscale command's memory goes, phase by phase: runs ``blockscale ARGS`` in this process (under
torchrun, one trace per rank) with a thread sampling the resident set size every ``--interval`` seconds and
global module / optimizer hooks marking the phases (the model's forward, each decoder layer's forward, each
optimizer step), then prints, per rank, the RSS at each mark and the largest RSS between marks.

    python experiments/memory_trace.py --trace runs/trace -- learn-scales smollm2-135m --out runs/t1 --steps 3
    torchrun --standalone --nproc_per_node 2 experiments/memory_trace.py --trace runs/trace -- \\
        learn-scales smollm2-135m --out runs/t2 --steps 3 --fsdp

The hooks only read ``/proc/self/statm``; they change nothing in the run (no backward hooks, which would wrap
the tensors that activation checkpointing and FSDP2 see). Linux only.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def malloc_mib() -> dict:
    """glibc's ``mallinfo2``: heap bytes in use, heap bytes free (kept by the allocator), mmapped bytes in use
    (allocations of at least ``M_MMAP_THRESHOLD``); empty where it does not exist."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = Info
    i = fn()
    return {"heap_used": round(i.uordblks / 2**20), "heap_free": round(i.fordblks / 2**20),
            "mmapped": round(i.hblkhd / 2**20)}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Trace:
    """Marks (time, label, rss) and, between consecutive marks, the largest sampled RSS."""

    def __init__(self, interval: float):
        self.t0 = time.time()
        self.events: list[dict] = []
        self.samples: list[tuple] = []  # (t, rss) about every second, for the phases no hook marks
        self.window_max = 0.0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self.thread.start()

    def _sample(self, interval: float) -> None:
        last = 0.0
        while not self.stop.wait(interval):
            r = rss_mib()
            with self.lock:
                self.window_max = max(self.window_max, r)
            t = time.time() - self.t0
            if t - last >= 1.0:
                self.samples.append((round(t, 1), round(r)))
                last = t

    def mark(self, label: str) -> None:
        r = rss_mib()
        with self.lock:
            self.events.append({"t": round(time.time() - self.t0, 2), "label": label, "rss": round(r),
                                "max_since_last": round(max(self.window_max, r)), "peak": round(peak_mib()),
                                **malloc_mib()})
            self.window_max = r


def install(trace: Trace) -> None:
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def name(m) -> str | None:
        cls = type(m).__name__
        if cls.endswith("ForCausalLM") or cls in ("Llama", "Transformer"):
            return cls
        if cls.endswith("DecoderLayer") or cls in ("Block", "TransformerBlock"):
            return "layer"
        return None

    def pre(m, args):
        n = name(m)
        if n is not None:
            trace.mark(f"{n} forward start ({'grad' if torch.is_grad_enabled() else 'no grad'})")

    def post(m, args, out):
        n = name(m)
        if n is not None:
            trace.mark(f"{n} forward end")

    register_module_forward_pre_hook(pre)
    register_module_forward_hook(post)
    register_optimizer_step_post_hook(lambda opt, a, k: trace.mark("optimizer step"))


def mark_calls(trace: Trace, targets: list[str]) -> None:
    """Marks at the start and end of each ``module:function`` (wrapped before the command's modules import
    it by name, so their references are the wrapped function)."""
    import functools
    import importlib

    for target in targets:
        mod_name, _, fn_name = target.partition(":")
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name)

        @functools.wraps(fn)
        def wrapped(*a, __fn=fn, __name=fn_name, **k):
            trace.mark(f"{__name} start")
            try:
                return __fn(*a, **k)
            finally:
                trace.mark(f"{__name} end")

        setattr(mod, fn_name, wrapped)


def summary(events: list[dict]) -> list[str]:
    """Consecutive 'layer forward' marks folded into one line (their largest RSS)."""
    lines, run = [], None
    for e in events:
        if e["label"].startswith("layer"):
            run = run or {"n": 0, "max": 0, "first": e}
            run["n"] += 1
            run["max"] = max(run["max"], e["max_since_last"])
            continue
        if run:
            lines.append(f"  {run['first']['t']:8.1f}s  {run['n'] // 2:3d} layer forwards: max {run['max']:6d} MiB")
            run = None
        heap = (f"  heap used {e['heap_used']} free {e['heap_free']} mmapped {e['mmapped']}"
                if "mmapped" in e else "")
        lines.append(f"  {e['t']:8.1f}s  {e['label']:<40s} rss {e['rss']:6d}  max since last {e['max_since_last']:6d}"
                     f"  peak {e['peak']:6d}{heap}")
    if run:
        lines.append(f"  {run['first']['t']:8.1f}s  {run['n'] // 2:3d} layer forwards: max {run['max']:6d} MiB")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: memory_trace.py [--trace DIR] [--interval S] -- BLOCKSCALE_ARGS...")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=Path("runs/memory_trace"))
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--mark-calls", nargs="*", default=[], metavar="MODULE:FUNCTION",
                    help="also mark the start and end of these functions, e.g. blockscale.lsq.enable:freeze")
    args = ap.parse_args(argv[:cut])
    rank = int(os.environ.get("RANK", "0"))
    trace = Trace(args.interval)
    install(trace)
    mark_calls(trace, args.mark_calls)
    trace.mark("start")
    from blockscale.cli.main import main as blockscale_main

    code = 1
    try:
        code = blockscale_main(argv[cut + 1:])
    finally:
        trace.mark("end")
        trace.stop.set()
        args.trace.mkdir(parents=True, exist_ok=True)
        (args.trace / f"rank{rank}.json").write_text(json.dumps({"events": trace.events,
                                                                  "samples": trace.samples}) + "\n")
        text = "\n".join([f"rank {rank}: peak {peak_mib():.0f} MiB", *summary(trace.events)])
        (args.trace / f"rank{rank}.txt").write_text(text + "\n")
        print(text, file=sys.stderr, flush=True)
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
