"""Why dual scales diverge: per-step gradients of the pre / post block amaxes and how many codes and
stored scales each step changes, for tied and the dual variants, from one RTN start.

    python experiments/lsq_dual_diagnosis.py --model stories260k --steps 60 --lr 0.01 --param log \
        --out runs/dual-diagnosis-stories260k.json

Each variant trains the same batches (``lsq.distill``'s batch rule) with AdamW (no weight decay, clip 1.0)
on T^2 KL to the full-precision model and records per step: the loss; the RMS gradient of the pre and post
parameters and the cosine between dL/dpre and dL/dpost (in amax units); the share of weight codes
(computed with s_pre) and of stored scales (s_post) that changed in the step; the RMS of
log(s_post / s_pre); and at the end the held-out perplexity. The report is a markdown table on stdout.
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

from blockscale import lsq
from blockscale.data.text_sources import calibration_batches
from blockscale.eval.next_token import output_logits
from blockscale.lsq.quantizer import block_scales
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl

# (label, mode, dual_form, lr_pre_factor, freeze_pre_steps)
VARIANTS = [
    ("tied", "tied", "pair", 1.0, 0),
    ("dual pair (write-up)", "dual", "pair", 1.0, 0),
    ("dual pair, pre lr x0.1", "dual", "pair", 0.1, 0),
    ("dual pair, pre frozen", "dual", "pair", 0.0, 0),
    ("dual ratio", "dual", "ratio", 1.0, 0),
]


@torch.no_grad()
def _codes_and_scales(student):
    """Per learner: (2 q: the E2M1 values doubled, integers; s_pre; s_post), from the learner's forward."""
    out = []
    for m in lsq.learner_modules(student):
        pre, post = m.amaxes()
        S = m.encode_scale.reshape(-1, 1, 1) if m.weight.dim() == 3 else m.encode_scale
        s_pre = block_scales(pre, S)
        s_post = s_pre if post is None else block_scales(post, S)
        xq = m().reshape(*pre.shape, 16)
        q2 = torch.round(xq * (S.unsqueeze(-1) if S.dim() else S) / s_post.unsqueeze(-1).clamp_min(1e-30) * 2)
        out.append((torch.where(s_post.unsqueeze(-1) > 0, q2, torch.zeros_like(q2)), s_pre, s_post))
    return out


def _batch(tokens, step, batch_size, seq_len):
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, tokens.shape[0], (batch_size,), generator=g)
    offs = torch.randint(0, tokens.shape[1] - seq_len + 1, (batch_size,), generator=g)
    return tokens[rows[:, None], offs[:, None] + torch.arange(seq_len)[None, :]].long()


