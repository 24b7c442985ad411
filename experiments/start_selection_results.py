"""Does the held-out next-token loss choose each model's best PTQ start (``learn-scales --method auto``, issue 32)?

For each model of experiments/recovery_results.py and each activation mode: every start in
``lsq.START_CANDIDATES`` (and RTN-6 and plain GPTQ for reference), quantized with the recovery protocol's
calibration (``StartCandidate.config`` of the PTQConfig ``recovery_results._quantized`` builds, so each model is
the PTQ row of the same label there, bit for bit), scored as ``lsq.choose_start`` scores it: the mean next-token
cross entropy on the held-out windows of the learned runs (the last ``lsq.RECOVERY_HOLDOUT`` of the training
windows; never the evaluation text). Beside it the distillation loss (KL to the full-precision model) on the same
windows and the evaluation perplexity, so the report says whether the criterion picks the start with the best
perplexity.

    python experiments/start_selection_results.py --model stories260k --out ~/.cache/blockscale/runs/start-selection
    python experiments/start_selection_results.py --model smollm2-135m --out R/start-selection \
        --recovery ~/.cache/blockscale/runs/recovery-smollm2     # perplexities already measured there are reused
    python experiments/start_selection_results.py --report-only R/start-selection \
        --notes docs/results/start-selection-reading.md > docs/results/start-selection.md

One JSON row per (model, activations, start) in OUT/results.jsonl; a rerun skips what is there.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import recovery_results as R  # noqa: E402

from blockscale import lsq  # noqa: E402
from blockscale.data.text_sources import calibration_batches  # noqa: E402
from blockscale.lsq.distill import eval_distill_loss  # noqa: E402
from blockscale.ptq import PTQConfig  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize  # noqa: E402

# the recovery script's label of each candidate (its PTQ rows and learned runs use these names)
RECOVERY_LABEL = {"RTN hessian": "RTN hessian", "GPTQ hessian": R.GH, "GPTQ 4/6-aware": "GPTQ+4/6 (aware)",
                  "AWQ + GPTQ hessian": R.AGH}
REFERENCES = (lsq.StartCandidate("RTN-6", "rtn", "6"), lsq.StartCandidate("GPTQ", "gptq", "6"))


def base_config(spec: dict, acts: str) -> PTQConfig:
    """The PTQConfig of ``recovery_results._quantized`` without a method: the model's calibration windows."""
    return PTQConfig(activations=acts, n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"],
                     skip_indivisible=spec["skip_indivisible"])


def stored_ppl(recovery: Path, label: str, acts: str):
    if recovery is None or not (recovery / "results.jsonl").exists():
        return None
    key = "fp" if label == "fp" else f"ptq {RECOVERY_LABEL.get(label, label)} | {acts}"
    rows = [json.loads(x) for x in (recovery / "results.jsonl").read_text().splitlines() if x.strip()]
    return next((r["ppl"] for r in reversed(rows) if r["key"] == key), None)


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = R.Results(out)
    spec, lm, d = R.model_and_texts(args.model)
    lm.model.eval()
    tokens = calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                 bos=d.calib_bos)  # the learned runs' windows (recovery_results.run_all)
    held = lsq.split_holdout(tokens, lsq.RECOVERY_HOLDOUT)[1]
    dcfg = lsq.DistillConfig(batch_size=spec["batch_size"])
    fp_key = f"{args.model} | fp"
    if res.get(fp_key) is None:
        res.add({"key": fp_key, "model": args.model, "heldout_nll": lsq.eval_next_token_loss(lm.model, held),
                 "ppl": stored_ppl(args.recovery, "fp", "") or R._ppl(lm.model, lm, spec, d)})
    for acts in args.activations:
        for cand in lsq.START_CANDIDATES + REFERENCES:
            key = f"{args.model} {acts} | {cand.label}"
            if res.get(key) is not None or (args.only and cand.label not in args.only):
                continue
            student = copy.deepcopy(lm.model)
            t = time.time()
            calibrate_and_quantize(student, lm.tokenizer, cand.config(base_config(spec, acts)), d.calib,
                                   d.calib_bos, progress=False)
            sec = time.time() - t
            student.eval()
            nll = lsq.eval_next_token_loss(student, held, batch_size=spec["batch_size"])
            kl = eval_distill_loss(student, lm.model, held, dcfg)
            ppl = stored_ppl(args.recovery, cand.label, acts)
            reused = ppl is not None
            if not reused:
                ppl = R._ppl(student, lm, spec, d)
            res.add({"key": key, "model": args.model, "activations": acts, "start": cand.label,
                     "candidate": cand in lsq.START_CANDIDATES, "heldout_nll": nll, "heldout_kl": kl, "ppl": ppl,
                     "ppl_from_recovery_results": reused, "ptq_seconds": sec, "heldout_windows": list(held.shape)})
            del student


