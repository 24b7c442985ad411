"""Scale learning results: perplexity of an RTN-quantized model before and after learning its NVFP4
block scales by distillation (scale-only tied / dual, and full: weights + scales), W4A16 and W4A4.

    python experiments/lsq_results.py --out runs/lsq-smollm2                       # resumable
    python experiments/lsq_results.py --report-only runs/lsq-smollm2 --notes docs/results/scale-learning-reading.md \
        > docs/results/scale-learning.md

Training text: windows of the model's calibration text (C4 for SmolLM2); perplexity: the first
``--eval-tokens`` tokens of WikiText-2 test (held out: never trained on), ctx 1024, as in
docs/results/ptq.md. Each run continues its distillation from checkpoint to checkpoint
(``lsq.distill(..., resume=True)``, exact), evaluating at every milestone, and records one JSON per
run in OUT; a rerun skips what is there, and an interrupted run resumes from its last milestone.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

from blockscale import lsq
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl
from blockscale.data.text_sources import calibration_batches

# (name, activations, mode, train, lr_scales, milestones or None for --milestones)
RUNS = [
    ("tied", "w4a16", "tied", "scales", 3e-3, None),
    ("tied", "w4a4", "tied", "scales", 3e-3, None),
    ("dual", "w4a16", "dual", "scales", 3e-3, None),
    ("dual", "w4a4", "dual", "scales", 3e-3, None),
    ("full (tied)", "w4a16", "tied", "all", 3e-3, [50, 100]),
    ("full (tied)", "w4a4", "tied", "all", 3e-3, [50, 100]),
    # the write-up's learning rate: 50 steps
    ("tied, lr 1e-4", "w4a16", "tied", "scales", 1e-4, [50]),
    ("tied, lr 1e-4", "w4a4", "tied", "scales", 1e-4, [50]),
]


def _key(name: str, acts: str) -> str:
    return f"{acts}-" + name.replace(" ", "").replace(",", "-").replace("(", "-").replace(")", "")


def _ppl(model, lm, d, n):
    return evaluate_ppl(model, lm.tokenizer, d.eval, d.ctx, d.bos, n).ppl


def _student(teacher_lm, acts, args, d):
    student = copy.deepcopy(teacher_lm.model)
    cfg = PTQConfig(method="rtn", scale_rule="6", activations=acts, n_samples=args.calib_samples,
                    seq_len=args.calib_seq_len)
    calibrate_and_quantize(student, teacher_lm.tokenizer, cfg, d.calib, d.calib_bos)
    return student


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    lm = load_model(args.model)
    d = default_texts(args.model)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if "fp_ppl" not in meta:
        meta = {"model": args.model, "fp_ppl": _ppl(lm.model, lm, d, args.eval_tokens), "eval": d.eval,
                "eval_tokens": args.eval_tokens, "ctx": d.ctx, "train_text": d.calib,
                "batch_size": args.batch_size, "seq_len": args.seq_len, "n_samples": args.n_samples,
                "milestones": args.milestones, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "machine": platform.machine(), "init": "RTN, scale rule 6"}
        meta_path.write_text(json.dumps(meta, indent=2))
    print(f"full precision ppl {meta['fp_ppl']:.3f}", flush=True)
    tokens = calibration_batches(lm.tokenizer, d.calib, args.n_samples, args.seq_len, seed=0, bos=d.calib_bos)
    for name, acts, mode, train, lr, own in RUNS:
        key = _key(name, acts)
        if args.only and key not in args.only:
            continue
        path = out / f"{key}.json"
        rec = json.loads(path.read_text()) if path.exists() else {"name": name, "activations": acts, "mode": mode,
                                                                 "train": train, "lr_scales": lr, "ppl": {}}
        todo = [m for m in (own or args.milestones) if str(m) not in rec["ppl"]]
        if not todo and "0" in rec["ppl"]:
            print(f"{key}: done", flush=True)
            continue
        print(f"== {key} ==", flush=True)
        student = _student(lm, acts, args, d)
        lsq.enable(student, mode=mode, init="stored", weights=lm.model)
        if "0" not in rec["ppl"]:
            rec["ppl"]["0"] = _ppl(student, lm, d, args.eval_tokens)
            print(f"{key} step 0: ppl {rec['ppl']['0']:.3f}", flush=True)
        for m in todo:
            cfg = lsq.DistillConfig(train=train, steps=m, lr_scales=lr, lr_weights=1e-5, batch_size=args.batch_size,
                                    seq_len=args.seq_len, seed=0, out_dir=str(out / key), log_every=10)
            t = time.time()
            res = lsq.distill(student, lm.model, tokens, cfg, resume=True, progress=args.progress)
            if res["seconds_per_step"] is not None:
                rec.setdefault("step_seconds", []).append([res["steps"], res["seconds_per_step"], time.time() - t])
            rec.update(trainable_params=res["trainable_params"], optimizer_state_bytes=res["optimizer_state_bytes"])
            rec["ppl"][str(m)] = _ppl(student, lm, d, args.eval_tokens)
            print(f"{key} step {m}: ppl {rec['ppl'][str(m)]:.3f}  ({res['seconds_per_step'] or 0:.2f} s/step)",
                  flush=True)
            path.write_text(json.dumps(rec, indent=2))
        path.write_text(json.dumps(rec, indent=2))
    # sizes for the memory comparison
    n_all = sum(p.numel() for p in lm.model.parameters())
    meta["model_params"] = n_all
    meta_path.write_text(json.dumps(meta, indent=2))


def report(dirs, notes: str | None = None) -> str:
    lines = ["# Scale learning (LSQ) on NVFP4: results", "",
             "Generated by `python experiments/lsq_results.py --out runs/lsq-smollm2` then "
             "`python experiments/lsq_results.py --report-only runs/lsq-smollm2 --notes docs/results/scale-learning-reading.md "
             "> docs/results/scale-learning.md` (the reading is written by hand).",
             ""]
    for d in dirs:
        d = Path(d)
        meta = json.loads((d / "meta.json").read_text())
        recs = {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("w4a*.json"))}
        ms = ["0"] + [str(m) for m in meta["milestones"]]
        fp = meta["fp_ppl"]
        lines += [f"## {meta['model']}", "",
                  f"Init: {meta['init']} (step 0 equals the PTQ model bit for bit). Training: "
                  f"{meta['batch_size']} x {meta['seq_len']} tokens per step from {meta['n_samples']} windows of "
                  f"`{meta['train_text']}`, loss T^2 KL to the full-precision model (T = 1), AdamW, clip 1.0. "
                  f"Perplexity: first {meta['eval_tokens']} tokens of `{meta['eval']}` (ctx {meta['ctx']}; held "
                  f"out, never trained on). Full precision: **{fp:.3f}**. {meta['threads']} CPU threads, "
                  f"torch {meta['torch']}.", ""]
        for acts in ("w4a16", "w4a4"):
            order = [_key(r[0], r[1]) for r in RUNS]
            rows = [recs[k] for k in sorted(recs, key=lambda k: order.index(k) if k in order else len(order))
                    if recs[k]["activations"] == acts]
            if not rows:
                continue
            lines += [f"### {acts.upper()}", "",
                      "| run | lr (scales) | PTQ init | " + " | ".join(f"step {m}" for m in ms[1:])
                      + " | gap closed: step 50 / last | s/step (fastest segment) |",
                      "|---|---:|" + "---:|" * (len(ms) + 2)]
            for r in rows:
                p = r["ppl"]
                cells = [f"{p[m]:.3f}" if m in p else "" for m in ms]
                last = max((m for m in ms if m in p), key=int)
                def closed(m):  # the fraction of the PTQ model's ppl gap that step m recovered
                    return (p["0"] - p[m]) / (p["0"] - fp) if p.get("0", fp) != fp else 0.0
                sps = [s[1] for s in r.get("step_seconds", [])]
                sps = f"{min(sps):.2f}" if sps else ""  # the least disturbed segment (shared machine)
                lr = f"{r['lr_scales']:g}" + (" / 1e-05 (weights)" if r["train"] == "all" else "")
                lines.append(f"| {r['name']} | {lr} | " + " | ".join(cells) + f" | {100 * closed('50'):.0f}% / {100 * closed(last):.0f}% (step {last}) "
                             f"| {sps} |")
            lines.append("")
        # memory
        seen = {}
        for r in recs.values():
            if "trainable_params" in r:
                seen[(r["mode"], r["train"])] = r
        if seen:
            n_all = meta.get("model_params")
            lines += ["### Trainable parameters and optimizer memory", "",
                      "| what trains | trainable parameters | AdamW state |", "|---|---:|---:|"]
            for (mode, train), r in sorted(seen.items()):
                what = {"scales": f"block amaxes only ({mode})", "all": f"quantized weights + amaxes ({mode})"}[train]
                lines.append(f"| {what} | {r['trainable_params']:,} | {r['optimizer_state_bytes'] / 2**20:.1f} MiB |")
            if n_all:
                lines.append(f"| full QAT of every parameter (incl. embeddings) | {n_all:,} | "
                             f"{n_all * 8 / 2**20:.1f} MiB (2 FP32 moments) |")
            lines.append("")
    if notes:
        lines += ["## Reading", "", Path(notes).read_text().strip(), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs/lsq-smollm2")
    ap.add_argument("--milestones", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--n-samples", type=int, default=256, help="training windows")
    ap.add_argument("--calib-samples", type=int, default=32, help="W4A4 activation calibration windows")
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--only", nargs="*", help="run keys to run (e.g. w4a16-tied)")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--report-only", nargs="+", metavar="DIR")
    ap.add_argument("--notes", help="a markdown file appended as the report's 'Reading' section")
    args = ap.parse_args(argv)
    if args.report_only:
        print(report(args.report_only, args.notes))
        return 0
    args.milestones = sorted(set(args.milestones))
    run_all(args)
    print(report([args.out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
