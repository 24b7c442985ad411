"""Mixed-precision PTQ recipes: perplexity and checkpoint size of full precision, all-NVFP4 W4A4,
all-FP8 W8A8, the write-up's mixed recipe (NVFP4 W4A4 MLPs + FP8 W8A8 attention) without and with an
FP8 KV cache, and the mixed recipe after 50 scale-only distillation steps.

    python experiments/mixed_results.py --model smollm2-135m --eval-tokens 16384 --n-samples 32 --out runs/mixed-smollm2
    python experiments/mixed_results.py --model stories260k --out runs/mixed-stories260k
    python experiments/mixed_results.py --report-only runs/mixed-smollm2 runs/mixed-stories260k \
        --notes docs/results/mixed-reading.md > docs/results/mixed.md

Every quantized model is exported (compressed-tensors) and reloaded with ``blockscale.load``; the
perplexity is that of the reloaded checkpoint (what ``blockscale eval ppl`` measures), the size the
bytes of its tensors. The scale-learning row is the documented pipeline: ``quantize --recipe
nvfp4-experts-fp8-attention`` -> export A -> load A -> ``learn-scales`` (50 steps) -> export B -> load B.
Evaluation windows are those of docs/results/ptq.md. Finished rows are appended to OUT/results.jsonl;
a rerun skips them.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockscale import lsq
from blockscale.data.text_sources import calibration_batches
from blockscale.export import export_checkpoint, load_checkpoint
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl
from blockscale.recipes import PTQRecipe, Scheme, get_ptq_recipe

MIXED = "nvfp4-experts-fp8-attention"


def _recipes(scale_rule: str) -> list[tuple[str, str, PTQRecipe]]:
    """(key, label, recipe) of each quantized row before scale learning."""
    mixed = get_ptq_recipe(MIXED).with_nvfp4(scale_rule=scale_rule)
    return [
        ("nvfp4-w4a4", "all NVFP4 W4A4", PTQRecipe.single(Scheme("nvfp4-w4a4", scale_rule=scale_rule))),
        ("fp8-w8a8", "all FP8 W8A8 (per-tensor, static)", get_ptq_recipe("fp8")),
        ("mixed", "mixed: NVFP4 W4A4 MLP + FP8 attention", dataclasses.replace(mixed, kv_cache=None)),
        ("mixed-kv", "mixed + FP8 KV cache", mixed),
    ]


def tensor_bytes(d: Path) -> dict:
    """Bytes of the tensors of an exported checkpoint: all of them, and those of the decoder layers."""
    from safetensors import safe_open

    total = decoder = 0
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                b = t.numel() * t.element_size()
                total += b
                if ".layers." in k:
                    decoder += b
    return {"bytes": total, "decoder_bytes": decoder}


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done_file = out / "results.jsonl"
    done = {json.loads(x)["key"] for x in done_file.read_text().splitlines()} if done_file.exists() else set()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    d = default_texts(args.model)
    eval_src = args.eval or ("tinystories#0:0.8" if args.model == "stories260k" else d.eval)
    skip = args.model == "stories260k"  # its MLP width 172 is not a multiple of 16
    meta = {"model": args.model, "eval": eval_src, "ctx": d.ctx, "bos": d.bos, "eval_tokens": args.eval_tokens,
            "calib": d.calib, "n_samples": args.n_samples, "seq_len": args.seq_len, "scale_rule": args.scale_rule,
            "lsq_steps": args.steps, "lsq_lr": args.lr_scales, "lsq_batch": [args.batch_size, args.train_seq_len],
            "threads": args.threads, "torch": torch.__version__, "skip_indivisible": skip,
            "machine": platform.processor() or platform.machine()}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    tmp = Path(tempfile.mkdtemp(prefix="mixed-", dir=out))

    def ppl(model):
        return evaluate_ppl(model, lm.tokenizer, eval_src, d.ctx, d.bos, args.eval_tokens)

    def record(key, label, rec, size, seconds, extra=None):
        row = {"key": key, "label": label, "ppl": rec.ppl, "loss": rec.loss, "tokens": rec.tokens_evaluated,
               "seconds": seconds, **size, **(extra or {})}
        with open(done_file, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{key:12s} ppl {rec.ppl:9.4f}  bytes {size.get('bytes', 0):>11,}  {seconds:6.1f} s", flush=True)

    if "fp" not in done:
        n = sum(p.numel() * p.element_size() for k, p in lm.model.state_dict().items()
                if k != "lm_head.weight" or not lm.model.config.tie_word_embeddings)
        dec = sum(p.numel() * p.element_size() for k, p in lm.model.state_dict().items() if ".layers." in k)
        record("fp", "full precision (FP32)", ppl(lm.model), {"bytes": n, "decoder_bytes": dec}, 0.0)
    recipes = _recipes(args.scale_rule)
    for key, label, recipe in recipes:
        if key in done and not (key == "mixed-kv" and "mixed-kv-lsq" not in done):
            continue
        t0 = time.time()
        model = copy.deepcopy(lm.model)
        cfg = PTQConfig(method="rtn", recipe=recipe, n_samples=args.n_samples, seq_len=args.seq_len,
                        skip_indivisible=skip)
        calibrate_and_quantize(model, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
        path = tmp / key
        export_checkpoint(model, path, "compressed-tensors", tokenizer=lm.tokenizer.hf if lm.tokenizer else None)
        seconds = time.time() - t0
        reloaded = load_checkpoint(path)
        if key not in done:
            record(key, label, ppl(reloaded), tensor_bytes(path), seconds)
        if key == "mixed-kv" and "mixed-kv-lsq" not in done:
            t0 = time.time()
            lsq.enable(reloaded, mode="tied", init="stored")
            tokens = calibration_batches(lm.tokenizer, d.calib, args.train_samples, args.train_seq_len, seed=0,
                                         bos=d.calib_bos)
            dcfg = lsq.DistillConfig(steps=args.steps, lr_scales=args.lr_scales, batch_size=args.batch_size,
                                     seq_len=args.train_seq_len, seed=0, out_dir=str(tmp / "lsq"))
            lsq.distill(reloaded, lm.model, tokens, dcfg, progress=False)
            lsq.freeze(reloaded)
            path_b = tmp / "mixed-kv-lsq"
            export_checkpoint(reloaded, path_b, "compressed-tensors")
            seconds = time.time() - t0
            record("mixed-kv-lsq", f"mixed + FP8 KV, then {args.steps} scale-only steps", ppl(load_checkpoint(path_b)),
                   tensor_bytes(path_b), seconds)


def report(dirs, notes=None) -> str:
    lines = ["# Mixed-precision PTQ recipes: perplexity and checkpoint size", "",
             "Command (from the repository root; each model's table is one run):", "", "```",
             "python experiments/mixed_results.py --model smollm2-135m --eval-tokens 16384 --n-samples 32 "
             "--out runs/mixed-smollm2",
             "python experiments/mixed_results.py --model stories260k --out runs/mixed-stories260k",
             "python experiments/mixed_results.py --report-only runs/mixed-smollm2 runs/mixed-stories260k "
             "--notes docs/results/mixed-reading.md > docs/results/mixed.md", "```", "",
             "Every quantized row is the exported compressed-tensors checkpoint reloaded with `blockscale.load` "
             "(the perplexity `blockscale eval ppl` reports). Bytes = the stored tensors of the checkpoint (all / "
             "decoder layers only); the full-precision row counts the FP32 model's tensors (the tied head once). "
             "Mixed = the built-in recipe `nvfp4-experts-fp8-attention`: NVFP4 W4A4 on every MLP Linear "
             "(the experts' stand-in), FP8 W8A8 (E4M3, per-tensor weight scale, static per-tensor input scale) on "
             "q/k/v/o; FP8 KV = E4M3 K and V with one calibrated scale per layer, applied inside attention. "
             "High precision in every quantized row: the embeddings, the output head and the norms (stored FP32)."]
    for d in map(Path, dirs):
        meta = json.loads((d / "meta.json").read_text())
        rows = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()]
        by = {r["key"]: r for r in rows}
        fp = by["fp"]["ppl"]
        ev = f"`{meta['eval']}`" + (f", first {meta['eval_tokens']} tokens" if meta["eval_tokens"] else "")
        lines += ["", f"## {meta['model']}", "",
                  f"Evaluation: {ev}, ctx {meta['ctx']}, BOS: {meta['bos']}, {by['fp']['tokens']} tokens scored. "
                  f"Calibration: {meta['n_samples']} random windows of {meta['seq_len']} tokens from "
                  f"`{meta['calib']}`. NVFP4 block scales: rule `{meta['scale_rule']}`. Scale learning: tied, "
                  f"{meta['lsq_steps']} steps, lr {meta['lsq_lr']:g}, {meta['lsq_batch'][0]} x "
                  f"{meta['lsq_batch'][1]} tokens per step from `{meta['calib']}`, T^2 KL to the full-precision "
                  f"model. Gap = ppl / full-precision ppl - 1. torch {meta['torch']}, {meta['threads']} threads."
                  + (" The MLP down-projections (172 inputs, not a multiple of 16) stay in high precision in the "
                     "NVFP4 rows (`skip_indivisible`)." if meta.get("skip_indivisible") else ""),
                  "", "| configuration | ppl | gap | bytes (all) | bytes (decoder layers) | vs FP32 decoder |",
                  "|---|---:|---:|---:|---:|---:|"]
        fp_dec = by["fp"]["decoder_bytes"]
        for key in ("fp", "nvfp4-w4a4", "fp8-w8a8", "mixed", "mixed-kv", "mixed-kv-lsq"):
            r = by.get(key)
            if r is None:
                continue
            gap = "" if key == "fp" else f"{100 * (r['ppl'] / fp - 1):+.2f}%"
            lines.append(f"| {r['label']} | {r['ppl']:.4f} | {gap} | {r['bytes']:,} | {r['decoder_bytes']:,} | "
                         f"{r['decoder_bytes'] / fp_dec:.3f} |")
    if notes:
        lines += ["", "## Reading (written by hand from the tables above)", "", Path(notes).read_text().strip()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--out", default="runs/mixed-stories260k")
    ap.add_argument("--eval", default=None)
    ap.add_argument("--eval-tokens", type=int, default=None)
    ap.add_argument("--n-samples", type=int, default=128, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    ap.add_argument("--scale-rule", default="sweep", choices=("6", "4over6", "sweep"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr-scales", type=float, default=3e-3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--train-seq-len", type=int, default=128)
    ap.add_argument("--train-samples", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report-only", nargs="+", metavar="DIR")
    ap.add_argument("--notes", help="a markdown file appended as the report's 'Reading' section")
    args = ap.parse_args(argv)
    if args.report_only:
        sys.stdout.write(report(args.report_only, args.notes))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
