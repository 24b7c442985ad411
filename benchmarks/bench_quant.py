"""Quantize+dequantize throughput of each format beside a plain tensor copy timed in the same run.

    python benchmarks/bench_quant.py [--size 4096] [--repeats 5] [--backend compiled] [--markdown]

The figure that matters is the ratio to the copy (these machines are shared and noisy). GB/s counts
the bytes of the input read plus the dequantized output written (the same traffic as the copy).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

import blockscale as bs

CASES = [
    ("NVFP4 RTN (scale-to-6)", lambda: bs.NVFP4(), False),
    ("NVFP4 4/6 (MSE)", lambda: bs.NVFP4(scale_rule="4over6"), False),
    ("NVFP4 sweep (126 scales)", lambda: bs.NVFP4(scale_rule="sweep"), True),
    ("MXFP8 E4M3, stochastic rounding", lambda: bs.MX(element="e4m3", rounding="stochastic"), False),
    ("S2F6 + 32-pt Hadamard", lambda: bs.S2F6(hadamard=True), False),
]


def _time(fn, repeats: int) -> float:
    """Median seconds over ``repeats`` calls (after one warm-up call)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run(size: int, repeats: int, backend: str, dtypes) -> list[dict]:
    rows = []
    bs.set_backend(backend)
    for dtype in dtypes:
        x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
        traffic = 2 * x.numel() * x.element_size()
        t_copy = _time(lambda: x.clone(), repeats)
        rows.append(dict(dtype=str(dtype).replace("torch.", ""), case="plain copy (baseline)", ms=t_copy * 1e3,
                         gbs=traffic / t_copy / 1e9, ratio=1.0))
        for name, make, slow in CASES:
            spec = make()
            gen = torch.Generator().manual_seed(1)
            fn = lambda: bs.quantize(x, spec, generator=gen).dequantize(dtype=x.dtype)  # noqa: E731
            t = _time(fn, 1 if slow else repeats)
            rows.append(dict(dtype=str(dtype).replace("torch.", ""), case=name, ms=t * 1e3, gbs=traffic / t / 1e9,
                             ratio=t / t_copy))
            print(f"  {rows[-1]['dtype']:8s} {name:34s} {t * 1e3:9.1f} ms", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="square matrix size (default 4096)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median reported)")
    ap.add_argument("--backend", default="compiled", choices=("reference", "compiled", "auto"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows = run(args.size, args.repeats, args.backend, dtypes)
    print(f"# {args.size}x{args.size}, backend={args.backend}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs ({platform.machine()}), {torch.get_num_threads()} threads")
    if args.markdown:
        print("| dtype | case | ms | GB/s | x copy |\n|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['dtype']} | {r['case']} | {r['ms']:.1f} | {r['gbs']:.2f} | {r['ratio']:.2f} |")
    else:
        for r in rows:
            print(f"{r['dtype']:9s} {r['case']:34s} {r['ms']:9.1f} ms {r['gbs']:7.2f} GB/s {r['ratio']:7.2f}x copy")


if __name__ == "__main__":
    main()
