"""blockscale's zero-shot suite (``bs.eval.zero_shot``: last word on held-out TinyStories / WikiText-2 passages, next
sentence among four; ours, not a standard benchmark) and WikiText-2 perplexity of SmolLM2-135M at full precision,
NVFP4 RTN W4A16 (scale to 6), RTN + Four Over Six, Hessian-aware block scales, and after the recovery pipeline
(the Hessian-aware model + 50 distillation steps learning its block scales and weights with lsq's defaults, as
``blockscale demo`` runs them).

    python experiments/zero_shot_results.py --out runs/zero-shot-smollm2 --max-minutes 90      # resumable
    python experiments/zero_shot_results.py --report-only runs/zero-shot-smollm2 > docs/results/zero-shot.md

Each finished cell is one JSON line in OUT/results.jsonl; a rerun skips the cells there (``--max-minutes``: no new
cell starts after that many minutes; rerun to go on). ``--activations w4a16 w4a4`` adds the W4A4 rows.
``--model stories260k --limit 8 --eval-tokens 2048 --steps 4`` is a smoke run (tests/eval/test_zero_shot_results.py).
Calibration (32 x 512 tokens) and distillation (512 x 128 tokens, 16 held out to choose the step) on C4 (stories260K:
``tinystories#0.8:1``); the suite's items and the perplexity text are disjoint from both.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from blockscale import lsq
from blockscale.data.text_sources import calibration_batches
from blockscale.eval import DEFAULT_ITEMS, ZERO_SHOT_TASKS, zero_shot
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import default_texts, evaluate_ppl

MODELS = {
    "smollm2-135m": dict(eval="wikitext2", eval_tokens=40 * 1024, ctx=1024, skip_indivisible=False),
    "stories260k": dict(eval="tinystories#0:0.8", eval_tokens=128 * 512, ctx=512, skip_indivisible=True),
}
CALIB_SAMPLES, CALIB_SEQ_LEN = 32, 512  # the demo's calibration
TRAIN_SAMPLES, TRAIN_SEQ_LEN = 512, 128  # the demo's distillation windows
PTQ = {  # label -> PTQConfig fields
    "RTN (scale to 6)": dict(method="rtn"),
    "RTN + 4/6": dict(method="rtn", scale_rule="4over6"),
    "Hessian-aware scales": dict(method="rtn", scale_rule="hessian"),
}
RECOVERED = "Hessian-aware scales + recovery"
FP = "full precision"


class Results:
    """OUT/results.jsonl: one JSON object per finished cell, by key."""

    def __init__(self, out: Path):
        self.path = out / "results.jsonl"
        self.rows = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()] if self.path.exists() \
            else []

    def get(self, key):
        return next((r for r in self.rows if r["key"] == key), None)

    def add(self, row):
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def measure(model, lm, spec, d, args) -> dict:
    """The cell's numbers: perplexity and the zero-shot suite."""
    t = time.time()
    rec = evaluate_ppl(model, lm.tokenizer, spec["eval"], spec["ctx"], d.bos, args.eval_tokens or spec["eval_tokens"])
    ppl_s = time.time() - t
    zs = zero_shot(model, lm.tokenizer, ZERO_SHOT_TASKS, args.limit, bos=d.bos != "none",
                   log=lambda line: print(f"  {line}", flush=True))
    return {"ppl": rec.ppl, "tokens_evaluated": rec.tokens_evaluated, "ppl_seconds": ppl_s, **zs.as_dict()}


def _config(label: str, acts: str, spec) -> PTQConfig:
    return PTQConfig(activations=acts, n_samples=CALIB_SAMPLES, seq_len=CALIB_SEQ_LEN,
                     skip_indivisible=spec["skip_indivisible"], **PTQ[label])


def _recover(lm, d, student, steps: int, out: Path, key: str) -> dict:
    """The recovery pipeline on ``student`` (a ``lsq.quantize_student`` result), in place: its summary."""
    tokens = calibration_batches(lm.tokenizer, d.calib, TRAIN_SAMPLES, TRAIN_SEQ_LEN, seed=1, bos=d.calib_bos)
    cfg = lsq.RecoveryConfig(lsq.recovery_distill_config(steps, out_dir=str(out / "train" / key.replace(" ", "_"))),
                             holdout=lsq.RECOVERY_HOLDOUT)
    res = lsq.recover(student.model, lm.model, tokens, cfg, weights=student.weights, progress=False)
    return {k: res.distill[k] for k in ("best_step", "first_loss", "final_loss", "trainable_params")}


class Budget:
    def __init__(self, minutes):
        self.t0, self.minutes = time.time(), minutes

    def spent(self) -> bool:
        return self.minutes is not None and time.time() - self.t0 >= 60 * self.minutes


