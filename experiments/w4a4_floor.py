"""How much of a model's NVFP4 W4A4 loss is the activations' own rounding: perplexity with full-precision weights
and NVFP4 activations (W16A4), next to W4A4 RTN and full precision, on the recovery protocol's calibration and
evaluation (``experiments/recovery_results.py``'s ``MODELS``).

Every decoder Linear's input is fake-quantized as ``NVFP4Linear`` quantizes it in W4A4: dynamic E4M3 scales per
16 values, one static outer scale per Linear from its calibration amax (``input_encode_scale``, rule 6 or 4/6),
the amax taken on the full-precision model (PTQ takes it sequentially on the partly quantized model). No
weight is quantized, so no weight-side PTQ method can get below this perplexity without changing the
activations (smoothing, rotations). ``--rotate PLAN`` (docs/ptq.md "Rotations": r4, block:16 (the NVFP4 group, the
activation half of MR-GPTQ), r1r2r4, ...) rotates the full-precision model first (fused rotations change no function;
online ones rotate each Linear's input before it is quantized), so the rows show what a rotation does to the
activations' own rounding. One JSON line per row in OUT/results.jsonl (a rerun skips what is there).

    python experiments/w4a4_floor.py --model smollm2-135m --out ~/.cache/blockscale/runs/w4a4-floor
    python experiments/w4a4_floor.py --model smollm2-135m --out ~/.cache/blockscale/runs/w4a4-floor --rules 6 \
        --rotate r4 block:16 r1r2r4
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_results import MODELS, TEXT_OVERRIDES  # noqa: E402

from blockscale.data.text_sources import calibration_batches  # noqa: E402
from blockscale.models.hf import load_model  # noqa: E402
from blockscale.quant import NVFP4, fake_quantize  # noqa: E402
from blockscale.quant.nvfp4 import input_encode_scale  # noqa: E402
from blockscale.ptq.pipeline import default_texts, evaluate_ppl  # noqa: E402
from blockscale.ptq.rotations import parse_rotate, rotate_model  # noqa: E402


def _decoder_linears(model):
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n and not n.endswith(("mlp.gate", "router"))}


@torch.no_grad()
def _amax(model, batches):
    lin = _decoder_linears(model)
    amax = {n: torch.zeros(()) for n in lin}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: amax.__setitem__(n, torch.maximum(
        amax[n], a[0].detach().abs().amax().float()))) for n, m in lin.items()]
    for b in batches:
        model(b)
    for h in hooks:
        h.remove()
    return amax


def _quantize_inputs(model, amax, rule):
    spec = NVFP4(scale_rule=rule)
    hooks = []
    for n, m in _decoder_linears(model).items():
        enc = input_encode_scale(amax[n], rule)
        hooks.append(m.register_forward_pre_hook(
            lambda mod, a, enc=enc: (fake_quantize(a[0], spec, encode_scale=enc.to(a[0].device), check_finite=False),)
            + tuple(a[1:])))
    return hooks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    p.add_argument("--out", required=True)
    p.add_argument("--rules", nargs="+", default=["6", "4over6"], choices=("6", "4over6"))
    p.add_argument("--rotate", nargs="+", default=["none"], help="rotation plans, one row each (none: unrotated)")
    args = p.parse_args(argv)
    spec = MODELS[args.model]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = {json.loads(line)["key"] for line in path.read_text().splitlines()} if path.exists() else set()
    lm = load_model(spec.get("path", args.model))
    d = default_texts(spec.get("path", args.model))
    d = dataclasses.replace(d, **{k: spec[k] for k in TEXT_OVERRIDES if k in spec})
    calib = calibration_batches(lm.tokenizer, d.calib, spec["calib_samples"], spec["calib_seq_len"], seed=0,
                                bos=d.calib_bos)
    for plan in args.rotate:
        model = lm.model
        if plan != "none":
            model = copy.deepcopy(lm.model)
            rotate_model(model, parse_rotate(plan, 0))
        amax = _amax(model, calib.split(8))
        for rule in args.rules:
            key = f"{args.model} W16A4 activations {rule}" + ("" if plan == "none" else f" rotate {plan}")
            if key in done:
                continue
            hooks = _quantize_inputs(model, amax, rule)
            t = time.time()
            ppl = evaluate_ppl(model, lm.tokenizer, spec["eval"], spec["ctx"], d.bos, spec["eval_tokens"]).ppl
            for h in hooks:
                h.remove()
            row = {"key": key, "model": args.model, "act_scale_rule": rule, "rotate": plan, "ppl": ppl,
                   "seconds": time.time() - t, "linears": len(amax)}
            print(json.dumps(row), flush=True)
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
