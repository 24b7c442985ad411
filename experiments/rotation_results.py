"""Rotations for 4-bit PTQ (issue 33): SmolLM2-135M, NVFP4 and MXFP4, W4A4 and W4A16, RTN / GPTQ / Hessian-aware
scales / Four Over Six, each with no rotation, R4 only, R1R2R4, block-sized input rotations (``mr``: block 16 for
NVFP4, 32 for MX; with GPTQ this is MR-GPTQ) and R1R2 + mr. The protocol of docs/results/recovery.md (the same
evaluation windows and calibration text as experiments/recovery_results.py's SmolLM2 rows).

    python experiments/rotation_results.py --out ~/.cache/blockscale/runs/rotations              # resumable
    python experiments/rotation_results.py --pipeline-from 'RTN hessian|r1r2+mr' --activations w4a4   # then learning
    python experiments/rotation_results.py --report-only ~/.cache/blockscale/runs/rotations \
        --notes docs/results/rotations-reading.md > docs/results/rotations.md

``--pipeline-from 'METHOD|ROTATE'`` runs the recovery pipeline with lsq's defaults (learned scales and latent
weights, 50 steps, held-out best step, the lr retry: ``learn-scales --steps 50``; experiments/recovery_results.py's
"defaults with the lr retry") from that NVFP4 start, rotations fixed.
Every result is one JSON line in OUT/results.jsonl; a rerun skips what is there. ``--only-format nvfp4`` /
``--only-activations w4a4`` / ``--only-rotations none mr`` restrict the grid; ``--max-minutes M`` stops starting new cells after M minutes. Cells
run in ``CELLS`` order (NVFP4 W4A4 first: the issue's main goal). Gap closed = (ppl_RTN - ppl) / (ppl_RTN - ppl_fp)
against unrotated RTN with the same format and activations.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_results as rr  # noqa: E402  (the shared protocol)
from recovery_results import MODELS, Results, _ppl  # noqa: E402

from blockscale.models.hf import load_model  # noqa: E402
from blockscale.ptq import PTQConfig  # noqa: E402
from blockscale.ptq.config import DEFAULT_EXCLUDE  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts  # noqa: E402
from blockscale.recipes.ptq_recipe import PTQRecipe, Scheme  # noqa: E402

MODEL = "smollm2-135m"
ROTATIONS = ("none", "r4", "r1r2r4", "mr", "r1r2+mr")
# (format, activations, method label) -> PTQConfig fields
METHODS = {
    "nvfp4": {"RTN": dict(method="rtn"), "GPTQ": dict(method="gptq"), "RTN hessian": dict(method="rtn", scale_rule="hessian"),
              "RTN 4/6": dict(method="rtn", scale_rule="4over6"), "GPTQ 4/6": dict(method="gptq", scale_rule="4over6")},
    "mxfp4": {"RTN": dict(method="rtn"), "GPTQ": dict(method="gptq")},
}
# the grid in the order it runs: (format, activations, method, rotations)
CELLS = ([("nvfp4", "w4a4", m, ROTATIONS) for m in ("RTN", "GPTQ", "RTN hessian")]
         + [("mxfp4", "w4a4", m, ROTATIONS) for m in ("RTN", "GPTQ")]
         + [("nvfp4", "w4a4", m, ("none", "r1r2r4", "mr")) for m in ("RTN 4/6", "GPTQ 4/6")]
         + [("nvfp4", "w4a16", m, ROTATIONS) for m in ("RTN", "GPTQ", "RTN hessian")]
         + [("mxfp4", "w4a16", m, ROTATIONS) for m in ("RTN", "GPTQ")])


def _config(fmt: str, acts: str, method: str, rotate: str, spec) -> PTQConfig:
    fields = dict(METHODS[fmt][method])
    common = dict(n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"],
                  skip_indivisible=spec["skip_indivisible"], rotate=rotate)
    if fmt == "nvfp4":
        return PTQConfig(activations=acts, **fields, **common)
    scheme = Scheme("mxfp4" if acts == "w4a4" else "mxfp4-w4a16")
    return PTQConfig(recipe=PTQRecipe.single(scheme, ignore=DEFAULT_EXCLUDE), **fields, **common)


def key_of(fmt, acts, method, rotate) -> str:
    return f"{fmt} {acts} | {method} | rotate {rotate}"


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec = MODELS[MODEL]
    lm = load_model(MODEL)
    d = default_texts(MODEL)
    res = Results(out)
    (out / "meta.json").write_text(json.dumps({"model": MODEL, **spec, "calib": d.calib, "bos": d.bos,
                                               "torch": torch.__version__, "threads": torch.get_num_threads(),
                                               "machine": platform.machine()}, indent=2))
    if res.get("fp") is None:
        res.add({"key": "fp", "ppl": _ppl(lm.model, lm, spec, d)})
    t_start = time.time()
    for fmt, acts, method, rotations in CELLS:
        if (args.only_format and fmt != args.only_format) or (args.only_activations and acts != args.only_activations):
            continue
        for rotate in rotations:
            if args.only_rotations and rotate not in args.only_rotations:
                continue
            key = key_of(fmt, acts, method, rotate)
            if res.get(key) is not None:
                continue
            if args.max_minutes and time.time() - t_start > 60 * args.max_minutes:
                print(f"stopping: --max-minutes {args.max_minutes} reached before {key}", flush=True)
                return
            cfg = _config(fmt, acts, method, rotate, spec)
            model = copy.deepcopy(lm.model)
            t = time.time()
            report = calibrate_and_quantize(model, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
            sec = time.time() - t
            t = time.time()
            ppl = _ppl(model, lm, spec, d)
            res.add({"key": key, "format": fmt, "activations": acts, "method": method, "rotate": rotate, "ppl": ppl,
                     "ptq_seconds": round(sec, 1), "eval_seconds": round(time.time() - t, 1),
                     "rotation": report.rotation})
            del model


PIPELINE_RUN = "defaults with the lr retry (learn-scales --steps 50)"


def run_pipeline(args) -> None:
    """The recovery pipeline (lsq's defaults, 50 steps) from the NVFP4 start ``args.pipeline_from`` ("METHOD|ROTATE")."""
    from blockscale.data.text_sources import calibration_batches

    method, _, rotate = args.pipeline_from.partition("|")
    if method not in METHODS["nvfp4"] or not rotate:
        raise SystemExit(f"--pipeline-from {args.pipeline_from!r}: expected 'METHOD|ROTATE' with METHOD one of "
                         f"{', '.join(METHODS['nvfp4'])}")
    out = Path(args.out)
    spec = MODELS[MODEL]
    lm = load_model(MODEL)
    d = default_texts(MODEL)
    res = Results(out)
    label = f"{method}, rotate {rotate}"
    rr.STARTS[label] = dict(METHODS["nvfp4"][method], rotate=rotate)
    tokens = calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                 bos=d.calib_bos)
    settings = next(s for name, _, s, _, _ in rr.RUNS if name == PIPELINE_RUN)
    for acts in args.activations:
        rr.run_lsq(lm, spec, d, res, out, tokens, f"pipeline [{label}] | nvfp4 {acts}", label, settings, (50,), acts)


