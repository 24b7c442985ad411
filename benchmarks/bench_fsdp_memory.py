"""Per-rank memory of ``learn-scales`` training steps with FSDP2 vs DDP (2 gloo processes on CPU).

    python benchmarks/bench_fsdp_memory.py [--model smollm2-135m] [--nproc 2] [--steps 2] [--seq-len 64]
                                           [--batch-size 1] [--param-dtype fp32] [--threads 1] [--json FILE]
                                           [--out-dir runs/bench_fsdp_memory]

For each mode (ddp, fsdp): ``torchrun --standalone --nproc_per_node N`` of this file as a worker; each rank
loads the model (the teacher), makes the student (deepcopy, RTN NVFP4 with ``quantize_model``, ``lsq.enable``
with the teacher's weights: latent FP32 weights + block amaxes, train="scales"), and runs ``lsq.distill`` for
``--steps`` steps on random token windows (DDP, or ``DistillConfig(fsdp=True)``: student and teacher sharded).
Measured per rank from /proc/self/status: RSS once the models are built (before any wrapping: both modes hold
the full models here, as every rank loads them), and the peak RSS of the training steps before the last
one (the peak is reset, ``echo 5 > /proc/self/clear_refs``, at the first micro step and read at the start
of the last step: forward, backward and optimizer steps including the optimizer state's allocation, never
the end-of-run gathering; --steps 2 measures the first step). Also the optimizer state bytes each rank holds. CPU only (RSS); on a
GPU the same question is torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    """A /proc/self/status value in bytes (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(args) -> None:
    import torch

    from blockscale import lsq
    from blockscale.models.hf import load_model
    from blockscale.ptq import PTQConfig, quantize_model

    torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", 0))
    t0 = time.perf_counter()
    teacher = load_model(args.model).model.eval()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(), progress=False)  # RTN, NVFP4 W4A16
    lsq.enable(student, mode="tied", weights=teacher)
    built_rss = _status("VmRSS")
    vocab = teacher.config.vocab_size
    tokens = torch.randint(0, vocab, (16, args.seq_len), generator=torch.Generator().manual_seed(0))
    mark = {"peak": None, "optimizer_state_bytes": None}
    task_cls = sys.modules["blockscale.lsq.distill"].DistillTask
    loss, lr = task_cls.loss, task_cls.lr

    def first_loss(self, model, step, micro, info, device):
        if step == 0 and micro == 0:
            with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS to the current RSS
                f.write("5")
        return loss(self, model, step, micro, info, device)

    def step_lr(self, step):  # called on every rank at the start of each step
        if step == args.steps - 1:
            mark["peak"] = _status("VmHWM")
        return lr(self, step)
    task_cls.loss, task_cls.lr = first_loss, step_lr
    cfg = lsq.DistillConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr_scales=1e-3,
                            log_every=1, fsdp=args.worker == "fsdp", fsdp_param_dtype=args.param_dtype)
    t1 = time.perf_counter()
    res = lsq.distill(student, teacher, tokens, cfg, progress=False)
    out = {"mode": args.worker, "rank": rank, "built_rss": built_rss, "train_peak_rss": mark["peak"],
           "optimizer_state_bytes": res["optimizer_state_bytes"], "seconds_per_step": res["seconds_per_step"],
           "setup_s": t1 - t0, "final_loss": res["final_loss"]}
    Path(args.result_dir, f"{args.worker}-{rank}.json").write_text(json.dumps(out))


def launch(mode: str, args, result_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           str(Path(__file__).resolve()), "--worker", mode, "--result-dir", str(result_dir), "--model", args.model,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--param-dtype", args.param_dtype, "--threads", str(args.threads)]
    subprocess.run(cmd, env=env, check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (>= 2; the peak covers all but the last)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp"], choices=("ddp", "fsdp"),
                   help="the modes to run now (the table also shows the other mode's rows already in --out-dir)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--out-dir", default="runs/bench_fsdp_memory", help="per-rank results, kept as each mode ends")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    settings = {k: getattr(args, k) for k in ("model", "nproc", "steps", "seq_len", "batch_size", "param_dtype",
                                              "threads")}
    tmp = Path(args.out_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    for mode in ("ddp", "fsdp"):
        if mode in args.modes:
            t = time.perf_counter()
            launch(mode, args, tmp)
            wall = time.perf_counter() - t
            for rank in range(args.nproc):
                f = Path(tmp, f"{mode}-{rank}.json")
                f.write_text(json.dumps({**json.loads(f.read_text()), "wall_s": round(wall, 1), "settings": settings}))
        for rank in range(args.nproc):
            f = Path(tmp, f"{mode}-{rank}.json")
            row = json.loads(f.read_text()) if f.exists() else None
            if row is not None and row.get("settings") == settings:
                rows.append(row)
    mib = 1 << 20
    print(f"{args.model}, {args.nproc} processes, {args.steps} steps, batch {args.batch_size} x {args.seq_len} "
          f"tokens per rank, --fsdp-param-dtype {args.param_dtype}")
    print("| mode | rank | RSS after load (MiB) | peak RSS of the steps (MiB) | optimizer state (MiB) | s/step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['rank']} | {r['built_rss'] / mib:.0f} | {r['train_peak_rss'] / mib:.0f} | "
              f"{r['optimizer_state_bytes'] / mib:.1f} | {r['seconds_per_step']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
