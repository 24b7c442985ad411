"""Does GPTQ that sees the quantized activations lift W4A4? (issues 32 / 33's W4A4 goals; a probe, not a feature.)

GPTQ minimises ||(W - Q) X||^2 over the layer's full-precision inputs X, but in W4A4 the Linear multiplies its weights
with the NVFP4-rounded inputs Xq. The W4A4 objective ||W X - Q Xq||^2 (GPTAQ's "asymmetric calibration", Li et al.
2025) splits, for any Q, into a constant plus ||(W' - Q) Xq||^2 with W' = W (X Xq^T) (Xq Xq^T)^-1, the least-squares
weights for the rounded inputs (the residual W X - W' Xq is orthogonal to every Q Xq). So GPTQ on the target W' with
the Hessian of the rounded inputs Hq = Xq Xq^T minimises the W4A4 objective: the weights also absorb the part of the
activations' rounding error that is linear in the rounded inputs. Here, per Linear:

- a second pass over the layer's calibration inputs (after the usual one) rounds each Linear's inputs as its W4A4
  NVFP4Linear will (the calibrated amax of those inputs, the start's activation scale rule and error) and accumulates
  Hq = (2/n) Xq^T Xq and C = (2/n) X^T Xq;
- GPTQ (plain or with Hessian-aware scales) runs on W' = W + W (C - Hq) (Hq + d I)^-1 with the Hessian Hq (d: GPTQ's
  dampening, ``--damp`` x the mean of diag Hq), with the weight's outer scale as calibrated on W;
  ``--hessian-only``: on W itself with the Hessian Hq (which of the two changes matters).

Only GPTQ's Linears change (RTN / AWQ's own choices do not); AWQ + GPTQ runs AWQ's search first, then this GPTQ.
``--off`` runs the same start without the change (the control). ``--learn`` runs lsq's defaults with the lr retry
(50 steps) from the start as well. Rows go to ``--out``/results.jsonl (resumable), never to the committed results.

    python experiments/asymmetric_gptq_probe.py --model smollm2-135m --start "GPTQ hessian" --out DIR
"""
from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_results as rr  # noqa: E402
from blockscale.ptq.capture import run_layer  # noqa: E402
from blockscale.ptq.methods.gptq import GPTQ  # noqa: E402
from blockscale.quant import NVFP4  # noqa: E402
from blockscale.quant.nvfp4.input_scale import input_encode_scale  # noqa: E402
from blockscale.quant.dispatch import fake_quantize  # noqa: E402

quantize_model_module = importlib.import_module("blockscale.ptq.quantize_model")
ACT = {"rule": None, "error": "mse", "damp": 0.01, "target": True, "linears": 0}


def with_rounded_inputs(original):
    """collect_statistics, plus each Linear's (Hq, C) of its NVFP4-rounded inputs (``stats[name].asym``)."""

    def collect(layer, index, inputs, linears, request, device, total_tokens, calibrate_all_experts=False):
        stats = original(layer, index, inputs, linears, request, device, total_tokens, calibrate_all_experts)
        if not request.hessian or ACT["rule"] is None:
            return stats
        spec = NVFP4(scale_rule=ACT["rule"], error=ACT["error"])
        acc = {n: [torch.zeros(m.in_features, m.in_features, device=device),
                   torch.zeros(m.in_features, m.in_features, device=device), 0,
                   input_encode_scale(stats[n].amax, ACT["rule"]).to(device)]
               for n, m in linears.items() if stats[n].tokens}

        def hook(mod, args, out, n):
            if n not in acc:
                return
            a = acc[n]
            x = args[0].detach().reshape(-1, mod.in_features).float()
            xq = fake_quantize(x, spec, encode_scale=a[3], check_finite=False).float()
            a[0].addmm_(xq.T, xq)
            a[1].addmm_(x.T, xq)
            a[2] += x.shape[0]

        handles = [m.register_forward_hook(lambda mod, args, out, n=n: hook(mod, args, out, n))
                   for n, m in linears.items()]
        try:
            with torch.no_grad():
                run_layer(layer, inputs, device, keep_outputs=False)
        finally:
            for h in handles:
                h.remove()
        for n, (Hq, C, cnt, _) in acc.items():
            stats[n].asym = (Hq * (2.0 / cnt), C * (2.0 / cnt))
        return stats

    return collect


