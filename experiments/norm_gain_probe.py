"""Does training the RMSNorm weights too help W4A4 learning? (issue 32's 75% W4A4 goal; a probe, not a feature.)

The activations' own NVFP4 rounding is a third of SmolLM2's W4A4 gap (experiments/w4a4_floor.py), and the norm
weights set the per-channel scale of the inputs of q/k/v and gate/up, so learning them with the scales and latent
weights is the cheapest form of learned smoothing (what OmniQuant's LET learns explicitly). This runs one of
experiments/recovery_results.py's learned runs (lsq's defaults with the lr retry, ``--steps N``) with every module
whose class name contains "Norm" trained as well, in its own optimizer group:

- ``--units raw``: the norm weights themselves at ``--lr`` (Adam's step is about ``lr`` in absolute units);
- ``--units relative``: weight = w0 * exp(u), u trained from 0 at ``--lr`` (a relative step of about ``lr`` whatever
  the weights' size; step 0 is the PTQ model bit for bit, exp(0) = 1).

``--lr 0`` is the run without norms (it reproduces recovery_results.py's row of the same start). Rows go to
``--out``/results.jsonl (resumable), never to the committed results.

    python experiments/norm_gain_probe.py --model stories260k --start "GPTQ hessian" --units raw --lr 1e-2 --out DIR
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_results as rr  # noqa: E402

distill_module = importlib.import_module("blockscale.lsq.distill")  # (the package exports a function of that name)


class LogGain(nn.Module):
    """weight = w0 * exp(log_gain): the norm weight's relative change, trained from 0."""

    def __init__(self, n: int):
        super().__init__()
        self.log_gain = nn.Parameter(torch.zeros(n))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * torch.exp(self.log_gain)


def norm_parameters(student: nn.Module, units: str) -> list[nn.Parameter]:
    """The trainable norm tensors of ``student``: the weights (raw) or their log gains (relative, registered once)."""
    out = []
    for _, m in student.named_modules():
        if "Norm" not in type(m).__name__ or not isinstance(getattr(m, "weight", None), torch.Tensor):
            continue
        if units == "raw":
            out.append(m.weight)
            continue
        if not parametrize.is_parametrized(m, "weight"):
            parametrize.register_parametrization(m, "weight", LogGain(m.weight.shape[0]))
        out.append(m.parametrizations.weight[0].log_gain)
    return out


def with_norms(lr: float, units: str):
    """DistillTask.trainable, plus the norm tensors in a group "norms" at ``lr``."""
    base = distill_module.DistillTask.trainable

    def trainable(self, student):
        base(self, student)
        norms = norm_parameters(student, units)
        for p in norms:
            p.requires_grad_(True)
        self.groups.append({"params": norms, "lr": lr, "name": "norms", "base_lr": lr})
        print(f"norms: {len(norms)} tensors, {sum(p.numel() for p in norms):,} values, {units} units, lr {lr:g}",
              flush=True)
        return [p for p in student.parameters() if p.requires_grad]

    return trainable


def main(argv=None) -> int:
    ap = rr.probe_parser(__doc__)
    ap.add_argument("--units", default="relative", choices=("raw", "relative"))
    ap.add_argument("--lr", type=float, default=1e-2, help="the norms' lr (0: no norms, the control)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not (args.lr >= 0) or args.steps < 1:
        raise SystemExit(f"--lr {args.lr} / --steps {args.steps}: need lr >= 0 and steps >= 1")
    if args.lr > 0:
        distill_module.DistillTask.trainable = with_norms(args.lr, args.units)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec, lm, d = rr.model_and_texts(args.model)
    tokens = rr.calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                    bos=d.calib_bos)
    name = f"norms {args.units} {args.lr:g}" if args.lr > 0 else "no norms"
    rr.run_lsq(lm, spec, d, rr.Results(out), out, tokens, f"{name} [{args.start}] | {args.activations}", args.start,
               rr.cli_defaults(args.steps, retry=True), (args.steps,), args.activations)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
