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
``--only-activations w4a4`` / ``--only-rotations none mr`` / ``--only-methods GPTQ`` restrict the grid; ``--max-minutes M`` stops starting new cells after M minutes. Cells
run in ``CELLS`` order (NVFP4 W4A4 first: the issue's main goal). Gap closed = (ppl_RTN - ppl) / (ppl_RTN - ppl_fp)
against unrotated RTN with the same format and activations.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_results as rr  # noqa: E402  (the shared protocol)
from recovery_results import MODELS, Results, _ppl  # noqa: E402

from blockscale.models.hf import load_model  # noqa: E402
from blockscale.ptq import GPTQOptions, PTQConfig  # noqa: E402
from blockscale.ptq.config import DEFAULT_EXCLUDE  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts  # noqa: E402
from blockscale.recipes.ptq_recipe import KVCacheScheme, PTQRecipe, Scheme  # noqa: E402

MODEL = "smollm2-135m"
ROTATIONS = ("none", "r4", "r1r2r4", "mr", "r1r2+mr")
# (format, activations, method label) -> PTQConfig fields
METHODS = {
    "nvfp4": {"RTN": dict(method="rtn"), "GPTQ": dict(method="gptq"), "RTN hessian": dict(method="rtn", scale_rule="hessian"),
              "RTN 4/6": dict(method="rtn", scale_rule="4over6"), "GPTQ 4/6": dict(method="gptq", scale_rule="4over6"),
              "GPTQ, 128 windows": dict(method="gptq", n_samples=128)},
    "mxfp4": {"RTN": dict(method="rtn"), "GPTQ": dict(method="gptq"),
              "GPTQ act-order": dict(method="gptq", options=GPTQOptions(act_order=True)),
              "GPTQ, 128 windows": dict(method="gptq", n_samples=128)},
}
# the grid in the order it runs: (format, activations, method, rotations)
CELLS = ([("nvfp4", "w4a4", m, ROTATIONS) for m in ("RTN", "GPTQ", "RTN hessian")]
         + [("mxfp4", "w4a4", m, ROTATIONS) for m in ("RTN", "GPTQ")]
         + [("nvfp4", "w4a4", m, ("none", "r1r2r4", "mr")) for m in ("RTN 4/6", "GPTQ 4/6")]
         + [("nvfp4", "w4a16", m, ROTATIONS) for m in ("RTN", "GPTQ", "RTN hessian")]
         + [("mxfp4", "w4a16", m, ROTATIONS) for m in ("RTN", "GPTQ")])
# online Hadamards larger than the quantization group on every Linear input (quip: the largest power of two that
# divides each input, 64 / 512 on SmolLM2; block:64), where block-sized ones helped most (MXFP4 W4A4 GPTQ)
EXTRA_ROTATIONS = ("quip", "block:64")
CELLS += [("mxfp4", "w4a4", "GPTQ", EXTRA_ROTATIONS), ("mxfp4", "w4a4", "GPTQ act-order", ("block:64", "mr")),
          ("nvfp4", "w4a4", "GPTQ", EXTRA_ROTATIONS)]
# GPTQ's Hessians from 128 calibration windows instead of 32: the best MXFP4 W4A4 cell and its NVFP4 reference
CELLS += [("mxfp4", "w4a4", "GPTQ, 128 windows", ("block:64",)), ("nvfp4", "w4a4", "GPTQ, 128 windows", ("none",))]
# R3 only changes a quantized KV cache: NVFP4 W4A4 with the FP8 KV cache (per layer), format label "nvfp4+kv8"
KV_ROTATIONS = ("none", "r3", "r1r2r4", "r1r2r3r4")
KV_CELLS = [("nvfp4+kv8", "w4a4", m, KV_ROTATIONS) for m in ("RTN", "GPTQ")]
# the KV cache's own cost: full-precision Linears with an FP8 / NVFP4 KV cache, then NVFP4 W4A4 with the NVFP4 one
KV_CELLS += [("bf16+kv8", "w16a16", "RTN", ("none", "r3")), ("bf16+kv4", "w16a16", "RTN", ("none", "r3")),
             ("nvfp4+kv4", "w4a4", "RTN", ("none", "r3"))]
KV_SCHEMES = {"kv8": "fp8-e4m3", "kv4": "nvfp4"}
# another model (--model moe-3m: R1 / R2 fused through the router and experts, online rotations on the dense Linears)
MOE_CELLS = [("nvfp4", a, m, ROTATIONS) for a in ("w4a4", "w4a16") for m in ("RTN", "GPTQ")]


def _config(fmt: str, acts: str, method: str, rotate: str, spec) -> PTQConfig:
    fields = dict(METHODS["nvfp4" if fmt.startswith("bf16") else fmt.split("+")[0]][method])
    common = dict(n_samples=fields.pop("n_samples", spec["calib_samples"]), seq_len=spec["calib_seq_len"],
                  skip_indivisible=spec["skip_indivisible"], rotate=rotate)
    if "+kv" in fmt:  # the grid's NVFP4 recipe (RTN / GPTQ: no scale rule to move) or bf16, plus a KV cache
        base, kv = fmt.split("+")
        recipe = PTQConfig(activations=acts).ptq_recipe if base == "nvfp4" else \
            PTQRecipe.single(Scheme("bf16"), ignore=DEFAULT_EXCLUDE)
        return PTQConfig(recipe=recipe.replace(kv_cache=KVCacheScheme(KV_SCHEMES[kv])), **fields, **common)
    if fmt == "nvfp4":
        return PTQConfig(activations=acts, **fields, **common)
    scheme = Scheme("mxfp4" if acts == "w4a4" else "mxfp4-w4a16")
    return PTQConfig(recipe=PTQRecipe.single(scheme, ignore=DEFAULT_EXCLUDE), **fields, **common)


def key_of(fmt, acts, method, rotate) -> str:
    return f"{fmt} {acts} | {method} | rotate {rotate}"


def _model(name: str):
    """(spec, loaded model, texts) of ``name`` as experiments/recovery_results.py reads it (moe-3m: its own path
    and texts)."""
    spec = MODELS[name]
    if "path" in spec and not Path(spec["path"]).exists():
        raise SystemExit(f"{name}: {spec['path']} is missing (see experiments/recovery_results.py for how to make it)")
    lm = load_model(spec.get("path", name))
    d = default_texts(spec.get("path", name))
    d = dataclasses.replace(d, **{k: spec[k] for k in rr.TEXT_OVERRIDES if k in spec})
    return spec, lm, d


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec, lm, d = _model(args.model)
    res = Results(out)
    (out / "meta.json").write_text(json.dumps({"model": args.model, **spec, "calib": d.calib, "bos": d.bos,
                                               "torch": torch.__version__, "threads": torch.get_num_threads(),
                                               "machine": platform.machine()}, indent=2))
    if res.get("fp") is None:
        res.add({"key": "fp", "ppl": _ppl(lm.model, lm, spec, d)})
    t_start = time.time()
    cells = KV_CELLS if args.kv_cache else CELLS if args.model == MODEL else MOE_CELLS
    for fmt, acts, method, rotations in cells:
        if (args.only_format and fmt != args.only_format) or (args.only_activations and acts != args.only_activations) \
                or (args.only_methods and method not in args.only_methods):
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


def _grid(res: Results, fp: float, fmts=("nvfp4", "mxfp4"), head="##") -> list[str]:
    lines = []
    for fmt in fmts:
        for acts in ("w4a4", "w4a16"):
            rtn = res.get(key_of(fmt, acts, "RTN", "none"))
            rows = [r for r in res.rows if r.get("format") == fmt and r.get("activations") == acts]
            if not rows or rtn is None:
                continue
            cols = ROTATIONS + tuple(x for x in EXTRA_ROTATIONS if any(r.get("rotate") == x for r in rows))
            lines += [f"{head} {fmt.upper()} {acts.upper()} (RTN {rtn['ppl']:.4f})", "",
                      "| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for method in METHODS[fmt]:
                cells = []
                for rot in cols:
                    r = res.get(key_of(fmt, acts, method, rot))
                    cells.append("not run" if r is None else
                                 f"{r['ppl']:.4f} ({_closed(r['ppl'], rtn['ppl'], fp):.0f}%, {r['ptq_seconds']:.0f} s)")
                if any(c != "not run" for c in cells):
                    lines.append(f"| {method} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def _other_model(out: Path) -> list[str]:
    """A section for another model's directory (--model moe-3m)."""
    meta = json.loads((out / "meta.json").read_text())
    res = Results(out)
    fp = res.get("fp")["ppl"]
    rotated = next((r["rotation"] for r in res.rows if r.get("rotate") == "r1r2+mr" and r.get("rotation")), [])
    lines = [f"## {meta['model']}: rotations through the router and experts", "",
             f"Full precision: perplexity {fp:.4f} ({meta['eval']}, {meta['eval_tokens']} tokens in windows of "
             f"{meta['ctx']}; calibration {meta['calib_samples']} x {meta['calib_seq_len']} tokens of {meta['calib']}). "
             "R1 folds the post-attention norm into the router and every expert's gate_up and rotates every expert's "
             "down rows: the router's logits are unchanged, so R1 commutes with routing. Online rotations (R4, mr) act "
             "on the dense Linears only (this Mixtral has no shared expert: R4 rotates nothing, and mr only the "
             "attention); the routed experts stay unrotated. What `--rotate r1r2+mr` reported:", "", "```"]
    lines += rotated[:8] + (["..."] if len(rotated) > 8 else []) + ["```", ""]
    return lines + _grid(res, fp, ("nvfp4",), "###")


def report(out: Path, generated_by: str, others=()) -> str:
    res = Results(out)
    fp = res.get("fp")["ppl"]
    lines = ["# Rotations for 4-bit PTQ: SmolLM2-135M, NVFP4 and MXFP4 (issue 33)", "",
             f"Generated by `{generated_by}` from `{out.name}/results.jsonl`.", "",
             f"Full precision: perplexity {fp:.4f} (WikiText-2 test, first 40 windows of 1024; calibration 32 x 512 "
             "tokens of C4). Gap closed: against unrotated RTN with the same format and activations. Wall time: the "
             "PTQ alone (rotation, calibration, quantization) on 2 cores.", ""]
    lines += _grid(res, fp)
    kv_rows = [r for r in res.rows if r.get("format") == "nvfp4+kv8"]
    if kv_rows:
        lines += ["## R3 with the FP8 KV cache (NVFP4 W4A4 + FP8 E4M3 K / V, one scale per layer)", "",
                  "R3 rotates queries and keys after RoPE by a Hadamard of head_dim; it cancels in q k^T, so only the "
                  "KV cache's key quantization sees it. Gap closed: against unrotated NVFP4 W4A4 RTN without KV "
                  "quantization (the column 'none' shows what the FP8 KV cache costs).", "",
                  "| method | " + " | ".join(KV_ROTATIONS) + " |", "|---|" + "---|" * len(KV_ROTATIONS)]
        rtn = res.get(key_of("nvfp4", "w4a4", "RTN", "none"))
        for method in METHODS["nvfp4"]:
            cells = []
            for rot in KV_ROTATIONS:
                r = res.get(key_of("nvfp4+kv8", "w4a4", method, rot))
                cells.append("not run" if r is None or rtn is None else
                             f"{r['ppl']:.4f} ({_closed(r['ppl'], rtn['ppl'], fp):.0f}%, {r['ptq_seconds']:.0f} s)")
            if any(c != "not run" for c in cells):
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    cost = [(f, a, label) for f, a, label in (("bf16+kv8", "w16a16", "full-precision Linears, FP8 KV"),
                                               ("bf16+kv4", "w16a16", "full-precision Linears, NVFP4 KV"),
                                               ("nvfp4+kv8", "w4a4", "NVFP4 W4A4 RTN, FP8 KV"),
                                               ("nvfp4+kv4", "w4a4", "NVFP4 W4A4 RTN, NVFP4 KV"))
            if res.get(key_of(f, a, "RTN", "none")) is not None]
    if cost:
        w4a4 = res.get(key_of("nvfp4", "w4a4", "RTN", "none"))
        lines += ["## What the KV cache costs, and R3 (RTN, one KV scale per layer)", "",
                  f"Perplexity (and the change against the same Linears without KV quantization: full precision "
                  f"{fp:.4f}, NVFP4 W4A4 RTN {w4a4['ppl']:.4f}).", "",
                  "| Linears, KV cache | no rotation | R3 |", "|---|---|---|"]
        for f, a, label in cost:
            base = fp if f.startswith("bf16") else w4a4["ppl"]
            cells = []
            for rot in ("none", "r3"):
                r = res.get(key_of(f, a, "RTN", rot))
                cells.append("not run" if r is None else f"{r['ppl']:.4f} ({r['ppl'] - base:+.4f})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
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
    ap.add_argument("--model", default=MODEL, choices=(MODEL, "moe-3m"),
                    help=f"the grid runs on {MODEL}; moe-3m runs NVFP4 RTN / GPTQ with every rotation")
    ap.add_argument("--only-format", choices=("nvfp4", "mxfp4"))
    ap.add_argument("--only-activations", choices=("w4a4", "w4a16"))
    ap.add_argument("--only-rotations", nargs="+", choices=sorted(set(ROTATIONS) | set(KV_ROTATIONS) | set(EXTRA_ROTATIONS)))
    ap.add_argument("--only-methods", nargs="+", metavar="METHOD", help="these method rows only (e.g. 'GPTQ, 128 windows')")
    ap.add_argument("--kv-cache", action="store_true", help="run the FP8-KV-cache cells (R3) instead of the grid")
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--pipeline-from", metavar="'METHOD|ROTATE'")
    ap.add_argument("--activations", nargs="+", default=["w4a4"], choices=("w4a4", "w4a16"))
    ap.add_argument("--report-only", metavar="DIR")
    ap.add_argument("--also", nargs="+", metavar="DIR", help="with --report-only: other models' directories (moe-3m)")
    ap.add_argument("--notes", metavar="FILE", help="a markdown file appended to the report (the reading)")
    ap.add_argument("--generated-by", default="python experiments/rotation_results.py --report-only DIR")
    args = ap.parse_args(argv)
    if args.report_only:
        text = report(Path(args.report_only), args.generated_by)
        for other in args.also or ():
            text += "\n" + "\n".join(_other_model(Path(other)))
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
