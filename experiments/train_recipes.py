"""Pretrain the same small Llama on the same text with every built-in recipe; compare to bf16.

    python experiments/train_recipes.py --out runs/recipes --doc docs/results/training.md

Same seed, data order and token budget for every recipe (the trainer's batches depend only on
seed and step). Writes one run directory per recipe (metrics.jsonl, config.json), a table of final
validation losses with the gap to bf16, whether Four Over Six narrows the NVFP4 gap, and one figure
with all loss curves.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

import blockscale as bs
from blockscale.models import PRESETS, Llama, LlamaConfig
from blockscale.train.token_data import load_data
from blockscale.train.trainer import TrainConfig, plot_losses, train

RECIPES = ["bf16", "mxfp8", "nvfp4-nvidia", "nvfp4-nvidia-4over6", "nvfp4-fwd-mxfp8-bwd"]


def run(args) -> list[dict]:
    data = load_data(args.data)
    base = PRESETS[args.preset]
    cfg_model = LlamaConfig(**{**base.__dict__, "vocab_size": data.vocab_size, "max_seq_len": args.seq})
    results = []
    for recipe in args.recipes.split(","):
        torch.manual_seed(args.seed)
        model = Llama(cfg_model)
        model.init_weights(args.seed)
        report = bs.convert(model, recipe)
        print(f"[{recipe}] {report}", flush=True)
        out = Path(args.out) / recipe
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch, seq_len=args.seq, lr=args.lr, min_lr=args.lr / 10,
                          warmup_steps=args.warmup, eval_interval=args.eval_interval, eval_batches=args.eval_batches,
                          seed=args.seed, out_dir=str(out), log_interval=10, progress=not args.quiet, device="cpu",
                          autocast="none")
        t0 = time.perf_counter()
        res = train(model, data, cfg)
        results.append(dict(recipe=recipe, val_loss=res.final_val_loss, train_loss=res.final_train_loss,
                            tokens=res.tokens, seconds=time.perf_counter() - t0, metrics=str(res.metrics_path),
                            params=sum(p.numel() for p in model.parameters()),
                            converted=len(report.converted), last_blocks=report.n_last_blocks))
        print(f"[{recipe}] final val loss {res.final_val_loss:.4f} in {results[-1]['seconds']:.0f} s", flush=True)
    return results


def write_doc(results: list[dict], args, doc: Path, png: Path, command: str, also=()) -> None:
    base = next((r["val_loss"] for r in results if r["recipe"] == "bf16"), None)
    lines = ["# Pretraining with each recipe", "",
             f"Command (took {sum(r['seconds'] for r in results) / 60:.0f} min on this machine):", "", "```",
             command, "```", "",
             f"Model: Llama-style preset `{args.preset}` ({results[0]['params'] / 1e6:.2f}M parameters), "
             f"data `{args.data}` (byte-level, 90/10 train/val split), {args.steps} steps x {args.batch} x "
             f"{args.seq} tokens = {results[0]['tokens']:,} training tokens, AdamW lr {args.lr} (warmup "
             f"{args.warmup}, cosine to lr/10), seed {args.seed}, validation on {args.eval_batches} fixed "
             "batches. GEMMs are emulated (quantize, dequantize, FP32 matmul), bit-exact to the formats.", "",
             "| recipe | final val loss | gap to bf16 | final train loss | wall time |", "|---|---:|---:|---:|---:|"]
    for r in results:
        gap = f"{100 * (r['val_loss'] - base) / base:+.2f}%" if base else "-"
        lines.append(f"| {r['recipe']} | {r['val_loss']:.4f} | {gap} | {r['train_loss']:.4f} | {r['seconds'] / 60:.1f} min |")
    lines += ["", _verdict(results)]
    for extra in also:
        lines += ["", f"Repeat with seed {extra['seed']} (`{extra['command']}`):", "",
                  "| recipe | final val loss | gap to bf16 |", "|---|---:|---:|"]
        xbase = next((r["val_loss"] for r in extra["results"] if r["recipe"] == "bf16"), None)
        for r in extra["results"]:
            gap = f"{100 * (r['val_loss'] - xbase) / xbase:+.2f}%" if xbase else "-"
            lines.append(f"| {r['recipe']} | {r['val_loss']:.4f} | {gap} |")
        lines += ["", _verdict(extra["results"])]
    lines += ["", f"![loss curves]({png.name})", ""]
    doc.write_text("\n".join(lines))


def _verdict(results: list[dict]) -> str:
    """Whether Four Over Six narrows the NVFP4 gap to bf16 (in nats of validation loss)."""
    by = {r["recipe"]: r["val_loss"] for r in results}
    if not {"bf16", "nvfp4-nvidia", "nvfp4-nvidia-4over6"} <= set(by):
        return ""
    g6, g46 = by["nvfp4-nvidia"] - by["bf16"], by["nvfp4-nvidia-4over6"] - by["bf16"]
    if g6 > 0 and g46 < g6:
        return (f"Four Over Six narrows the NVFP4 gap: {g6:+.4f} -> {g46:+.4f} nats, {100 * (g6 - g46) / g6:.0f}% "
                "closer to bf16 (the paper reports 13% at 30B scale).")
    return f"Four Over Six does not narrow the NVFP4 gap here: {g6:+.4f} -> {g46:+.4f} nats."


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="tinystories")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--backend", default="compiled", choices=("reference", "compiled", "auto"))
    ap.add_argument("--out", default="runs/recipes")
    ap.add_argument("--doc", default=None, help="write the results table (markdown) and a PNG beside it")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--report-only", action="store_true", help="rewrite --doc from <out>/results.json; no training")
    ap.add_argument("--also", action="append", default=[], metavar="RUN_DIR",
                    help="add another run's results (e.g. another seed) to the doc; repeatable")
    args = ap.parse_args(argv)
    bs.set_backend(args.backend)
    command = "python experiments/train_recipes.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    out = Path(args.out)
    if args.report_only:
        saved = json.loads((out / "results.json").read_text())
        results, command = saved["results"], saved["command"]
    else:
        results = run(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"command": command, "seed": args.seed, "results": results},
                                                     indent=2))
    also = [json.loads((Path(d) / "results.json").read_text()) for d in args.also]
    if args.doc:
        doc = Path(args.doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        png = doc.with_suffix(".png")
        plot_losses({r["recipe"]: r["metrics"] for r in results}, png,
                    title=f"{args.preset} Llama on {args.data}: loss per recipe")
        write_doc(results, args, doc, png, command, also)
        print(f"wrote {doc} and {png}")


if __name__ == "__main__":
    main()