def run_variant(lm, d, tokens, args, label, mode, form, pre_factor, freeze_pre):
    student = copy.deepcopy(lm.model)
    calibrate_and_quantize(student, lm.tokenizer, PTQConfig(method="rtn", activations=args.activations,
                                                             skip_indivisible=True, n_samples=32, seq_len=256),
                           d.calib, d.calib_bos, progress=False)
    lsq.enable(student, mode=mode, init="stored", weights=lm.model, param=args.param, dual_form=form)
    teacher = lm.model.eval()
    for p in list(teacher.parameters()) + list(student.parameters()):
        p.requires_grad_(False)
    learners = lsq.learner_modules(student)
    names = learners[0].parameter_names()
    firsts = [getattr(m, names[0]) for m in learners]
    seconds = [getattr(m, names[1]) for m in learners] if mode == "dual" else []
    for p in firsts + seconds:
        p.requires_grad_(True)
    pre_lr = args.lr * (pre_factor if form == "pair" else 1.0)
    groups = [{"params": firsts, "lr": pre_lr}] + ([{"params": seconds, "lr": args.lr}] if seconds else [])
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    rows = []
    prev = _codes_and_scales(student)
    t0 = time.time()
    for step in range(args.steps):
        x = _batch(tokens, step, args.batch_size, args.seq_len)
        with torch.no_grad():
            t = output_logits(teacher(x))
        loss, _, _ = lsq.distill_loss(output_logits(student(x)), t, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # gradients in amax units: d/damax = d/dlog / amax for the log parameterisation
        g_pre = torch.cat([p.grad.flatten() for p in firsts])
        row = {"step": step + 1, "loss": float(loss), "rms_grad_first": float(g_pre.pow(2).mean().sqrt())}
        if seconds:
            g_post = torch.cat([p.grad.flatten() for p in seconds])
            row["rms_grad_second"] = float(g_post.pow(2).mean().sqrt())
            row["cos_first_second"] = float(torch.nn.functional.cosine_similarity(g_pre, g_post, dim=0))
        torch.nn.utils.clip_grad_norm_(firsts + seconds, 1.0)
        opt.step()
        now = _codes_and_scales(student)
        n = sum(c.numel() for c, _, _ in now)
        nb = sum(s.numel() for _, s, _ in now)
        row["codes_changed"] = sum(int((a[0] != b[0]).sum()) for a, b in zip(now, prev)) / n
        row["pre_scales_changed"] = sum(int((a[1] != b[1]).sum()) for a, b in zip(now, prev)) / nb
        row["post_scales_changed"] = sum(int((a[2] != b[2]).sum()) for a, b in zip(now, prev)) / nb
        lr_ratio = torch.cat([torch.log(torch.where((s_pre > 0) & (s_post > 0), s_post / s_pre.clamp_min(1e-30),
                                                    torch.ones_like(s_pre))).flatten() for _, s_pre, s_post in now])
        row["rms_log_post_over_pre"] = float(lr_ratio.pow(2).mean().sqrt())
        prev = now
        rows.append(row)
        if (step + 1) % 10 == 0:
            print(f"{label}: step {step + 1} loss {row['loss']:.4f} codes changed {100 * row['codes_changed']:.3f}%",
                  flush=True)
    seconds_taken = time.time() - t0
    student.eval()
    with torch.no_grad():
        ppl = evaluate_ppl(student, lm.tokenizer, d.eval_held_out, d.ctx, d.bos, args.eval_tokens).ppl
    return {"label": label, "mode": mode, "dual_form": form, "lr_pre_factor": pre_factor, "rows": rows,
            "ppl": ppl, "seconds": seconds_taken}


def report(res: dict) -> str:
    m = res["meta"]
    lines = [f"Model {m['model']} ({m['activations']}), RTN start ppl {m['rtn_ppl']:.4f}, full precision "
             f"{m['fp_ppl']:.4f}; {m['steps']} steps of {m['batch_size']} x {m['seq_len']} tokens, lr {m['lr']:g}, "
             f"param {m['param']!r}.", "",
             "| variant | ppl after | loss step 1 -> last | RMS dL/d(first) | RMS dL/d(second) | cos(first, second) "
             "| codes changed / step | post scales changed / step | RMS log(s_post/s_pre) at end |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in res["variants"]:
        r = v["rows"]
        mean = lambda k: sum(x.get(k, float("nan")) for x in r) / len(r)  # noqa: E731
        sec = f"{mean('rms_grad_second'):.3g}" if "rms_grad_second" in r[0] else ""
        cos = f"{mean('cos_first_second'):+.3f}" if "cos_first_second" in r[0] else ""
        lines.append(f"| {v['label']} | {v['ppl']:.4f} | {r[0]['loss']:.4f} -> {r[-1]['loss']:.4f} | "
                     f"{mean('rms_grad_first'):.3g} | {sec} | {cos} | {100 * mean('codes_changed'):.3f}% | "
                     f"{100 * mean('post_scales_changed'):.3f}% | {r[-1]['rms_log_post_over_pre']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--activations", default="w4a16", choices=("w4a16", "w4a4"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--param", default="log", choices=lsq.LSQ_PARAMS)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    lm = load_model(args.model)
    d = default_texts(args.model)
    held_out = "tinystories#0:0.8" if args.model.lower() == "stories260k" else d.eval
    d = type("D", (), {**d.__dict__, "eval_held_out": held_out})
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {"variants": []}
    if "meta" not in res:
        student = copy.deepcopy(lm.model)
        calibrate_and_quantize(student, lm.tokenizer, PTQConfig(method="rtn", activations=args.activations,
                                                                 skip_indivisible=True, n_samples=32, seq_len=256),
                               d.calib, d.calib_bos, progress=False)
        res["meta"] = {"model": args.model, "activations": args.activations, "steps": args.steps, "lr": args.lr,
                       "param": args.param, "batch_size": args.batch_size, "seq_len": args.seq_len,
                       "fp_ppl": evaluate_ppl(lm.model, lm.tokenizer, held_out, d.ctx, d.bos, args.eval_tokens).ppl,
                       "rtn_ppl": evaluate_ppl(student, lm.tokenizer, held_out, d.ctx, d.bos, args.eval_tokens).ppl}
    tokens = calibration_batches(lm.tokenizer, d.calib, 256, args.seq_len, seed=0, bos=d.calib_bos)
    done = {v["label"] for v in res["variants"]}
    for label, mode, form, pre_factor, freeze in VARIANTS:
        if label in done or (args.only and label not in args.only):
            continue
        res["variants"].append(run_variant(lm, d, tokens, args, label, mode, form, pre_factor, freeze))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