class _RoundedStats:
    """The statistics of one Linear with ``H`` the Hessian of its rounded inputs."""

    def __init__(self, base, H):
        self._base, self.H = base, H

    def __getattr__(self, name):
        return getattr(self._base, name)


def _target(weight, stats):
    """(W', statistics with H = Hq), or the inputs unchanged when there is no second pass."""
    asym = getattr(stats, "asym", None)
    if asym is None:
        return weight, stats
    Hq, C = asym
    W = weight.detach().float()
    d = ACT["damp"] * float(torch.diagonal(Hq).mean())
    Hd = Hq + d * torch.eye(Hq.shape[0], dtype=Hq.dtype, device=Hq.device)
    Wp = W + torch.linalg.solve(Hd, (W @ (C - Hq)).T).T if ACT["target"] else W  # Hd is symmetric
    ACT["linears"] += 1
    return Wp.to(weight.dtype), _RoundedStats(stats, Hq)


def patch_gptq():
    plain, weighted = GPTQ.quantize_weight, GPTQ.quantize_weight_weighted

    def quantize_weight(self, weight, stats, spec, encode_scale):
        w, st = _target(weight, stats)
        return plain(self, w, st, spec, encode_scale)

    def quantize_weight_weighted(self, weight, stats, spec, encode_scale, rule):
        w, st = _target(weight, stats)
        return weighted(self, w, st, spec, encode_scale, rule)

    GPTQ.quantize_weight, GPTQ.quantize_weight_weighted = quantize_weight, quantize_weight_weighted


def main(argv=None) -> int:
    ap = rr.probe_parser(__doc__)  # (--activations: W4A4 only here)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--off", action="store_true", help="the control: the start without the change")
    ap.add_argument("--hessian-only", action="store_true", help="GPTQ on W itself with the Hessian Hq (no W')")
    ap.add_argument("--learn", action="store_true", help="also lsq's defaults with the lr retry, 50 steps")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.activations != "w4a4":
        raise SystemExit(f"--activations {args.activations}: this probe is about W4A4 (allowed: w4a4)")
    if not args.damp > 0:
        raise SystemExit(f"--damp {args.damp}: need > 0")
    fields = rr.STARTS[args.start]
    if not args.off:
        ACT.update(rule=fields.get("act_scale_rule", "6"), error=fields.get("error", "mse"), damp=args.damp, target=not args.hessian_only)
        quantize_model_module.collect_statistics = with_rounded_inputs(quantize_model_module.collect_statistics)
        patch_gptq()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = rr.Results(out)
    spec, lm, d = rr.model_and_texts(args.model)
    how = "control" if args.off else f"rounded inputs{' (Hq only)' if args.hessian_only else ''} (damp {args.damp:g})"
    name = f"{args.start}, {how}"
    if res.get(f"ptq {name} | w4a4") is None:
        student, sec, _ = rr._quantized(lm, args.start, "w4a4", spec, d, keep=args.learn)
        t = time.time()
        ppl = rr._ppl(student, lm, spec, d)
        res.add({"key": f"ptq {name} | w4a4", "ptq": name, "activations": "w4a4", "ppl": ppl, "ptq_seconds": sec,
                 "eval_seconds": time.time() - t, "linears_changed": ACT["linears"]})
        print(f"{name}: ppl {ppl:.4f}, PTQ {sec:.0f} s, {ACT['linears']} Linears on W'", flush=True)
    if args.learn:
        tokens = rr.calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                        bos=d.calib_bos)
        rr.run_lsq(lm, spec, d, res, out, tokens, f"defaults [{name}] | w4a4", args.start,
                   rr.cli_defaults(50, retry=True), (50,), "w4a4", keep=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