def _cells(args) -> list:
    """(key, activations, label) of every cell, in order."""
    out = [(FP, None, FP)]
    for acts in args.activations:
        out += [(f"{label} | {acts}", acts, label) for label in (*PTQ, RECOVERED)]
    return out


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec, d = MODELS[args.model], default_texts(args.model)
    res, budget = Results(out), Budget(args.max_minutes)
    todo = [c for c in _cells(args) if res.get(c[0]) is None]
    if not todo:
        print(f"every cell is in {res.path}", flush=True)
        return 0
    if budget.spent():
        print(f"--max-minutes {args.max_minutes:g} spent; rerun to go on", flush=True)
        return 0
    meta = {"model": args.model, **spec, "eval_tokens": args.eval_tokens or spec["eval_tokens"],
            "limit": args.limit or DEFAULT_ITEMS, "steps": args.steps, "calib": d.calib, "bos": d.bos,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    lm = load_model(args.model)
    for key, acts, label in todo:
        if budget.spent():
            print(f"--max-minutes {args.max_minutes:g} spent; rerun to go on", flush=True)
            return 0
        print(f"[{key}]", flush=True)
        t = time.time()
        extra = {}
        if label == FP:
            model = lm.model
        elif label in PTQ:
            model = lsq.quantize_student(lm.model, lm.tokenizer, _config(label, acts, spec), d.calib, d.calib_bos,
                                         progress=False).model
        else:
            student = lsq.quantize_student(lm.model, lm.tokenizer, _config("Hessian-aware scales", acts, spec),
                                           d.calib, d.calib_bos, progress=False)
            extra = _recover(lm, d, student, args.steps, out, key)
            model = student.model
        seconds = time.time() - t
        res.add({"key": key, "label": label, "activations": acts, "steps": args.steps if label == RECOVERED else None,
                 "quantize_seconds": seconds, **extra, **measure(model, lm, spec, d, args)})
    return 0


def _cell(r, fp, task, field="acc") -> str:
    v = r["tasks"][task][field]
    base = fp["tasks"][task][field] if fp is not None else None
    return f"{v:.3f}" + (f" ({100 * v / base:.0f}%)" if base else "")


def _mean(r) -> float:
    return sum(t["acc"] for t in r["tasks"].values()) / len(r["tasks"])


def report(out: Path) -> str:
    meta = json.loads((out / "meta.json").read_text())
    res = Results(out)
    fp = res.get(FP)
    tasks = list(ZERO_SHOT_TASKS)
    lines = [f"# Zero-shot accuracy and perplexity of {meta['model']}: full precision, NVFP4 PTQ, recovery", "",
             f"Generated by `python experiments/zero_shot_results.py --out {out}` then `python "
             f"experiments/zero_shot_results.py --report-only {out}`.", "",
             f"blockscale's own zero-shot suite (docs/evaluation.md; **not a standard benchmark**), {meta['limit']} "
             f"items per task; in brackets: the accuracy relative to full precision (recovery). Perplexity: first "
             f"{meta['eval_tokens']} tokens of `{meta['eval']}`, ctx {meta['ctx']}. Calibration and distillation on "
             f"`{meta['calib']}`; recovery: {meta['steps']} steps (lsq's defaults). {meta['threads']} CPU threads, "
             f"torch {meta['torch']}.", "",
             "| model | ppl | " + " | ".join(tasks) + " | next sentence acc_norm | mean acc |",
             "|---|---:|" + "---:|" * (len(tasks) + 2)]
    for r in res.rows:
        name = r["label"] + (f" ({r['activations'].upper()})" if r["activations"] else "")
        base = _mean(fp) if fp is not None else None
        mean = f"{_mean(r):.3f}" + (f" ({100 * _mean(r) / base:.0f}%)" if base else "")
        gap = f" ({100 * (r['ppl'] / fp['ppl'] - 1):+.1f}%)" if fp is not None and r is not fp else ""
        lines.append(f"| {name} | {r['ppl']:.3f}{gap} | " + " | ".join(_cell(r, fp, t) for t in tasks)
                     + f" | {_cell(r, fp, 'next_sentence_tinystories', 'acc_norm')} | {mean} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=tuple(MODELS))
    p.add_argument("--out", default="runs/zero-shot-smollm2")
    p.add_argument("--activations", nargs="+", default=["w4a16"], choices=("w4a16", "w4a4"))
    p.add_argument("--limit", type=int, default=None, help=f"items per task (default {DEFAULT_ITEMS})")
    p.add_argument("--eval-tokens", type=int, default=None, help="perplexity tokens (default: the model's)")
    p.add_argument("--steps", type=int, default=50, help="distillation steps of the recovery pipeline")
    p.add_argument("--max-minutes", type=float, default=None, help="start no cell after this many minutes")
    p.add_argument("--report-only", metavar="DIR", help="print the markdown table of a finished (or partial) run")
    args = p.parse_args(argv)
    if args.report_only:
        sys.stdout.write(report(Path(args.report_only)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
