"""PTQ comparison: perplexity of NVFP4 post-training quantization methods, W4A16 and W4A4.

    python experiments/ptq_results.py --model smollm2-135m --eval-tokens 16384 --out runs/ptq-smollm2
    python experiments/ptq_results.py --model stories260k --out runs/ptq-stories260k
    python experiments/ptq_results.py --report-only runs/ptq-smollm2 runs/ptq-stories260k > docs/results/ptq.md
    python experiments/ptq_results.py --model stories260k --only RTN-6 'RTN hessian' AWQ GPTQ AutoRound \
        --out runs/autoround-stories260k          # the AutoRound comparison: the rows it ran
    python experiments/ptq_results.py --report-only runs/autoround-stories260k \
        --title 'AutoRound against GPTQ and AWQ' > docs/results/autoround.md

Each finished configuration is appended to OUT/results.jsonl; a rerun skips those already there.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from blockscale.models.hf import load_model
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig
from blockscale.ptq.pipeline import default_texts, evaluate_ppl, quantized_copy

# (name, PTQConfig fields); each runs as W4A16 and as W4A4
METHODS = [
    ("RTN-6", dict(method="rtn")),
    ("RTN-4/6 (MSE)", dict(method="rtn", scale_rule="4over6", error="mse")),
    ("RTN-4/6 (MAE)", dict(method="rtn", scale_rule="4over6", error="mae")),
    ("sweep", dict(method="rtn", scale_rule="sweep")),
    # AWQ as measured in results/ptq.md: without auto-clip (explicit, whatever the default)
    ("AWQ", dict(method="awq", options=AWQOptions(clip=False))),
    ("AWQ+4/6", dict(method="awq", scale_rule="4over6", options=AWQOptions(clip=False))),
    ("SmoothQuant", dict(method="smoothquant")),
    ("SmoothQuant+4/6", dict(method="smoothquant", scale_rule="4over6")),
    ("GPTQ", dict(method="gptq")),
    ("GPTQ+4/6 (plain)", dict(method="gptq", scale_rule="4over6", options=GPTQOptions(four_over_six="plain"))),
    ("GPTQ+4/6 (aware)", dict(method="gptq", scale_rule="4over6", options=GPTQOptions(four_over_six="aware"))),
    ("RTN hessian", dict(method="rtn", scale_rule="hessian")),
    ("AutoRound", dict(method="autoround")),
    ("AutoRound+4/6", dict(method="autoround", scale_rule="4over6")),
    ("AutoRound hessian", dict(method="autoround", scale_rule="hessian")),
    # W4A4 only: Four Over Six on the activations too
    ("RTN-4/6, activations 4/6", dict(method="rtn", scale_rule="4over6", act_scale_rule="4over6")),
    ("GPTQ+4/6 (aware), activations 4/6", dict(method="gptq", scale_rule="4over6", act_scale_rule="4over6")),
    ("AutoRound hessian, activations 4/6", dict(method="autoround", scale_rule="hessian", act_scale_rule="4over6")),
]
W4A4_ONLY = {"RTN-4/6, activations 4/6", "GPTQ+4/6 (aware), activations 4/6", "AutoRound hessian, activations 4/6"}


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done_file = out / "results.jsonl"
    done = {json.loads(line)["key"] for line in done_file.read_text().splitlines()} if done_file.exists() else set()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    d = default_texts(args.model)
    eval_src = args.eval or ("tinystories#0:0.8" if args.model == "stories260k" else d.eval)
    meta = {"model": args.model, "eval": eval_src, "ctx": d.ctx, "bos": d.bos, "eval_tokens": args.eval_tokens,
            "calib": d.calib, "n_samples": args.n_samples, "seq_len": args.seq_len, "threads": args.threads,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "only": args.only}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))

    def record(key, label, acts, rec, seconds):
        with open(done_file, "a") as f:
            f.write(json.dumps({"key": key, "label": label, "activations": acts, "ppl": rec.ppl, "loss": rec.loss,
                                "tokens": rec.tokens_evaluated, "quantize_seconds": seconds}) + "\n")
        print(f"{key:40s} ppl {rec.ppl:8.4f}  quantize {seconds:6.1f} s  eval {rec.seconds:5.1f} s", flush=True)

    if "fp" not in done:
        rec = evaluate_ppl(lm.model, lm.tokenizer, eval_src, d.ctx, d.bos, args.eval_tokens)
        record("fp", "full precision", "-", rec, 0.0)
    skip_indivisible = args.model == "stories260k"  # its MLP width 172 is not a multiple of 16
    for acts in args.activations:
        for label, fields in METHODS:
            key = f"{label} {acts}"
            if key in done or (args.only and not any(o in label for o in args.only)):
                continue
            if acts == "w4a16" and label in W4A4_ONLY:
                continue
            cfg = PTQConfig(activations=acts, n_samples=args.n_samples, seq_len=args.seq_len,
                            skip_indivisible=skip_indivisible, **fields)
            t0 = time.time()
            qm, rep = quantized_copy(lm.model, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
            seconds = time.time() - t0
            rec = evaluate_ppl(qm, lm.tokenizer, eval_src, d.ctx, d.bos, args.eval_tokens)
            record(key, label, acts, rec, seconds)
            del qm


def report(dirs, title: str, dest: str) -> None:
    print(f"# {title}\n")
    print("Command (from the repository root; each model's table is one run):\n")
    print("```")
    for d in dirs:
        meta = json.loads((Path(d) / "meta.json").read_text())
        tok = f" --eval-tokens {meta['eval_tokens']}" if meta["eval_tokens"] else ""
        only = " --only " + " ".join(f"'{o}'" for o in meta["only"]) if meta.get("only") else ""
        samples = f" --n-samples {meta['n_samples']}" if meta["n_samples"] != 128 else ""
        print(f"python experiments/ptq_results.py --model {meta['model']}{tok}{samples}{only} --out {d}")
    extra = "" if dest == "docs/results/ptq.md" else f" --title '{title}'"
    print(f"python experiments/ptq_results.py --report-only {' '.join(dirs)}{extra} > {dest}")
    print("```\n")
    for d in dirs:
        meta = json.loads((Path(d) / "meta.json").read_text())
        rows = [json.loads(line) for line in (Path(d) / "results.jsonl").read_text().splitlines()]
        fp = next(r for r in rows if r["key"] == "fp")
        by = {(r["label"], r["activations"]): r for r in rows}
        print(f"## {meta['model']}\n")
        print(f"Evaluation: `{meta['eval']}`" + (f", first {meta['eval_tokens']} tokens" if meta["eval_tokens"] else "")
              + f", ctx {meta['ctx']}, BOS: {meta['bos']}, {fp['tokens']} tokens scored. Calibration: "
              f"{meta['n_samples']} random windows of {meta['seq_len']} tokens from `{meta['calib']}` (disjoint from "
              f"the evaluation text). Full precision: **ppl {fp['ppl']:.4f}**. Gap = ppl / full-precision ppl - 1; "
              "closed = share of RTN-6's gap that the method removes. Time = calibration + quantization, "
              f"{meta['threads']} CPU threads (wall clock on a shared machine: indicative only)."
              + (" The five MLP down-projections (172 inputs, not a multiple of 16) stay in high precision "
                 "(`skip_indivisible`)." if meta["model"] == "stories260k" else "") + "\n")
        print("| method | W4A16 ppl | gap | closed | time | W4A4 ppl | gap | closed | time |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, _ in METHODS:
            if not any((label, acts) in by for acts in ("w4a16", "w4a4")):
                continue  # a run with --only: the rows it has
            cells = []
            for acts in ("w4a16", "w4a4"):
                r = by.get((label, acts))
                base = by.get(("RTN-6", acts))
                if r is None:
                    cells += ["", "", "", ""]
                    continue
                gap = r["ppl"] / fp["ppl"] - 1
                closed = "" if base is None or label == "RTN-6" else \
                    f"{100 * (1 - gap / (base['ppl'] / fp['ppl'] - 1)):+.0f}%"
                cells += [f"{r['ppl']:.4f}", f"{100 * gap:+.2f}%", closed, f"{r['quantize_seconds']:.1f} s"]
            print(f"| {label} | " + " | ".join(cells) + " |")
        print()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs/ptq")
    p.add_argument("--eval", help="evaluation text source (default: wikitext2; tinystories#0:0.8 for stories260k)")
    p.add_argument("--eval-tokens", type=int, default=None, help="first N tokens only (default: all)")
    p.add_argument("--n-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--activations", nargs="+", default=["w4a16", "w4a4"], choices=("w4a16", "w4a4"))
    p.add_argument("--only", nargs="+", help="run only methods whose label contains one of these strings")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report-only", nargs="+", metavar="RUN_DIR", help="print the markdown table of finished runs")
    p.add_argument("--title", default="Post-training quantization to NVFP4: perplexity by method",
                   help="the report's title (--report-only)")
    p.add_argument("--dest", default=None, help="the file the report is meant for (named in its command line; "
                   "default docs/results/ptq.md, or docs/results/autoround.md with --title)")
    args = p.parse_args(argv)
    if args.report_only:
        dest = args.dest or ("docs/results/ptq.md" if args.title == p.get_default("title")
                             else "docs/results/autoround.md")
        report(args.report_only, args.title, dest)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
