"""How much of a ``--ce-weight`` run's gain is fine-tuning rather than recovery (issue 32)?

lsq's defaults with the next-token loss mixed into the KL (``learn-scales --ce-weight W``) take a quantized model
past what the KL alone reaches: the cross entropy on the training text also teaches the model that text. This
control trains the *full-precision* model the same way (the same training windows as
experiments/recovery_results.py, the same loss ``T^2 KL(teacher || student) + W * CE`` against the frozen original,
batch size and steps, warm-up a tenth, cosine, clip 1.0, the held-out best step on the same 16 windows every
fifth of the run, the start included) with AdamW on the decoder Linears' weights (what learn-scales trains; embeddings, norms and lm_head frozen)
at a raw lr, and evaluates it as the quantized runs are. Its perplexity is the reference a ``--ce-weight`` run
should be measured against.

    python experiments/ce_finetune_control.py --model smollm2-135m --ce-weight 0.5 --lr 2e-4 5e-5

One JSON row per lr.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import recovery_results as R  # noqa: E402

from blockscale import lsq  # noqa: E402
from blockscale.data.text_sources import calibration_batches  # noqa: E402
from blockscale.lsq.distill import eval_distill_loss, window_loss  # noqa: E402


def train(lm, tokens, held, steps, lr, ce_weight, every):
    student = copy.deepcopy(lm.model)
    for p in student.parameters():
        p.requires_grad_(False)
    params = [m.weight for n, m in student.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    g = torch.Generator().manual_seed(0)
    cfg = lsq.DistillConfig(batch_size=4, seq_len=tokens.shape[1], ce_weight=ce_weight)  # the loss and its batches
    best = (eval_distill_loss(student, lm.model, held, cfg), 0, [p.detach().clone() for p in params])
    losses = [[0, best[0]]]
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = tokens[torch.randint(0, tokens.shape[0], (4,), generator=g)]
        loss = window_loss(student, lm.model, x, "cpu", cfg)[0]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % every == 0 or step == steps:
            h = eval_distill_loss(student, lm.model, held, cfg)
            losses.append([step, h])
            if h < best[0]:
                best = (h, step, [p.detach().clone() for p in params])
    with torch.no_grad():
        for p, b in zip(params, best[2]):
            p.copy_(b)
    return student, best[1], losses, (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(R.MODELS))
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--lr", type=float, nargs="+", default=[2e-4])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    spec, lm, d = R.model_and_texts(args.model)
    torch.manual_seed(0)
    tokens = calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                 bos=d.calib_bos)
    tokens, held = lsq.split_holdout(tokens, lsq.RECOVERY_HOLDOUT)
    fp = R._ppl(lm.model, lm, spec, d)
    for lr in args.lr:
        student, kept, losses, sps = train(lm, tokens, held, args.steps, lr, args.ce_weight, max(1, args.steps // 5))
        print(json.dumps({"model": args.model, "student": "full precision", "ce_weight": args.ce_weight, "lr": lr,
                          "steps": args.steps, "fp_ppl": fp, "ppl": R._ppl(student, lm, spec, d), "best_step": kept,
                          "eval_losses": losses, "seconds_per_step": sps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