def _closed(ppl, rtn, fp):
    return 100.0 * (rtn - ppl) / (rtn - fp) if rtn != fp else float("nan")


def report(out: Path, generated_by: str) -> str:
    res = Results(out)
    fp = res.get("fp")["ppl"]
    lines = ["# Rotations for 4-bit PTQ: SmolLM2-135M, NVFP4 and MXFP4 (issue 33)", "",
             f"Generated by `{generated_by}` from `{out.name}/results.jsonl`.", "",
             f"Full precision: perplexity {fp:.4f} (WikiText-2 test, first 40 windows of 1024; calibration 32 x 512 "
             "tokens of C4). Gap closed: against unrotated RTN with the same format and activations. Wall time: the "
             "PTQ alone (rotation, calibration, quantization) on 2 cores.", ""]
    for fmt in ("nvfp4", "mxfp4"):
        for acts in ("w4a4", "w4a16"):
            rtn = res.get(key_of(fmt, acts, "RTN", "none"))
            rows = [r for r in res.rows if r.get("format") == fmt and r.get("activations") == acts]
            if not rows or rtn is None:
                continue
            lines += [f"## {fmt.upper()} {acts.upper()} (RTN {rtn['ppl']:.4f})", "",
                      "| method | " + " | ".join(ROTATIONS) + " |", "|---|" + "---|" * len(ROTATIONS)]
            for method in METHODS[fmt]:
                cells = []
                for rot in ROTATIONS:
                    r = res.get(key_of(fmt, acts, method, rot))
                    cells.append("not run" if r is None else
                                 f"{r['ppl']:.4f} ({_closed(r['ppl'], rtn['ppl'], fp):.0f}%, {r['ptq_seconds']:.0f} s)")
                if any(c != "not run" for c in cells):
                    lines.append(f"| {method} | " + " | ".join(cells) + " |")
            lines.append("")
    runs = [r for r in res.rows if r["key"].startswith("pipeline [")]
    if runs:
        lines += ["## The recovery pipeline from a rotated start", "",
                  "lsq's defaults (learned block scales and latent weights, held-out best step, the lr retry), as "
                  "`learn-scales --steps 50` runs them; rotations fixed. Gap: against unrotated NVFP4 RTN.", "",
                  "| start | activations | PTQ start ppl | after learning | gap closed | best step | s / step | "
                  "optimizer state |", "|---|---|---|---|---|---|---|---|"]
        for r in runs:
            acts = r["activations"]
            rtn = res.get(key_of("nvfp4", acts, "RTN", "none"))
            method, _, rot = r["start"].partition(", rotate ")
            start = res.get(key_of("nvfp4", acts, method, rot))
            start_ppl = f"{start['ppl']:.4f}" if start else "-"
            closed = f"{_closed(r['ppl'], rtn['ppl'], fp):.0f}%" if rtn else "-"
            lines.append(f"| {r['start']} | {acts.upper()} | {start_ppl} | {r['ppl']:.4f} | {closed} | {r['best_step']} | "
                         f"{r['seconds_per_step']:.1f} | {r['optimizer_state_bytes'] / 2**20:.0f} MiB |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path.home() / ".cache/blockscale/runs/rotations"))
    ap.add_argument("--only-format", choices=("nvfp4", "mxfp4"))
    ap.add_argument("--only-activations", choices=("w4a4", "w4a16"))
    ap.add_argument("--only-rotations", nargs="+", choices=ROTATIONS)
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--pipeline-from", metavar="'METHOD|ROTATE'")
    ap.add_argument("--activations", nargs="+", default=["w4a4"], choices=("w4a4", "w4a16"))
    ap.add_argument("--report-only", metavar="DIR")
    ap.add_argument("--notes", metavar="FILE", help="a markdown file appended to the report (the reading)")
    ap.add_argument("--generated-by", default="python experiments/rotation_results.py --report-only DIR")
    args = ap.parse_args(argv)
    if args.report_only:
        text = report(Path(args.report_only), args.generated_by)
        if args.notes:
            text += "\n" + Path(args.notes).read_text()
        print(text)
        return 0
    if args.pipeline_from:
        run_pipeline(args)
        return 0
    run_all(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
