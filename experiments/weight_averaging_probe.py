"""Does averaging the trained tensors over the end of a learning run beat the run's last step? Replays one run of
the recovery protocol (``experiments/recovery_protocol.py``'s ``RUNS``: the same PTQ start, settings, windows and
schedule; no best-step selection, no lr retry) and keeps, beside the student, running averages of every trained
tensor (block amaxes and, with ``train="all"``, the latent weights), updated after each optimizer step by a
``torch.optim`` step post-hook:

- ``ema:D``: the exponential moving average with decay D, started at the first step's iterate;
- ``tail:F``: the plain mean of the iterates of the last fraction F of the schedule (stochastic weight averaging
  over the run's end).

At the end the student (the run's last step) and each average are measured on the run's held-out windows (the
distillation loss ``learn-scales`` selects by) and on the evaluation text (perplexity, only to judge). The
twenty-second stop found the small models gain their last 5-9 points in the final tenth of the cosine while the
perplexity wanders 20 points at the peak lr: optimizer noise, which averaging addresses. One JSON line per variant
in OUT/results.jsonl, then a Markdown table.

    python experiments/weight_averaging_probe.py --model stories260k --activations w4a16 --out R/avg-stories \
        --run "defaults with the lr retry, 2048 windows (learn-scales --steps 1000 --n-samples 2048)"
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_results import (_ppl, _quantized, distill_config, lsq_student, model_and_texts,  # noqa: E402
                              probe_parser, protocol_run, training_windows)

from blockscale import lsq  # noqa: E402
from blockscale.lsq.distill import eval_distill_loss  # noqa: E402

EMA_DECAYS = (0.9, 0.98, 0.995)
TAILS = (0.1, 0.25, 0.5)


class Averages:
    """Running averages of the tensors an optimizer steps: ``ema:D`` and ``tail:F`` (see the module doc); ``update``
    after each of the run's ``steps`` optimizer steps (built after the first: the EMAs start at that iterate)."""

    def __init__(self, params: list[torch.Tensor], steps: int):
        self.params, self.steps, self.step = params, steps, 0
        self.avg = {f"ema:{d:g}": [p.detach().clone() for p in params] for d in EMA_DECAYS}
        self.avg.update({f"tail:{f:g}": [torch.zeros_like(p) for p in params] for f in TAILS})
        self.count = {f"tail:{f:g}": 0 for f in TAILS}

    @torch.no_grad()
    def update(self) -> None:
        self.step += 1  # iterates 1..steps
        for d in EMA_DECAYS:
            for a, p in zip(self.avg[f"ema:{d:g}"], self.params):
                a.mul_(d).add_(p.detach(), alpha=1 - d)
        for f in TAILS:
            key = f"tail:{f:g}"
            if self.step > self.steps - round(f * self.steps):
                self.count[key] += 1
                for a, p in zip(self.avg[key], self.params):
                    a.add_(p.detach() - a, alpha=1.0 / self.count[key])

    @torch.no_grad()
    def swap(self, key: str) -> None:
        """Exchange the student's tensors with average ``key`` (twice puts them back)."""
        for a, p in zip(self.avg[key], self.params):
            tmp = p.detach().clone()
            p.copy_(a)
            a.copy_(tmp)


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.set_defaults(start="RTN hessian", activations="w4a16")
    ap.add_argument("--run", required=True, help="a run name of recovery_protocol.RUNS (its settings and length)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    s, milestones = protocol_run(ap, args)
    steps = milestones[-1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec, lm, d = model_and_texts(args.model)
    torch.manual_seed(0)
    tokens = training_windows(lm, spec, d, s)
    student, _, _, _ = lsq_student(lm, args.start, args.activations, s, spec, d, keep=False)
    tokens, held = lsq.split_holdout(tokens, s["holdout"])
    cfg = distill_config(s, spec, steps, steps, out / "train", selecting=False)
    t = time.time()
    state: dict = {}

    def hook(opt, *_):  # built on the optimizer's first step: its parameters are the trained tensors
        if "avg" not in state:
            state["avg"] = Averages([p for g in opt.param_groups for p in g["params"]], steps)
        state["avg"].update()

    handle = register_optimizer_step_post_hook(hook)
    try:
        lsq.distill(student, lm.model, tokens, cfg, progress=False)
    finally:
        handle.remove()
    train_s = time.time() - t
    avg = state["avg"]
    if avg.step != steps:
        raise SystemExit(f"the hook saw {avg.step} optimizer steps, the run has {steps}")
    fp_ppl = _ppl(lm.model, lm, spec, d)
    rtn, _, _ = _quantized(lm, "RTN-6", args.activations, spec, d, keep=False)
    rtn_ppl = _ppl(rtn, lm, spec, d)
    del rtn
    rows = []
    for key in ["last"] + list(avg.avg):
        if key != "last":
            avg.swap(key)
        with torch.no_grad():
            ppl = _ppl(student, lm, spec, d)
            row = {"variant": key, "heldout_distill": eval_distill_loss(student, lm.model, held, cfg), "ppl": ppl,
                   "gap_closed": 100 * (rtn_ppl - ppl) / (rtn_ppl - fp_ppl), "model": args.model, "start": args.start,
                   "activations": args.activations, "run": args.run, "steps": steps, "train_seconds": train_s}
        if key != "last":
            avg.swap(key)
        rows.append(row)
        with (out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    kept = min(rows, key=lambda r: r["heldout_distill"])
    print("| variant | held-out distillation loss | perplexity | gap closed |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['heldout_distill']:.4f} | {r['ppl']:.4f} | {r['gap_closed']:.1f}% |")
    print(f"\nthe held-out loss keeps {kept['variant']} ({kept['ppl']:.4f}, {kept['gap_closed']:.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
