"""Which held-out signal follows the evaluation perplexity along one learning run? Replays one run of the recovery
protocol (``experiments/recovery_protocol.py``'s ``RUNS``: the same PTQ start, settings, training and held-out
windows and schedule) without best-step selection, stopping at ``--points`` evenly spaced steps of its schedule
(the start, step 0, included) and measuring at each, on the same student:

- the held-out distillation loss (what ``learn-scales`` selects the step by today: ``lsq.distill``'s
  ``eval_loss="distill"`` on the run's held-out windows of the training text);
- the held-out next-token loss (``eval_loss="next_token"``: the student's cross entropy on the same windows);
- the evaluation perplexity (the protocol's evaluation text; measured here only to judge the two signals, never
  to choose anything).

Issue 32 asks for best-step selection on a held-out split of the training text; near each model's W4A16 ceiling
the held-out distillation loss stopped ranking models as the perplexity does (docs/results/recovery-models.md,
twentieth stop). The question here is whether the held-out next-token loss (which ranks PTQ starts in perplexity
order: ``--method auto``) does better within a run. One JSON line per point in OUT/results.jsonl (a rerun resumes:
the schedule continues from the last point's checkpoint, exactly), then a Markdown summary: each signal's Spearman
rank correlation with the perplexity and the step each would keep.

    python experiments/selection_signal_probe.py --model stories260k --activations w4a16 --out R/signal-stories \
        --run "defaults with the lr retry, 2048 windows (learn-scales --steps 1000 --n-samples 2048)"
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_results import (_ppl, _quantized, distill_config, lsq_student, model_and_texts,  # noqa: E402
                              probe_parser, protocol_run, training_windows)
from scipy.stats import spearmanr  # noqa: E402

from blockscale import lsq  # noqa: E402
from blockscale.lsq.distill import eval_distill_loss  # noqa: E402

SIGNALS = ("heldout_distill", "heldout_next_token")


def summary(rows: list[dict], gap: tuple[float, float]) -> str:
    """The Markdown table of ``rows`` (one per point) and each signal's correlation and kept step; ``gap``:
    (full-precision ppl, RTN-6 ppl) for the gap-closed column."""
    fp, rtn = gap
    share = (lambda p: 100 * (rtn - p) / (rtn - fp))
    out = ["| step | held-out distillation loss | held-out next-token loss | perplexity | gap closed |",
           "|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['step']} | {r['heldout_distill']:.4f} | {r['heldout_next_token']:.4f} | {r['ppl']:.4f} | "
                   f"{share(r['ppl']):.1f}% |")
    ppl = [r["ppl"] for r in rows]
    best = min(rows, key=lambda r: (r["ppl"], r["step"]))
    out.append("")
    for s in SIGNALS:
        kept = min(rows, key=lambda r: (r[s], r["step"]))
        out.append(f"- {s}: Spearman {spearmanr([r[s] for r in rows], ppl)[0]:+.2f} with the perplexity; keeps step "
                   f"{kept['step']} ({kept['ppl']:.4f}, {share(kept['ppl']):.1f}%)")
    out.append(f"- the lowest perplexity of the run: step {best['step']} ({best['ppl']:.4f}, {share(best['ppl']):.1f}%)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.set_defaults(start="RTN hessian", activations="w4a16")
    ap.add_argument("--run", required=True, help="a run name of recovery_protocol.RUNS (its settings and length)")
    ap.add_argument("--points", type=int, default=10, help="evaluations after the start, evenly spaced (default 10)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    s, milestones = protocol_run(ap, args)
    steps = milestones[-1]
    if args.points < 1 or steps % args.points:
        ap.error(f"--points {args.points}: must divide the run's {steps} steps")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    spec, lm, d = model_and_texts(args.model)
    torch.manual_seed(0)
    tokens = training_windows(lm, spec, d, s)
    student, _, _, _ = lsq_student(lm, args.start, args.activations, s, spec, d, keep=False)
    tokens, held = lsq.split_holdout(tokens, s["holdout"])
    done = {r["step"] for r in rows}
    for m in [0] + [steps * (i + 1) // args.points for i in range(args.points)]:
        if m in done:  # (the next point's run resumes from the last done point's checkpoint)
            continue
        t = time.time()
        cfg = distill_config(s, spec, max(m, 1), steps, out / "train", selecting=False)  # no selection: every point
        if m:
            lsq.distill(student, lm.model, tokens, cfg, resume=True, progress=False)
        with torch.no_grad():
            row = {"step": m, "heldout_distill": eval_distill_loss(student, lm.model, held, cfg),
                   "heldout_next_token": lsq.eval_next_token_loss(student, held, cfg.batch_size),
                   "ppl": _ppl(student, lm, spec, d), "seconds": time.time() - t,
                   "model": args.model, "start": args.start, "activations": args.activations, "run": args.run,
                   "heldout_windows": int(held.shape[0]), "train_windows": int(tokens.shape[0])}
        rows.append(row)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    fp_ppl = _ppl(lm.model, lm, spec, d)
    rtn, _, _ = _quantized(lm, "RTN-6", args.activations, spec, d, keep=False)
    print(summary(sorted(rows, key=lambda r: r["step"]), (fp_ppl, _ppl(rtn, lm, spec, d))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
