"""Recovering the 4-bit loss: how much of the RTN -> full-precision perplexity gap each stage of the
pipeline closes (PTQ, then learned block scales and latent weights at 50 / 100 / 200 steps), W4A16 and W4A4,
and the same for the variants (scales only, tied vs dual, raw vs log amax units, constant vs cosine lr,
learning rates, learned W4A4 input scales, larger batches).

    python experiments/recovery_results.py --model stories260k --out runs/recovery-stories260k      # resumable
    python experiments/recovery_results.py --model smollm2-135m --out runs/recovery-smollm2         # resumable
    python experiments/recovery_results.py --report-only runs/recovery-smollm2 runs/recovery-stories260k \
        --notes docs/results/recovery-reading.md > docs/results/recovery.md
    python experiments/recovery_results.py --model qwen2.5-coder-0.5b --out runs/recovery-qwen05 \
        --activations w4a16 --only 'defaults (learn-scales --steps 50)'    # a model nobody tuned on: lsq's defaults

Models: the two the defaults were chosen on (stories260k, smollm2-135m: every run) and Qwen2.5-Coder-0.5B-Instruct
(the GGUF of experiments/fetch_qwen_gguf.py --model 0.5b; only the runs that name it: lsq's defaults unchanged).
The tables this script runs (``MODELS``, ``STARTS``, ``PTQ_ROWS``, ``RUNS``) are in
experiments/recovery_protocol.py. The PTQ rows include GPTQ, AWQ and AutoRound started from the Hessian-aware
scales; ``--only LABEL`` with a PTQ row's label runs that row.

``--only NAME ...`` runs just those runs (e.g. ``pipeline``), ``--activations w4a16`` one activation mode.
The pipeline: PTQ with Hessian-aware block scales (``scale_rule="hessian"``), then distillation from the
full-precision model with dual scales whose pre amaxes stay at the PTQ scales (codes from the PTQ grid, learned
value scales: the dual fix of docs/lsq.md) in log units at lr 3e-3, and the latent FP32 weights at lr
``LR_WEIGHTS``, cosine with 10 warm-up steps, one 200-step schedule evaluated at 50 / 100 / 200; latent weights
from ``quantize_model(latent_weights=...)`` / ``lsq.exact_latent_weights``. W4A4 runs it twice: with the
activations scaled to 6 (what serving engines compute) and with Four Over Six on the activations.
Evaluation: SmolLM2 on the first 40 windows of WikiText-2 test at ctx 1024; stories260K on the first 128
windows of 512 of the held-out TinyStories split (``tinystories#0:0.8``). Calibration and training
text: C4 (SmolLM2) / ``tinystories#0.8:1`` (stories260K), disjoint from the evaluation text. Every result is
one JSON line in OUT/results.jsonl; a rerun skips what is there, and a learned-scale run resumes from its
last milestone (``lsq.distill(..., resume=True)``: exact). Gap closed = (ppl_RTN - ppl) / (ppl_RTN - ppl_fp),
against RTN-6 with the same activations (W4A4: activations scaled to 6).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from blockscale import lsq
from blockscale.data.text_sources import calibration_batches
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_protocol import (AGH, GH, LR_SWEEP, MODELS, PIPELINE, PIPELINE_STARTS, PTQ_ROWS, RUNS,  # noqa: E402,F401
                               STARTS, TEXT_OVERRIDES, TUNING_MODELS, cli_defaults)


def probe_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments the probes built on these runs share (``--model``, ``--start``, ``--activations``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(MODELS))
    ap.add_argument("--start", default="GPTQ hessian", choices=sorted(STARTS))
    ap.add_argument("--activations", default="w4a4", choices=("w4a16", "w4a4"))
    return ap



def protocol_run(ap: argparse.ArgumentParser, args) -> tuple[dict, tuple]:
    """(settings, milestones) of the run ``args.run`` from ``args.start`` for ``args.model`` / ``args.activations``
    (the probes' ``--run``); one argparse error when it is not in the protocol or holds no windows out."""
    runs = [(st, s, m) for name, st, s, m in _runs(args.model, args.activations) if name == args.run]
    if not runs:
        ap.error(f"--run {args.run!r}: not a run of recovery_protocol.RUNS for --model {args.model} "
                 f"--activations {args.activations}")
    match = [(s, m) for st, s, m in runs if st == args.start]
    if not match:
        ap.error(f"--start {args.start!r}: --run {args.run!r} starts from one of {sorted({st for st, _, _ in runs})}")
    if not match[0][0].get("holdout"):
        ap.error(f"--run {args.run!r} holds no windows out (its settings have no holdout): choose a run that does")
    return match[0]


def model_and_texts(model: str):
    """(spec, loaded model, texts) of ``MODELS[model]``, as ``run_all`` uses them (for the diagnosis scripts)."""
    spec = MODELS[model]
    lm = load_model(spec.get("path", model))
    d = default_texts(spec.get("path", model))
    return spec, lm, dataclasses.replace(d, **{k: spec[k] for k in TEXT_OVERRIDES if k in spec})


def _ppl(model, lm, spec, d) -> float:
    return evaluate_ppl(model, lm.tokenizer, spec["eval"], spec["ctx"], d.bos, spec["eval_tokens"]).ppl


_CACHE: dict = {}  # (start, acts) -> (quantized model, seconds, latent): each PTQ runs once per process


def _quantized(lm, start: str, acts: str, spec, d, keep: bool = True):
    """The ``start`` quantization of a copy of the model, its seconds and latent weights; kept for the learned-scale
    runs that start from it when ``keep`` (a 0.5B model's copy and latent weights hold 4 GB), else handed over and
    dropped from the cache."""
    if (start, acts) in _CACHE:  # the last run from it takes the cached model itself (no copy, the cache freed)
        qm, sec, latent = _CACHE[(start, acts)] if keep else _CACHE.pop((start, acts))
        return (copy.deepcopy(qm) if keep else qm), sec, latent
    student = copy.deepcopy(lm.model)
    fields = dict(STARTS[start])  # a start may calibrate on more windows than the model's default
    cfg = PTQConfig(activations=acts, n_samples=fields.pop("n_samples", spec["calib_samples"]),
                    seq_len=spec["calib_seq_len"], skip_indivisible=spec["skip_indivisible"], **fields)
    t = time.time()
    latent = {}
    calibrate_and_quantize(student, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False, latent_weights=latent)
    sec = time.time() - t
    if keep:
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


def training_windows(lm, spec, d, s: dict, default: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The training windows of a run with settings ``s`` (its held-out ones still among them: ``lsq.split_holdout``
    takes them off the end): ``default`` (the model's windows, drawn once per process) unless the run asks for
    the same training tokens in longer windows, more windows, or the held-out windows from a part of the text of
    their own (the rows before 2026-12-06's thirteenth stop drew them among the training windows)."""
    L, n = s.get("seq_len", spec["train_seq_len"]), s.get("train_samples", spec["train_samples"])
    if default is not None and (L, n) == (spec["train_seq_len"], spec["train_samples"]) and not s.get("disjoint_holdout"):
        return default
    return calibration_batches(lm.tokenizer, d.calib, n * spec["train_seq_len"] // L, L, seed=1, bos=d.calib_bos,
                               holdout=s.get("holdout", 0) if s.get("disjoint_holdout") else 0)


def distill_config(s: dict, spec, steps: int, schedule_steps: int, out_dir, selecting: bool) -> lsq.DistillConfig:
    """The ``lsq.DistillConfig`` of a run with settings ``s`` up to ``steps`` of its ``schedule_steps``-step
    schedule (``decay_steps`` in ``s``: the schedule ends there, then ``min_lr_ratio`` of the lr to the end);
    ``selecting``: with held-out windows (best-step selection on the distillation loss, the lr retry)."""
    return lsq.DistillConfig(steps=steps, lr_scales=s["lr"], batch_size=s.get("batch_size", spec["batch_size"]),
                             seq_len=s.get("seq_len", spec["train_seq_len"]), lr_schedule=s["schedule"],
                             warmup_steps=s["warmup"], schedule_steps=s.get("decay_steps", schedule_steps),
                             lr_pre_factor=s.get("lr_pre_factor", 1.0), train=s.get("train", "scales"),
                             lr_weights=s.get("lr_weights", 1e-5), min_lr_ratio=s.get("min_lr_ratio", 0.0),
                             seed=s.get("seed", 0), out_dir=str(out_dir),
                             log_every=10, keep_best=selecting, eval_loss="distill" if selecting else "next_token",
                             eval_every=s.get("select_every", 0) if selecting else 0, ckpt_every=0,
                             lr_retries=s.get("lr_retries", 0) if selecting else 0, ce_weight=s.get("ce_weight", 0.0))


def lsq_student(lm, start: str, acts: str, s: dict, spec, d, keep: bool = True):
    """(student, PTQ seconds, latent weights dequantized, latent weights in all): the ``start`` quantization
    (``_quantized``) made trainable with the settings ``s`` (``lsq.enable``, init "stored"), its latent weights the
    full-precision (transformed) weights PTQ rounded where they reproduce its codes (``lsq.exact_latent_weights``)."""
    student, ptq_s, latent = _quantized(lm, start, acts, spec, d, keep=keep)
    weights, dequantized = lsq.exact_latent_weights(student, latent)
    lsq.enable(student, mode=s["mode"], init="stored", weights=weights, param=s["param"], dual_form=s["dual_form"],
               learn_input_scales=s.get("learn_input_scales", False), weight_units=s.get("weight_units", "raw"))
    n = len(weights)
    del weights, latent  # cloned into the LSQ layers: up to two more FP32 copies (2.9 GB on Qwen2.5-0.5B) not held
    return student, ptq_s, len(dequantized), n


def run_lsq(lm, spec, d, res, out, tokens, key, start, s, milestones, acts, keep: bool = True):
    """One learned-scale run: PTQ start (the ``start`` quantization, exactly), lsq.enable with the settings,
    distill to each milestone of one schedule of ``milestones[-1]`` steps, evaluating at each. ``keep``: keep the
    PTQ start for a later run of this process (on Qwen2.5-0.5B its copy and latent weights hold 4 GB: a run with
    the lr retry that kept them was killed for memory at its end)."""
    todo = [m for m in milestones if res.get(f"{key}@{m}") is None]
    if not todo:
        return
    tokens = training_windows(lm, spec, d, s, tokens)
    student, ptq_s, n_dequantized, n_latent = lsq_student(lm, start, acts, s, spec, d, keep=keep)
    tokens, held = lsq.split_holdout(tokens, s.get("holdout", 0))  # held-out windows choose the step
    if s.get("lr_retries") and len(milestones) > 1:
        raise SystemExit(f"run {key!r}: lr_retries needs one milestone (a retry restarts the schedule)")
    for m in milestones:
        cfg = distill_config(s, spec, m, milestones[-1], out / "train" / _dirname(key), selecting=held is not None)
        t = time.time()
        r = lsq.distill(student, lm.model, tokens, cfg, eval_tokens=held, resume=True, progress=False)
        train_s = time.time() - t
        if res.get(f"{key}@{m}") is not None:
            continue
        ppl = _ppl(student, lm, spec, d)
        res.add({"key": f"{key}@{m}", "run": key.split(" [")[0], "activations": acts, "start": start, "steps": m,
                 "settings": s, "ppl": ppl, "ptq_seconds": ptq_s, "train_seconds_segment": train_s,
                 "seconds_per_step": r["seconds_per_step"], "optimizer_state_bytes": r["optimizer_state_bytes"],
                 "trainable_params": r["trainable_params"], "final_loss": r["final_loss"],
                 "best_step": r["best_step"], "eval_losses": r["eval_losses"],
                 "latent_dequantized": n_dequantized, "latent_total": n_latent,
                 **({"attempts": r["attempts"]} if "attempts" in r else {})})


def _runs(model: str, acts: str):
    """(name, start, settings, milestones) of every run for ``model`` / ``acts``: RUNS (the pipeline once per
    pipeline start) and, in W4A16, the learning-rate sweep."""
    out = []
    for name, start, s, milestones, where in RUNS:
        if (where is None and model not in TUNING_MODELS) or (where is not None and f"{model}/{acts}" not in where):
            continue
        for st in (PIPELINE_STARTS[acts] if start == "pipeline" else (start,)):
            out.append((name, st, s, milestones))
    if acts == "w4a16":
        for lr, lw in LR_SWEEP.get(model, ()):
            out.append((f"lr {lr:g} / {lw:g}", PIPELINE_STARTS[acts][0], dict(PIPELINE, lr=lr, lr_weights=lw), (50,)))
    return out


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec = MODELS[args.model]
    if "path" in spec and not Path(spec["path"]).exists():
        how = ("python experiments/moe_ptq_results.py --out ~/.cache/blockscale/runs/moe-ptq --only RTN "
               "--activations w4a16" if args.model == "moe-3m" else "python experiments/fetch_qwen_gguf.py --model 0.5b")
        raise SystemExit(f"--model {args.model}: {spec['path']} is missing; make it first with {how}")
    spec, lm, d = model_and_texts(args.model)
    res = Results(out)
    meta = {"model": args.model, **{k: v for k, v in spec.items()}, "calib": d.calib, "bos": d.bos,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "pipeline": PIPELINE, "pipeline_starts": PIPELINE_STARTS}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    if res.get("fp") is None:
        res.add({"key": "fp", "ppl": _ppl(lm.model, lm, spec, d)})
    tokens = calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                 bos=d.calib_bos)
    for acts in args.activations:
        for start in ("RTN-6",) + PTQ_ROWS[args.model][acts]:
            key = f"ptq {start} | {acts}"
            if res.get(key) is None and (not args.only or start in PIPELINE_STARTS[acts] or start == "RTN-6"
                                         or start in args.only):
                used = any(st == start and (not args.only or name in args.only or f"{name} [{st}]" in args.only)
                           for name, st, _, _ in _runs(args.model, acts))
                qm, sec, _ = _quantized(lm, start, acts, spec, d, keep=used)
                res.add({"key": key, "start": start, "activations": acts, "ppl": _ppl(qm, lm, spec, d),
                         "ptq_seconds": sec})
                del qm
        todo = [(name, start, s, milestones) for name, start, s, milestones in _runs(args.model, acts)
                if not args.only or name in args.only or f"{name} [{start}]" in args.only]
        todo = [t for t in todo if any(res.get(f"{t[0]} [{t[1]}] | {acts}@{m}") is None for m in t[3])]
        for i, (name, start, s, milestones) in enumerate(todo):
            later = any(st == start for _, st, _, _ in todo[i + 1:])  # keep the PTQ start only for a later run
            run_lsq(lm, spec, d, res, out, tokens, f"{name} [{start}] | {acts}", start, s, milestones, acts,
                    keep=later)


def main(argv=None) -> int:
    import recovery_report  # (it imports this module's tables)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(MODELS))
    ap.add_argument("--out")
    ap.add_argument("--activations", nargs="+", default=["w4a16", "w4a4"], choices=("w4a16", "w4a4"))
    ap.add_argument("--only", nargs="*", help="run names to run (e.g. pipeline), or one run from one start as "
                    "'NAME [START]', or PTQ rows")
    ap.add_argument("--report-only", nargs="+", metavar="DIR")
    ap.add_argument("--notes")
    ap.add_argument("--title", help="the report's title (default: the recovery pipeline's)")
    ap.add_argument("--generated-by", help="the report's 'Generated by' paragraph (default: recovery.md's commands)")
    args = ap.parse_args(argv)
    if args.report_only:
        kw = {k: v for k, v in (("title", args.title), ("generated_by", args.generated_by)) if v}
        print(recovery_report.report(args.report_only, args.notes, **kw))
        return 0
    if not args.out:
        ap.error("--out is required (or --report-only)")
    run_all(args)
    print(recovery_report.report([args.out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
