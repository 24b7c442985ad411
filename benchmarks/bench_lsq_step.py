"""Time per scale-learning (LSQ distillation) step with the eager reference LSQ quantizer vs the compiled one,
same run, same model, same batch; the two must give the same loss and gradients bit for bit.

    python benchmarks/bench_lsq_step.py [--model smollm2-135m] [--mode dual] [--train all] [--batch 4]
                                        [--seq 128] [--steps 3] [--warmup 2] [--markdown]

A step = teacher forward + student forward (every NVFP4Linear an LSQLinear: fake quantization of the latent
weight with trainable block amaxes) + T^2 KL + backward + AdamW update, as ``lsq.distill`` does; the median of
``--steps`` timed steps after ``--warmup`` (which absorb torch.compile). The model is RTN-quantized W4A16 first
(no calibration). Both backends start from copies of the same model and must agree on every loss and on the
trained parameters at the end (checked; the benchmark fails otherwise).
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time

import torch

import blockscale as bs
from blockscale import lsq
from blockscale.lsq import distill_loss
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig, quantize_model


def learnable(student, mode: str, train: str) -> list:
    """Make ``student``'s NVFP4 block scales learnable in place (``lsq.enable``, log units; with ``train`` "all"
    the latent weights too) and freeze everything else; returns the trained parameters."""
    lsq.enable(student, mode=mode, init="stored", param="log", train_weights=train == "all")
    params = lsq.scale_parameters(student) + (lsq.weight_parameters(student) if train == "all" else [])
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


def time_backend(backend: str, student, teacher, x, mode: str, train: str, steps: int, warmup: int):
    student = copy.deepcopy(student)
    params = learnable(student, mode, train)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    times, losses = [], []
    with bs.use_backend(backend):
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            with torch.no_grad():
                t_logits = teacher(x).logits
            loss = distill_loss(student(x).logits, t_logits, x)[0]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    return statistics.median(times), losses, [p.detach().clone() for p in params]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--mode", default="dual", choices=("tied", "dual"))
    ap.add_argument("--train", default="all", choices=("scales", "all"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    lm = load_model(args.model)
    teacher = lm.model.eval()
    student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig(method="rtn", skip_indivisible=True), progress=False)
    vocab = teacher.config.vocab_size
    x = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    res = {b: time_backend(b, student, teacher, x, args.mode, args.train, args.steps, args.warmup)
           for b in ("reference", "auto")}
    same = res["reference"][1] == res["auto"][1] and all(
        torch.equal(a, b) for a, b in zip(res["reference"][2], res["auto"][2]))
    head = (f"# {args.model}, W4A16 RTN, lsq {args.mode} (log units), train {args.train}, batch {args.batch} x "
            f"seq {args.seq}, median of {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}, "
            f"{platform.machine()}, {torch.get_num_threads()} threads")
    ref, fast = res["reference"][0], res["auto"][0]
    if args.markdown:
        print(head)
        print("| LSQ quantizer | s/step | vs reference |\n|---|---:|---:|")
        print(f"| eager reference | {ref:.2f} | 1.00x |\n| compiled (auto) | {fast:.2f} | {ref / fast:.2f}x faster |")
    else:
        print(head)
        print(f"reference {ref:.2f} s/step, compiled {fast:.2f} s/step ({ref / fast:.2f}x)")
    print(f"losses and trained parameters bit-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
