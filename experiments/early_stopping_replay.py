"""Would early stopping have been safe on the learning runs measured so far? Replays the held-out evaluation
losses that best-step selection recorded (``eval_losses`` of every attempt in the committed result rows,
docs/results/*.jsonl) under two stopping rules and counts the attempts each would have cut before their best
step (issue 32 asks for "early stopping / best-step selection"; only selection is built):

- patience P: stop after P evaluations in a row that do not beat the best so far (the start included);
- ratio R: stop once an evaluation is at least R times the start's loss (a diverging attempt).

No model runs: the losses are the ones the runs logged. Prints a Markdown table.

    python experiments/early_stopping_replay.py                       # docs/results/*.jsonl
    python experiments/early_stopping_replay.py --patience 2 3 --ratio 1.25 1.5
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def attempts(paths) -> list[tuple[str, list]]:
    """(label, [(step, loss), ...]) of every attempt with at least two evaluations in the rows of ``paths``."""
    out, seen = [], set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            runs = row.get("attempts") or [row]
            name = row.get("key") or " ".join(f"{k} {row[k]}" for k in ("model", "student", "ce_weight") if k in row)
            for i, a in enumerate(runs):
                ev = a.get("eval_losses")
                if not (isinstance(ev, list) and len(ev) >= 2):
                    continue
                ev = [(int(s), float(v)) for s, v in ev]
                if tuple(ev) in seen:  # a row copied into a second results file (recovery_defaults -> recovery_models)
                    continue
                seen.add(tuple(ev))
                tag = f" (attempt {i + 1})" if len(runs) > 1 else ""
                out.append((f"{Path(path).stem}: {name}{tag}", ev))
    return out


def patience_stop(ev, patience: int) -> Optional[int]:
    """The step after which ``patience`` evaluations in a row did not beat the best so far; None if never."""
    best, bad = ev[0][1], 0
    for step, loss in ev[1:]:
        best, bad = (loss, 0) if loss < best else (best, bad + 1)
        if bad >= patience:
            return step
    return None


def ratio_stop(ev, ratio: float) -> Optional[int]:
    """The first step whose loss is at least ``ratio`` times the start's; None if never."""
    return next((step for step, loss in ev[1:] if loss >= ratio * ev[0][1]), None)


def best_step(ev) -> int:
    """The step selection keeps (the lowest loss; a tie keeps the earlier step)."""
    return min(ev, key=lambda sv: (sv[1], sv[0]))[0]


def replay(runs, rule, value) -> dict:
    """How a rule acts on ``runs``: attempts stopped, stopped before their best step (a worse model: the held-out
    loss of the step it would keep, above the best's), steps saved."""
    stop = patience_stop if rule == "patience" else ratio_stop
    hit, lost, saved, examples, worst = 0, 0, 0, [], 0.0
    for label, ev in runs:
        at = stop(ev, value)
        if at is None or at == ev[-1][0]:
            continue
        hit += 1
        saved += ev[-1][0] - at
        if best_step(ev) > at:
            lost += 1
            kept = min(loss for step, loss in ev if step <= at)
            excess = kept / min(loss for _, loss in ev) - 1
            worst = max(worst, excess)
            examples.append(f"{label} (stopped at {at}, best {best_step(ev)}; held-out loss kept {100 * excess:+.1f}%)")
    return {"stopped": hit, "lost": lost, "steps_saved": saved, "examples": examples, "worst": worst}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=None, help="result files (default: docs/results/*.jsonl)")
    ap.add_argument("--patience", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--ratio", nargs="+", type=float, default=[1.25, 1.5])
    args = ap.parse_args(argv)
    paths = args.rows or sorted(RESULTS.glob("*.jsonl"))
    runs = attempts(paths)
    print(f"{len(runs)} attempts with held-out evaluations in {len(paths)} files\n")
    print("| rule | attempts stopped early | stopped before their best step | worst held-out loss kept, above the "
          "best | steps saved |")
    print("|---|---:|---:|---:|---:|")
    found = [(rule, v, replay(runs, rule, v)) for rule, values in (("patience", args.patience), ("ratio", args.ratio))
             for v in values]
    for rule, v, r in found:
        print(f"| {rule} {v:g} | {r['stopped']} | {r['lost']} | {100 * r['worst']:+.1f}% | {r['steps_saved']} |")
    for rule, v, r in found:
        if r["examples"]:
            print(f"\n{rule} {v:g}, stopped before the best step:")
            print("\n".join(f"- {e}" for e in r["examples"]))


if __name__ == "__main__":
    main()
