"""Scale learning on a real model in one process and under torchrun with FSDP2, as a user runs it:
``blockscale learn-scales MODEL --out OUT --steps N ...`` and ``torchrun --nproc_per_node W -m blockscale.cli
learn-scales MODEL ... --fsdp`` (student and teacher built shard by shard), one run at a time, each in a child
process whose peak RSS (``ru_maxrss`` of the largest process: the single process, or the largest rank) and wall
time are recorded with the run's distillation summary (issue 31).

    python experiments/fetch_qwen_gguf.py --model 1.5b        # the Qwen2.5-Coder-1.5B GGUF, once
    python experiments/learn_scales_scale.py --model qwen-1.5b --json docs/results/learn_scales_qwen15.json

The global batch is the same in both runs: ``--batch-size`` windows per step in one process, ``--batch-size / W``
per rank under torchrun.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = {"qwen-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
         "sys.stdout.write(r.stdout[-3000:]); sys.stderr.write(r.stderr[-3000:]); "
         "print('PEAK', r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


def run(model: str, out: Path, args, world: int) -> dict:
    flags = ["learn-scales", model, "--out", str(out), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
             "--n-samples", str(args.n_samples), "--batch-size", str(args.batch_size // world), "--ckpt-interval", "0",
             "--teacher-dtype", args.teacher_dtype, *args.extra]
    if world == 1:
        cmd = [sys.executable, "-m", "blockscale.cli", *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), "-m",
               "blockscale.cli", *flags, "--fsdp"]
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    wall = time.time() - t0
    peak_line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PEAK ")][-1].split()
    rc, peak = int(peak_line[1]), int(peak_line[2])
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    report = json.loads((out / "lsq_report.json").read_text())
    return {"world_size": world, "command": " ".join(["blockscale" if world == 1 else
                                                      f"torchrun --nproc_per_node {world} -m blockscale.cli",
                                                      *flags, *(["--fsdp"] if world > 1 else [])]),
            "wall_s": round(wall, 1), "peak_rss_mib": round(peak / 2**20), "distill": report["distill"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen-1.5b", help=f"{', '.join(GGUF)} (in --cache) or any model argument")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/blockscale/models").expanduser())
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--n-samples", type=int, default=64)
    ap.add_argument("--teacher-dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="1: one process; W > 1: torchrun --fsdp")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more learn-scales flags (last)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = str(args.cache / GGUF[args.model]) if args.model in GGUF else args.model
    rows = []
    with tempfile.TemporaryDirectory(dir=args.cache if args.cache.is_dir() else None) as tmp:
        for world in args.worlds:
            rows.append(run(model, Path(tmp) / f"out{world}", args, world))
            r = rows[-1]
            print(f"W={world}: {r['wall_s']} s, peak RSS {r['peak_rss_mib']} MiB, loss {r['distill']['first_loss']:.5f}"
                  f" -> {r['distill']['final_loss']:.5f}", flush=True)
    single = next((r for r in rows if r["world_size"] == 1), None)
    for r in rows:
        if single is not None and r is not single:
            r["peak_vs_single_process"] = round(r["peak_rss_mib"] / single["peak_rss_mib"], 3)
    result = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "teacher_dtype": args.teacher_dtype, "runs": rows}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
