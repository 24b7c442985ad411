"""Wall time of data-parallel PTQ calibration: the ``quantize`` command under torchrun with 1 and with N processes.

    python benchmarks/bench_torchrun_calibration.py [--model smollm2-135m] [--method gptq] [--nproc 1 2]
                                                    [--n-samples 16] [--seq-len 256] [--batch-size 2]
                                                    [--threads 1] [--out-dir runs/bench_torchrun] [--json FILE]

For each process count: ``torchrun --standalone --nproc_per_node N -m blockscale.cli quantize MODEL --method
METHOD ...`` (gloo on CPU; ``--threads`` intra-op threads per process), timed from the launch to the exit (model
loading and export included), and the command's own PTQ time (``seconds`` of ``ptq_report.json``: calibration,
reductions and solves, from rank 0). Prints a table with each run's ratio to the first, and how far the
checkpoints of the runs are from the first one's (share of code / scale bytes that differ, the largest relative
difference of a float tensor); with ``--eval-tokens N`` also each checkpoint's WikiText-2 perplexity on the
first N tokens (``blockscale eval ppl``, one process, after the timed runs). GPTQ's codes are not a stable
function of its Hessian (a flipped rounding decision changes the error fed to every later column), so past the
first layer many bytes differ between 1 and N processes while the perplexity agrees. On a machine with fewer
free cores than processes, N processes cannot be faster than about 1x: they share the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def checkpoint_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def distance(a: dict, b: dict) -> tuple[float, float]:
    """(share of the 1-byte tensors' bytes that differ, largest relative difference of a float tensor)."""
    changed = total = 0
    rel = 0.0
    for k, x in a.items():
        y = b[k]
        if x.is_floating_point() and x.dtype.itemsize > 1:
            d = float((x.float() - y.float()).abs().max()) / max(float(y.float().abs().max()), 1e-30)
            rel = max(rel, d)
        else:
            changed += int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
            total += x.numel() * x.dtype.itemsize
    return changed / max(total, 1), rel


def run(nproc: int, args, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "blockscale.cli", "quantize", args.model, "--method", args.method, "--n-samples", str(args.n_samples),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--threads", str(args.threads),
           "--out", str(out)] + (["--w4a4"] if args.w4a4 else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    rep = json.loads((out / "ptq_report.json").read_text())["ptq"]
    return {"nproc": nproc, "wall_s": wall, "ptq_s": rep["seconds"], "calibration_tokens": rep["calibration_tokens"],
            "command": " ".join(["torchrun", "--standalone", "--nproc_per_node", str(nproc)] + cmd[6:])}


def perplexity(path: Path, args) -> float:
    """``blockscale eval ppl`` of a checkpoint on the first ``--eval-tokens`` tokens of its default text."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    out = path.parent / f"{path.name}.ppl.json"
    cmd = [sys.executable, "-m", "blockscale.cli", "eval", "ppl", str(path), "--max-tokens", str(args.eval_tokens),
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())["ppl"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="gptq")
    p.add_argument("--w4a4", action="store_true")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--n-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--out-dir", default="runs/bench_torchrun")
    p.add_argument("--eval-tokens", type=int, default=0, help="also the perplexity of each checkpoint (0: none)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    root = Path(args.out_dir)
    rows = []
    for n in args.nproc:
        out = root / f"nproc{n}"
        if out.exists():
            shutil.rmtree(out)  # our own earlier output
        root.mkdir(parents=True, exist_ok=True)
        rows.append(run(n, args, out))
        print(f"nproc {n}: {rows[-1]['wall_s']:.1f} s wall, {rows[-1]['ptq_s']:.1f} s PTQ", flush=True)
    ref = checkpoint_tensors(root / f"nproc{args.nproc[0]}")
    for r in rows:
        r["wall_ratio"] = rows[0]["wall_s"] / r["wall_s"]
        r["ptq_ratio"] = rows[0]["ptq_s"] / r["ptq_s"]
        r["bytes_changed"], r["max_rel_float"] = distance(checkpoint_tensors(root / f"nproc{r['nproc']}"), ref)
        r["ppl"] = perplexity(root / f"nproc{r['nproc']}", args) if args.eval_tokens else None
    print(f"\n{args.model}, {args.method}{' w4a4' if args.w4a4 else ''}, {args.n_samples} x {args.seq_len} calibration "
          f"tokens, batch {args.batch_size}, {args.threads} thread(s) per process; {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()}), torch {torch.__version__}")
    print("| processes | wall (s) | PTQ (s) | speed-up wall | speed-up PTQ | code/scale bytes differing "
          "| max rel. float diff | ppl |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ppl = f"{r['ppl']:.4f}" if r["ppl"] is not None else "-"
        print(f"| {r['nproc']} | {r['wall_s']:.1f} | {r['ptq_s']:.1f} | {r['wall_ratio']:.2f}x | "
              f"{r['ptq_ratio']:.2f}x | {100 * r['bytes_changed']:.3f}% | {r['max_rel_float']:.2g} | {ppl} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
