"""Time per training step of the small Llama for each recipe, relative to the bf16 recipe, same run.

    python benchmarks/bench_train_step.py [--preset small] [--batch 16] [--seq 256] [--steps 5]
                                          [--backend compiled] [--device cpu] [--markdown]

Each step = forward + backward + AdamW update on a fixed random batch; the median over ``--steps``
timed steps (after warm-up steps, which also absorb torch.compile) is reported, and its ratio to the
bf16 recipe's median. "none" is the unconverted model (plain FP32 nn.Linear), for reference.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

import blockscale as bs
from blockscale.models import PRESETS, Llama

RECIPES = ["none", "bf16", "mxfp8", "nvfp4-nvidia", "nvfp4-nvidia-4over6", "nvfp4-fwd-mxfp8-bwd"]


def time_recipe(recipe: str, preset: str, batch: int, seq: int, steps: int, warmup: int, device: str) -> float:
    torch.manual_seed(0)
    cfg = PRESETS[preset]
    model = Llama(cfg).to(device)
    if recipe != "none":  # "none": plain FP32 nn.Linear, for reference
        bs.convert(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    times = []
    for i in range(warmup + steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="compiled", choices=("reference", "compiled", "auto"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    bs.set_backend(args.backend)
    rows = []
    for r in args.recipes.split(","):
        t = time_recipe(r, args.preset, args.batch, args.seq, args.steps, args.warmup, args.device)
        rows.append((r, t))
        print(f"  {r:22s} {t * 1e3:9.1f} ms/step", file=sys.stderr, flush=True)
    base = dict(rows).get("bf16")
    n = sum(p.numel() for p in Llama(PRESETS[args.preset]).parameters())
    print(f"# preset {args.preset} ({n / 1e6:.2f}M params), batch {args.batch} x seq {args.seq}, backend={args.backend}, "
          f"device={args.device}, torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads")
    if args.markdown:
        print("| recipe | ms / step | x bf16 |\n|---|---:|---:|")
    for r, t in rows:
        ratio = f"{t / base:.2f}" if base else "-"
        print(f"| {r} | {t * 1e3:.1f} | {ratio} |" if args.markdown else f"{r:22s} {t * 1e3:9.1f} ms  {ratio}x bf16")


if __name__ == "__main__":
    main()
