"""Recovering the 4-bit loss: how much of the RTN -> full-precision perplexity gap each stage of the
pipeline closes (PTQ, then learned block scales at 50 / 100 / 200 steps), W4A16 and W4A4, and the same for
the learned-scale variants (tied vs dual, raw vs log amax units, constant vs cosine lr, learning rates,
learned W4A4 input scales).

    python experiments/recovery_results.py --model stories260k --out runs/recovery-stories260k      # resumable
    python experiments/recovery_results.py --model smollm2-135m --out runs/recovery-smollm2 --only pipeline \
        --activations w4a16       # and --activations w4a4 (the other SmolLM2 runs: drop --only; --all: all)
    python experiments/recovery_results.py --report-only runs/recovery-smollm2 runs/recovery-stories260k \
        --notes docs/results/recovery-reading.md > docs/results/recovery.md

The pipeline: the best PTQ start among ``CANDIDATES`` (lowest perplexity in the run), then scale learning
with dual scales whose pre amaxes stay at the PTQ scales (only the value scales learn: the dual fix of
docs/lsq.md), log units, lr 1e-2, cosine with 10 warm-up steps, one 200-step schedule evaluated at 50 / 100 /
200; latent weights from ``quantize_model(latent_weights=...)`` / ``lsq.exact_latent_weights``.
Evaluation: SmolLM2 on the first 40 windows of WikiText-2 test at ctx 1024; stories260K on the first 128
windows of 512 of the held-out TinyStories split (``tinystories#0:0.8``). Calibration and scale-learning
text: C4 (SmolLM2) / ``tinystories#0.8:1`` (stories260K), disjoint from the evaluation text. Every result is
one JSON line in OUT/results.jsonl; a rerun skips what is there, and a learned-scale run resumes from its
last milestone (``lsq.distill(..., resume=True)``: exact). Gap closed = (ppl_RTN - ppl) / (ppl_RTN - ppl_fp).
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
from blockscale.data.text_sources import calibration_batches
from blockscale.models.hf import load_model
from blockscale.ptq import GPTQOptions, PTQConfig
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl

MODELS = {
    "smollm2-135m": dict(eval="wikitext2", eval_tokens=40 * 1024, ctx=1024, calib_samples=32, calib_seq_len=512,
                         train_samples=512, train_seq_len=128, batch_size=4, skip_indivisible=False),
    "stories260k": dict(eval="tinystories#0:0.8", eval_tokens=128 * 512, ctx=512, calib_samples=128, calib_seq_len=512,
                        train_samples=512, train_seq_len=256, batch_size=4, skip_indivisible=True),
}

# PTQ starts: label -> PTQConfig fields (activations added per run)
STARTS = {
    "RTN-6": dict(method="rtn"),
    "AWQ+4/6": dict(method="awq", scale_rule="4over6"),
    "GPTQ+4/6 (aware)": dict(method="gptq", scale_rule="4over6", options=GPTQOptions(four_over_six="aware")),
    "RTN hessian": dict(method="rtn", scale_rule="hessian"),
}
# the pipeline's PTQ start: the candidate with the lowest perplexity in this run, per model and activations
# (the best methods of docs/results/ptq.md and the Hessian-aware rule of docs/ptq.md)
CANDIDATES = {"smollm2-135m": {"w4a16": ("RTN hessian",), "w4a4": ("AWQ+4/6",)},
              "stories260k": {"w4a16": ("GPTQ+4/6 (aware)", "RTN hessian"), "w4a4": ("GPTQ+4/6 (aware)", "RTN hessian")}}

# learned-scale runs: (key, start ("best" or a STARTS label), settings, milestones, activations or None for all).
# The pipeline's scale learning: dual scales with the pre amaxes frozen (codes from the PTQ scales, learned value
# scales; the dual fix of docs/lsq.md), log units, cosine lr with 10 warm-up steps.
PIPELINE = dict(mode="dual", param="log", dual_form="pair", lr=0.01, schedule="cosine", warmup=10, lr_pre_factor=0.0)
TIED = dict(PIPELINE, mode="tied", lr_pre_factor=1.0)
RUNS = [
    ("pipeline", "best", PIPELINE, (50, 100, 200), None),
    ("tied", "best", TIED, (50, 100, 200), None),
    ("from RTN, tied", "RTN-6", TIED, (50, 200), None),
    ("from RTN, dual pre frozen", "RTN-6", PIPELINE, (50, 200), None),
    # 50-step comparisons from the best PTQ start (each its own 50-step schedule)
    ("dual pair, pre frozen (the fix), log", "best", PIPELINE, (50,), None),
    ("tied, log, cosine", "best", TIED, (50,), None),
    ("tied, log, constant lr", "best", dict(TIED, schedule="constant", warmup=0), (50,), None),
    ("tied, raw amax (write-up units), cosine", "best", dict(TIED, param="amax", lr=3e-3), (50,), None),
    ("dual pair (write-up), log", "best", dict(PIPELINE, lr_pre_factor=1.0), (50,), None),
    ("dual ratio, log", "best", dict(PIPELINE, dual_form="ratio", lr_pre_factor=1.0), (50,), None),
]
# W4A4 only: the activation outer scales learned too (lsq.enable(learn_input_scales=True))
W4A4_RUNS = [("dual pre frozen, learned input scales", "best", dict(PIPELINE, learn_input_scales=True), (50,))]
# SmolLM2 (time): W4A16 all but these; W4A4 only the pipeline and the learned input scales (--all: everything)
SMOLLM2_SKIP_W4A16 = ("tied", "from RTN, dual pre frozen", "tied, log, constant lr", "dual ratio, log")
LR_SWEEP = (0.003, 0.01, 0.03)  # the pipeline's settings, 50 steps, W4A16 (the default's evidence)


def _ppl(model, lm, spec, d) -> float:
    return evaluate_ppl(model, lm.tokenizer, spec["eval"], spec["ctx"], d.bos, spec["eval_tokens"]).ppl


_CACHE: dict = {}  # (start, acts) -> (quantized model, seconds, latent): each PTQ runs once per process


def _quantized(lm, start: str, acts: str, spec, d):
    if (start, acts) in _CACHE:
        qm, sec, latent = _CACHE[(start, acts)]
        return copy.deepcopy(qm), sec, latent
    student = copy.deepcopy(lm.model)
    cfg = PTQConfig(activations=acts, n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"],
                    skip_indivisible=spec["skip_indivisible"], **STARTS[start])
    t = time.time()
    latent = {}
    calibrate_and_quantize(student, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False, latent_weights=latent)
    sec = time.time() - t
    _CACHE[(start, acts)] = (copy.deepcopy(student), sec, latent)
    return student, sec, latent


def _dirname(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in key)


class Results:
    def __init__(self, out: Path):
        self.path = out / "results.jsonl"
        self.rows = [json.loads(x) for x in self.path.read_text().splitlines()] if self.path.exists() else []

    def get(self, key):
        return next((r for r in self.rows if r["key"] == key), None)

    def add(self, row):
        self.rows = [r for r in self.rows if r["key"] != row["key"]] + [row]
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def run_lsq(lm, spec, d, res, out, tokens, key, start, s, milestones, acts, model):
    """One learned-scale run: PTQ start (the ``start`` quantization, exactly), lsq.enable with the settings,
    distill to each milestone of one schedule of ``milestones[-1]`` steps, evaluating at each."""
    todo = [m for m in milestones if res.get(f"{key}@{m}") is None]
    if not todo:
        return
    student, ptq_s, latent = _quantized(lm, start, acts, spec, d)
    # latent weights: the full-precision (transformed) weights PTQ rounded where they reproduce its codes
    weights, dequantized = lsq.exact_latent_weights(student, latent)
    lsq.enable(student, mode=s["mode"], init="stored", weights=weights, param=s["param"], dual_form=s["dual_form"],
               learn_input_scales=s.get("learn_input_scales", False))
    for m in milestones:
        cfg = lsq.DistillConfig(steps=m, lr_scales=s["lr"], batch_size=spec["batch_size"], seq_len=spec["train_seq_len"],
                                lr_schedule=s["schedule"], warmup_steps=s["warmup"], schedule_steps=milestones[-1],
                                lr_pre_factor=s.get("lr_pre_factor", 1.0),
                                min_lr_ratio=0.0, seed=0, out_dir=str(out / "train" / _dirname(key)), log_every=10)
        t = time.time()
        r = lsq.distill(student, lm.model, tokens, cfg, resume=True, progress=False)
        train_s = time.time() - t
        if res.get(f"{key}@{m}") is not None:
            continue
        ppl = _ppl(student, lm, spec, d)
        res.add({"key": f"{key}@{m}", "run": key.split(" [")[0], "activations": acts, "start": start, "steps": m,
                 "settings": s, "ppl": ppl, "ptq_seconds": ptq_s, "train_seconds_segment": train_s,
                 "seconds_per_step": r["seconds_per_step"], "optimizer_state_bytes": r["optimizer_state_bytes"],
                 "trainable_params": r["trainable_params"], "final_loss": r["final_loss"],
                 "latent_dequantized": len(dequantized), "latent_total": len(weights)})


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec = MODELS[args.model]
    lm = load_model(args.model)
    d = default_texts(args.model)
    res = Results(out)
    meta = {"model": args.model, **{k: v for k, v in spec.items()}, "calib": d.calib, "bos": d.bos,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "candidates": CANDIDATES[args.model]}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    if res.get("fp") is None:
        res.add({"key": "fp", "ppl": _ppl(lm.model, lm, spec, d)})
    tokens = calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                 bos=d.calib_bos)
    for acts in args.activations:
        for start in ("RTN-6",) + CANDIDATES[args.model][acts]:
            key = f"ptq {start} | {acts}"
            if res.get(key) is None:
                qm, sec, _ = _quantized(lm, start, acts, spec, d)
                res.add({"key": key, "start": start, "activations": acts, "ppl": _ppl(qm, lm, spec, d),
                         "ptq_seconds": sec})
        best = best_start(res, args.model, acts)
        extra = [(n, st, se, ms, None) for n, st, se, ms in W4A4_RUNS] if acts == "w4a4" else []
        for name, start, s, milestones, only in RUNS + extra:
            if (only and acts not in only) or (args.only and name not in args.only):
                continue
            if args.model == "smollm2-135m" and not args.all and (
                    (acts == "w4a4" and name != "pipeline" and not name.endswith("learned input scales"))
                    or (acts == "w4a16" and name in SMOLLM2_SKIP_W4A16)):
                continue  # SmolLM2: fewer runs (time), unless --all
            st = best if start == "best" else start
            run_lsq(lm, spec, d, res, out, tokens, f"{name} [{st}] | {acts}", st, s, milestones, acts, args.model)
        if acts == "w4a16" and (not args.only or "lr" in args.only):
            for lr in (args.lrs or LR_SWEEP):
                if lr == PIPELINE["lr"]:
                    continue  # that is "dual pair, pre frozen (the fix), log"
                run_lsq(lm, spec, d, res, out, tokens, f"lr {lr:g} [{best}] | {acts}", best, dict(PIPELINE, lr=lr),
                        (50,), acts, args.model)


def best_start(res, model: str, acts: str) -> str:
    """The candidate PTQ start with the lowest recorded perplexity."""
    done = [s for s in CANDIDATES[model][acts] if res.get(f"ptq {s} | {acts}") is not None]
    return min(done, key=lambda s: res.get(f"ptq {s} | {acts}")["ppl"]) if done else None


def _closed(ppl, rtn, fp):
    return 100.0 * (rtn - ppl) / (rtn - fp) if rtn != fp else float("nan")


def _label(s: dict) -> str:
    mode = "tied" if s["mode"] == "tied" else ("dual, pre frozen" if s.get("lr_pre_factor", 1.0) == 0 else
                                               f"dual {s['dual_form']}")
    return f"{mode}, {s['param']}, {s['schedule']}"


def report(dirs, notes=None) -> str:
    lines = ["# Recovering the 4-bit loss: PTQ, then learned block scales", "",
             "Generated by `python experiments/recovery_results.py --model M --out runs/recovery-M` (per model) then "
             "`python experiments/recovery_results.py --report-only runs/recovery-smollm2 runs/recovery-stories260k "
             "--notes docs/results/recovery-reading.md > docs/results/recovery.md` (the reading is written by hand).",
             ""]
    for dd in dirs:
        dd = Path(dd)
        meta = json.loads((dd / "meta.json").read_text())
        res = Results(dd)
        fp = res.get("fp")["ppl"]
        ev = (f"first {meta['eval_tokens'] // meta['ctx']} windows of `{meta['eval']}`" if meta["eval_tokens"]
              else f"all of `{meta['eval']}`")
        lines += [f"## {meta['model']}", "",
                  f"Evaluation: {ev}, ctx {meta['ctx']}. Calibration ({meta['calib_samples']} x {meta['calib_seq_len']} "
                  f"tokens) and scale learning ({meta['batch_size']} x {meta['train_seq_len']} tokens per step from "
                  f"{meta['train_samples']} windows) on `{meta['calib']}` (disjoint from the evaluation text). "
                  f"Full precision: **{fp:.4f}**. Learned scales: T^2 KL to the full-precision model (T = 1), AdamW, "
                  f"clip 1.0; {meta['threads']} CPU threads, torch {meta['torch']}.", ""]
        for acts in ("w4a16", "w4a4"):
            rtn = res.get(f"ptq RTN-6 | {acts}")
            if rtn is None:
                continue
            rtn = rtn["ppl"]
            best = best_start(res, meta["model"], acts)
            ptq = res.get(f"ptq {best} | {acts}")
            lines += [f"### {acts.upper()}: the pipeline", "",
                      "| stage | ppl | gap closed | wall time (cumulative) | optimizer state |", "|---|---:|---:|---:|---:|",
                      f"| full precision | {fp:.4f} | | | |", f"| RTN-6 | {rtn:.4f} | 0% | | |"]
            for c in CANDIDATES[meta["model"]][acts]:
                r = res.get(f"ptq {c} | {acts}")
                if r is not None and c != best:
                    lines.append(f"| (PTQ: {c}) | {r['ppl']:.4f} | {_closed(r['ppl'], rtn, fp):.0f}% | "
                                 f"{r['ptq_seconds']:.0f} s | |")
            if best is None:
                lines += [f"| (PTQ: {', '.join(CANDIDATES[meta['model']][acts])}: not run) | | | | |", ""]
                continue
            if ptq:
                lines.append(f"| PTQ: {best} | {ptq['ppl']:.4f} | {_closed(ptq['ppl'], rtn, fp):.0f}% | "
                             f"{ptq['ptq_seconds']:.0f} s | |")
            total = ptq["ptq_seconds"] if ptq else 0.0
            for m in (50, 100, 200):
                r = res.get(f"pipeline [{best}] | {acts}@{m}")
                if r is None:
                    continue
                total += r["train_seconds_segment"]
                lines.append(f"| + learned scales ({_label(r['settings'])}), step {m} of 200 | {r['ppl']:.4f} | "
                             f"{_closed(r['ppl'], rtn, fp):.0f}% | "
                             f"{total:.0f} s | {r['optimizer_state_bytes'] / 2**20:.1f} MiB |")
            for run, st in (("tied", best), ("from RTN, tied", "RTN-6"), ("from RTN, dual pre frozen", "RTN-6")):
                for m in (50, 100, 200):
                    r = res.get(f"{run} [{st}] | {acts}@{m}")
                    if r is not None:
                        lines.append(f"| ({st} + learned scales ({_label(r['settings'])}), step {m} of 200) | "
                                     f"{r['ppl']:.4f} | {_closed(r['ppl'], rtn, fp):.0f}% | | |")
            lines.append("")
            rows = [r for r in res.rows if r.get("activations") == acts and r.get("steps") == 50
                    and r["run"] not in ("pipeline", "tied", "from RTN, tied", "from RTN, dual pre frozen")
                    and r.get("start") == best]
            if rows:
                lines += [f"### {acts.upper()}: learned-scale variants, 50 steps from {best}", "",
                          "| variant | lr | ppl | gap closed | s/step | trainable | optimizer state |",
                          "|---|---:|---:|---:|---:|---:|---:|"]
                for r in rows:
                    s = r["settings"]
                    name = f"{_label(s)} (the pipeline's, another lr)" if r["run"].startswith("lr ") else r["run"]
                    lines.append(f"| {name} | {s['lr']:g} | {r['ppl']:.4f} | {_closed(r['ppl'], rtn, fp):.0f}% | "
                                 f"{r['seconds_per_step']:.2f} | {r['trainable_params']:,} | "
                                 f"{r['optimizer_state_bytes'] / 2**20:.1f} MiB |")
                lines.append("")
    if notes:
        lines += ["## Reading", "", Path(notes).read_text().strip(), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(MODELS))
    ap.add_argument("--out")
    ap.add_argument("--activations", nargs="+", default=["w4a16", "w4a4"], choices=("w4a16", "w4a4"))
    ap.add_argument("--only", nargs="*", help="run names to run (e.g. pipeline)")
    ap.add_argument("--all", action="store_true", help="SmolLM2: the 50-step comparisons in W4A4 too")
    ap.add_argument("--lrs", type=float, nargs="*", help=f"the learning-rate sweep (default {LR_SWEEP}; --only lr: "
                                                          "just the sweep)")
    ap.add_argument("--report-only", nargs="+", metavar="DIR")
    ap.add_argument("--notes")
    args = ap.parse_args(argv)
    if args.report_only:
        print(report(args.report_only, args.notes))
        return 0
    if not args.out:
        ap.error("--out is required (or --report-only)")
    run_all(args)
    print(report([args.out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
