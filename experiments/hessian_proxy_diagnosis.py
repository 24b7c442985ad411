"""Why do the Hessian-aware block scales (rule "hessian") lose to RTN-6 on Qwen2.5-Coder-0.5B but win on SmolLM2
(issue 32)? Per Linear, the output error of each weight quantization on the calibration inputs X, split as

    full  = tr(E X^T X E^T) / n         (E = W~ - W: what the layer's output error on X really is)
    diag  = sum_j d_j |E[:, j]|^2       (d = diag(X^T X) / n: what rule "hessian" minimises, block by block)
    mean  = |E mu|^2                    (mu = mean of x: the part every token shares, a bias on the output)

for RTN-6, the unweighted sweep and rule "hessian" (the same outer scale), on the full-precision model's inputs.

    python experiments/hessian_proxy_diagnosis.py --model qwen2.5-coder-0.5b [--layers 0 3 12 23]

MODEL is one of experiments/recovery_results.py's (its calibration text, 8 windows of its calibration length).

    python experiments/hessian_proxy_diagnosis.py --model qwen2.5-coder-0.5b --eval

instead quantizes the whole model with RTN-6 and with RTN hessian (W4A16, calibrated on the first half of the
calibration text) and evaluates each on the model's evaluation text and on the second half of the calibration
text (as many tokens): does the layer error that rule "hessian" removes show up on the calibration corpus?
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import recovery_results as R  # noqa: E402

from blockscale.data.text_sources import calibration_batches  # noqa: E402
from blockscale.ptq import PTQConfig  # noqa: E402
from blockscale.ptq.pipeline import calibrate_and_quantize, evaluate_ppl  # noqa: E402
from blockscale.quant.nvfp4 import NVFP4, dequantize_nvfp4, quantize_nvfp4, quantize_weighted  # noqa: E402

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


EVAL_ROWS = (("fp", None), ("RTN-6", "6"), ("RTN hessian", "hessian"))


def evaluate_both(lm, spec, d, model: str, only=None) -> int:
    base = d.calib.split("#")[0]
    calib, held = f"{base}#0:0.5", f"{base}#0.5:1"
    texts = {"eval": spec["eval"], "calib_heldout": held}
    for name, rule in EVAL_ROWS:
        if only and name not in only:
            continue
        student = lm.model
        if rule is not None:
            student = copy.deepcopy(lm.model)
            cfg = PTQConfig(activations="w4a16", n_samples=spec["calib_samples"], seq_len=spec["calib_seq_len"],
                            skip_indivisible=spec["skip_indivisible"], method="rtn", scale_rule=rule)
            calibrate_and_quantize(student, lm.tokenizer, cfg, calib, d.calib_bos, progress=False)
        row = {"model": model, "quantization": name, "calib": calib}
        for k, text in texts.items():
            row[k] = evaluate_ppl(student, lm.tokenizer, text, spec["ctx"], d.bos, spec["eval_tokens"]).ppl
        print(json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(R.MODELS))
    ap.add_argument("--layers", nargs="+", type=int, default=[0, 3, 12])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--eval", action="store_true")
    ap.add_argument("--only", nargs="+", choices=[n for n, _ in EVAL_ROWS], help="with --eval: these rows only")
    args = ap.parse_args(argv)
    spec, lm, d = R.model_and_texts(args.model)
    torch.manual_seed(0)
    if args.eval:
        return evaluate_both(lm, spec, d, args.model, args.only)
    x = calibration_batches(lm.tokenizer, d.calib, args.windows, spec["calib_seq_len"], seed=0, bos=d.calib_bos)
    wanted = {f".layers.{i}." for i in args.layers}
    acc = {}

    def hook(mod, inp, out, n):
        a = inp[0].detach().double().reshape(-1, inp[0].shape[-1])
        h, s, c = acc.get(n, (0, 0, 0))
        acc[n] = (h + a.T @ a, s + a.sum(0), c + a.shape[0])

    mods = {n: m for n, m in lm.model.named_modules() if n.endswith(PROJS) and any(w in n for w in wanted)}
    hs = [m.register_forward_hook(lambda mod, i, o, n=n: hook(mod, i, o, n)) for n, m in mods.items()]
    with torch.no_grad():
        for b in x.split(2):
            lm.model(b)
    for h in hs:
        h.remove()
    tot = {}
    for n, m in mods.items():
        H, s, c = acc[n]
        H, mu = H / c, s / c
        W = m.weight.detach().float()
        if W.shape[1] % 16:
            continue
        q6 = quantize_nvfp4(W, NVFP4())
        dd = torch.diagonal(H).float()
        row = {"linear": n, "mean_share": float(mu @ mu / torch.trace(H))}
        cands = {"rtn6": q6, "sweep": quantize_nvfp4(W, NVFP4(scale_rule="sweep"), encode_scale=q6.outer_scale),
                 "hessian": quantize_weighted(W, "hessian", q6.outer_scale, dd)}
        for k, q in cands.items():
            E = (dequantize_nvfp4(q) - W).double()
            row[f"full_{k}"] = float(((E @ H) * E).sum())
            row[f"diag_{k}"] = float((E.square() * dd.double()).sum())
            row[f"mean_{k}"] = float((E @ mu).square().sum())
            tot[k] = tot.get(k, 0.0) + row[f"full_{k}"]
        print(json.dumps(row), flush=True)
    print(json.dumps({"model": args.model, "total_full": tot}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
