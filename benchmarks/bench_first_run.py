"""What a user pays the first time: each case runs in a fresh Python process with an empty torch.compile
cache (a new TORCHINDUCTOR_CACHE_DIR), one case at a time.

    python benchmarks/bench_first_run.py [--case quantize|lsq|all] [--model smollm2-135m] [--steps 8]
                                         [--backend auto] [--markdown]

quantize: ``bs.quantize(torch.randn(4096, 4096), bs.NVFP4(scale_rule="4over6"))``: the first call, the second
    and third calls, and the eager reference's call in the same process (the baseline).
lsq: a scale-learning run as ``learn-scales`` makes it (RTN W4A16 NVFP4, ``lsq.enable`` with the recovery
    pipeline's dual value scales and latent weights, T^2 KL distillation from the full-precision model, AdamW),
    batch 4 x 128 tokens: the time of every step; the first step against the median of the last half.

The child processes import blockscale from this interpreter's path (``PYTHONPATH`` decides which checkout:
that is how the previous commit was measured for docs/results/first-run.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

QUANTIZE = r"""
import json, time, torch
t0 = time.perf_counter()
import blockscale as bs
t_import = time.perf_counter() - t0
x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
spec = bs.NVFP4(scale_rule="4over6")
calls = []
for _ in range(3):
    t = time.perf_counter(); q = bs.quantize(x, spec); calls.append(time.perf_counter() - t)
with bs.use_backend("reference"):
    t = time.perf_counter(); r = bs.quantize(x, spec); ref = time.perf_counter() - t
same = torch.equal(q.codes, r.codes) and torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))
print(json.dumps({"import_s": t_import, "calls_s": calls, "reference_s": ref, "bit_identical": same}))
"""

LSQ = r"""
import json, sys, time, torch
from blockscale.lsq import distill_loss
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig, quantize_model
model_name, steps = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, sys.argv[3])
from bench_lsq_step import learnable
import copy
torch.manual_seed(0)
teacher = load_model(model_name).model.eval()
student = copy.deepcopy(teacher)
quantize_model(student, PTQConfig(method="rtn", skip_indivisible=True), progress=False)
params = learnable(student, "dual", "all")
opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
vocab = teacher.config.vocab_size
x = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(1))
times, losses = [], []
for i in range(steps):
    t0 = time.perf_counter()
    with torch.no_grad():
        t_logits = teacher(x).logits
    loss = distill_loss(student(x).logits, t_logits, x)[0]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
print(json.dumps({"steps_s": times, "losses": losses}))
"""


def run_child(code: str, args: list[str], backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bs-first-run-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, BLOCKSCALE_BACKEND=backend, BLOCKSCALE_QUIET="1")
        env.pop("TRITON_INTERPRET", None)
        out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="all", choices=("quantize", "lsq", "all"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", default="auto", choices=("auto", "compiled", "reference"))
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error("--steps must be >= 2")
    import torch

    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs ({platform.machine()}), backend={a.backend}, "
          "empty compile cache per case")
    if a.case in ("quantize", "all"):
        r = run_child(QUANTIZE, [], a.backend)
        c = r["calls_s"]
        print("| case | first call s | 2nd s | 3rd s | eager reference s | first / reference | bit-identical |")
        print("|---|---:|---:|---:|---:|---:|---|")
        print(f"| quantize 4096x4096 NVFP4 4/6 | {c[0]:.2f} | {c[1]:.2f} | {c[2]:.2f} | {r['reference_s']:.2f} | "
              f"{c[0] / r['reference_s']:.2f} | {r['bit_identical']} |")
    if a.case in ("lsq", "all"):
        r = run_child(LSQ, [a.model, str(a.steps), os.path.dirname(os.path.abspath(__file__))], a.backend)
        t = r["steps_s"]
        later = statistics.median(t[len(t) // 2:])
        print(f"| {a.model} scale-learning step | " + " | ".join(f"{s:.1f}" for s in t)
              + f" | first / median(last half) = {t[0] / later:.2f} |")
        print("losses: " + ", ".join(f"{v:.6f}" for v in r["losses"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
