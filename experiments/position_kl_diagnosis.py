"""Does the distillation loss on short training windows see what the evaluation at long context sees (issue 32)?

On Qwen2.5-Coder-0.5B the learned-scale runs' held-out distillation loss (KL to the full-precision model on 128-token
C4 windows) was the same at their step 0 for GPTQ (0.042775) and RTN hessian (0.042777), while WikiText-2 perplexity
at ctx 1024 separates them (33.80 vs 35.39; full precision 33.04). This script quantizes the model with several PTQ
starts of experiments/recovery_results.py (W4A16, calibrated as there) and measures, on held-out windows of 1024
tokens of the calibration corpus (its second half, never calibrated on), the per-token KL(teacher || student) and
the student's negative log-likelihood, averaged over position buckets [0, 128), [128, 256), [256, 512), [512, 1024).

    python experiments/position_kl_diagnosis.py --model qwen2.5-coder-0.5b --starts RTN-6 "RTN hessian" GPTQ

One JSON row per start (the full-precision model's NLL per bucket first).

    python experiments/position_kl_diagnosis.py --model qwen2.5-coder-0.5b --heldout --starts RTN-6 GPTQ

instead quantizes as experiments/recovery_results.py does (the whole calibration text) and prints each start's
distillation loss on the held-out windows of its learned runs (what their step 0 recorded).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import recovery_results as R  # noqa: E402

from blockscale import lsq  # noqa: E402
from blockscale.data.text_sources import calibration_batches  # noqa: E402
from blockscale.lsq.distill import eval_distill_loss  # noqa: E402
from blockscale.ptq import PTQConfig  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize  # noqa: E402

BUCKETS = ((0, 128), (128, 256), (256, 512), (512, 1024))


def bucket_means(per_token: torch.Tensor) -> dict:
    """Mean over windows and positions of ``per_token`` [windows, positions] in each of BUCKETS."""
    return {f"{a}-{b}": float(per_token[:, a:b].mean()) for a, b in BUCKETS if a < per_token.shape[1]}


@torch.no_grad()
def per_token(model, windows: torch.Tensor, teacher_logp=None):
    """(NLL of the next token [W, L-1], KL(teacher || model) [W, L-1] or None, the model's log-probs per window)."""
    nll, kl, logps = [], [], []
    for i, w in enumerate(windows):
        logp = F.log_softmax(model(w[None]).logits[0, :-1].float(), dim=-1)
        nll.append(-logp.gather(-1, w[1:, None])[:, 0])
        if teacher_logp is not None:
            t = teacher_logp[i]
            kl.append((t.exp() * (t - logp)).sum(-1))
        logps.append(logp)
    return torch.stack(nll), (torch.stack(kl) if kl else None), logps


def heldout_losses(lm, spec, d, model: str, starts) -> int:
    tokens = calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                 bos=d.calib_bos)
    held = lsq.split_holdout(tokens, lsq.RECOVERY_HOLDOUT)[1]
    cfg = lsq.DistillConfig(steps=1, batch_size=spec["batch_size"], seq_len=spec["train_seq_len"], eval_loss="distill")
    for start in starts:
        student = R._quantized(lm, start, "w4a16", spec, d, keep=False)[0]  # as the learned runs start
        with torch.no_grad():
            loss = eval_distill_loss(student, lm.model, held, cfg)
        print(json.dumps({"model": model, "start": start, "heldout_windows": list(held.shape),
                          "heldout_distill_loss": loss}), flush=True)
        del student
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(R.MODELS))
    ap.add_argument("--starts", nargs="+", default=["RTN-6", "RTN hessian"], choices=sorted(R.STARTS))
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--heldout", action="store_true", help="the learned runs' held-out distillation loss instead")
    args = ap.parse_args(argv)
    spec, lm, d = R.model_and_texts(args.model)
    torch.manual_seed(0)
    if args.heldout:
        return heldout_losses(lm, spec, d, args.model, args.starts)
    base = d.calib.split("#")[0]
    calib, held = f"{base}#0:0.5", f"{base}#0.5:1"
    windows = calibration_batches(lm.tokenizer, held, args.windows, args.length, seed=7, bos=d.calib_bos)
    nll_fp, _, teacher = per_token(lm.model, windows)
    print(json.dumps({"model": args.model, "start": "fp", "held": held, "windows": args.windows,
                      "nll": bucket_means(nll_fp)}), flush=True)
    for start in args.starts:
        t0 = time.perf_counter()
        student = copy.deepcopy(lm.model)
        cfg = PTQConfig(activations="w4a16", n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"],
                        skip_indivisible=spec["skip_indivisible"], **R.STARTS[start])
        calibrate_and_quantize(student, lm.tokenizer, cfg, calib, d.calib_bos, progress=False)
        nll, kl, _ = per_token(student, windows, teacher)
        print(json.dumps({"model": args.model, "start": start, "calib": calib, "seconds": time.perf_counter() - t0,
                          "kl": bucket_means(kl), "nll_minus_fp": bucket_means(nll - nll_fp),
                          "kl_first128_vs_all": [float(kl[:, :128].mean()), float(kl.mean())]}), flush=True)
        del student
    return 0


if __name__ == "__main__":
    sys.exit(main())