def report(dirs, notes=None) -> str:
    rows = [json.loads(x) for d in dirs for x in (Path(d) / "results.jsonl").read_text().splitlines() if x.strip()]
    fp = {r["model"]: r for r in rows if r["key"].endswith("| fp")}
    out = ["# Choosing the PTQ start by the held-out next-token loss", "",
           "Generated by `experiments/start_selection_results.py` (its docstring has the commands). Held-out: the "
           f"last {lsq.RECOVERY_HOLDOUT} training windows of the learned runs (never the evaluation text). "
           "Gap closed: (ppl RTN-6 - ppl) / (ppl RTN-6 - ppl full precision), same activations. RTN-6 and GPTQ are "
           "references, not candidates of `--method auto`.", ""]
    groups = {}
    for r in rows:
        if "activations" in r:
            groups.setdefault((r["model"], r["activations"]), []).append(r)
    for (model, acts), rs in groups.items():
        rtn = next((r["ppl"] for r in rs if r["start"] == "RTN-6"), None)
        f = fp.get(model, {})
        out += [f"## {model}, {acts}", "",
                f"Full precision: ppl {f.get('ppl', float('nan')):.4f}, held-out next-token loss "
                f"{f.get('heldout_nll', float('nan')):.6f}.", "",
                "| start | held-out next-token loss | held-out KL | ppl | gap closed | PTQ s |", "|---|---:|---:|---:|---:|---:|"]
        for r in rs:
            gap = (f"{(rtn - r['ppl']) / (rtn - f['ppl']):.0%}" if rtn is not None and "ppl" in f and rtn != f["ppl"]
                   else "")
            name = r["start"] + ("" if r["candidate"] else " (reference)")
            out.append(f"| {name} | {r['heldout_nll']:.6f} | {r['heldout_kl']:.6f} | {r['ppl']:.4f} | {gap} | "
                       f"{r['ptq_seconds']:.0f} |")
        cands = [r for r in rs if r["candidate"]]
        if len(cands) == len(lsq.START_CANDIDATES):
            pick = min(cands, key=lambda r: r["heldout_nll"])
            by_kl = min(cands, key=lambda r: r["heldout_kl"])
            best = min(cands, key=lambda r: r["ppl"])
            out += ["", f"`--method auto` picks **{pick['start']}** (ppl {pick['ppl']:.4f}); the best candidate by "
                    f"perplexity is {best['start']} ({best['ppl']:.4f}); the held-out KL would pick {by_kl['start']}."]
        else:
            out += ["", f"{len(cands)} of {len(lsq.START_CANDIDATES)} candidates measured."]
        out.append("")
    if notes:
        out.append(Path(notes).read_text().rstrip("\n"))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(R.MODELS))
    ap.add_argument("--out")
    ap.add_argument("--activations", nargs="+", default=["w4a16", "w4a4"], choices=("w4a16", "w4a4"))
    ap.add_argument("--only", nargs="*", help="these starts only (labels)")
    ap.add_argument("--recovery", type=Path, help="a recovery_results.py directory of the same model: its PTQ rows' "
                    "perplexities are reused (the same quantization) instead of evaluated again")
    ap.add_argument("--report-only", nargs="+", metavar="DIR")
    ap.add_argument("--notes", help="a markdown file appended to the report (the reading)")
    args = ap.parse_args(argv)
    if args.report_only:
        print(report(args.report_only, args.notes))
        return 0
    if not args.out:
        ap.error("--out is required (or --report-only)")
    torch.manual_seed(0)
    run(args)
    print(report([args.out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
