"""PTQ of a small MoE we train ourselves, saved as a transformers Mixtral: NVFP4 W4A16 / W4A4 of the fused
experts with RTN, Four Over Six, GPTQ and AWQ, one outer scale per expert vs per tensor, experts calibrated on
their routed tokens vs on every token.

    python experiments/moe_ptq_results.py --out runs/moe-ptq --doc docs/results/moe-ptq.md   # ~20 min, 2 CPU cores

1. Train (``blockscale.train.trainer.train``) a Llama with an MoE in every block (8 SwiGLU experts, top-2) on
   TinyStories tokenized with stories260K's tok512 (90/10 train / held-out split of the token stream).
   Resumable: OUT/train/ckpt.pt is reused (a finished run is not retrained).
2. Save it as a transformers Mixtral directory (``models.save_hf_mixtral``, OUT/hf, with the tok512 tokenizer)
   and load it back through ``models.hf.load_model`` as ``blockscale quantize`` does; check its held-out
   perplexity equals our model's.
3. For each PTQ configuration: ``ptq.pipeline.quantized_copy`` (calibration windows from the training part of
   the text), held-out perplexity over the exact held-out token split, tokens routed to each expert during
   calibration, wall time. Each result is cached in OUT/ptq/<name>.json (a rerun skips it).
4. Write the markdown table (``--doc``).

``--smoke`` shrinks everything (a tiny model, a few steps, two RTN configurations) to check the script runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from blockscale.data import data_root
from blockscale.eval import perplexity
from blockscale.models import Llama, LlamaConfig, load_tokenizer, save_hf_mixtral
from blockscale.models.hf import load_model
from blockscale.nn.moe import MoEConfig
from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig
from blockscale.ptq.pipeline import quantized_copy
from blockscale.train.token_data import load_data
from blockscale.train.trainer import TrainConfig, train

CALIB = "tinystories#0:0.9"  # the training part of the text (the held-out split is the last 10% of its tokens)

# (label, PTQConfig fields); each runs with activations W4A16 and W4A4, outer scale per expert and per tensor,
# and (methods that calibrate) experts calibrated on their routed tokens and on every token
METHODS = [
    ("RTN", dict(method="rtn")),
    ("RTN-4/6", dict(method="rtn", scale_rule="4over6")),
    ("GPTQ", dict(method="gptq")),
    ("GPTQ-4/6 (aware)", dict(method="gptq", scale_rule="4over6", options=GPTQOptions(four_over_six="aware"))),
    ("AWQ", dict(method="awq", options=AWQOptions(clip=False))),  # (as measured: without auto-clip)
]
SMOKE_METHODS = ["RTN", "RTN-4/6"]


def model_config(args) -> LlamaConfig:
    return LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
                       vocab_size=512, hidden_dim=args.d_ff, max_seq_len=args.seq_len,
                       moe=MoEConfig(n_experts=args.experts, top_k=args.top_k, aux_loss_coef=0.01))


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


# ----------------------------------------------------------------------------- 1. training

def train_model(args, data) -> tuple[Llama, dict]:
    cfg_model = model_config(args)
    model = Llama(cfg_model, seed=args.seed)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      min_lr=args.lr / 10, warmup_steps=args.warmup, eval_interval=args.eval_interval,
                      eval_batches=args.eval_batches, seed=args.seed, out_dir=str(Path(args.out) / "train"),
                      log_interval=10, progress=not args.quiet, device="cpu", autocast="none")
    # the record lets `blockscale to-hf OUT/train` rebuild the model and pick the tokenizer
    record = {"recipe": None, "model": dataclasses.asdict(cfg_model), "tokenizer": "tok512"}
    t0 = time.perf_counter()
    res = train(model, data, cfg, resume=True, record=record)
    # from the run's metrics.jsonl, which a resumed (or already finished) run keeps whole
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    curve = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    info = {"steps": res.step, "final_train_loss": rows[-1]["train_loss"], "final_val_loss": curve[-1][1],
            "tokens": args.steps * args.batch_size * args.seq_len, "train_seconds": rows[-1]["elapsed_s"],
            "this_run_seconds": time.perf_counter() - t0, "already_finished": res.already_finished,
            "params": model.num_params(), "config": dataclasses.asdict(cfg_model), "train_config": cfg.to_dict(),
            "val_curve": curve}
    return model.eval(), info


# ----------------------------------------------------------------------------- 2. routing of the FP model

@torch.no_grad()
def routed_fraction(model: Llama, ids: torch.Tensor, ctx: int) -> list[list[float]]:
    """Per layer, the fraction of the top-k assignments of held-out tokens each expert receives."""
    counts = [torch.zeros(model.config.moe.n_experts) for _ in model.layers]

    def count(i):
        def hook(module, inputs, output):
            counts[i].add_(output[0].counts.float())  # returns None: the output is left as it is
        return hook

    hooks = [layer.feed_forward.router.register_forward_hook(count(i)) for i, layer in enumerate(model.layers)]
    n = (ids.numel() // ctx) * ctx
    for start in range(0, n, 8 * ctx):
        model(ids[start:min(n, start + 8 * ctx)].view(-1, ctx))
    for h in hooks:
        h.remove()
    return [(c / c.sum()).tolist() for c in counts]


# ----------------------------------------------------------------------------- 3. PTQ runs

def configurations(args) -> list[tuple[str, dict]]:
    names = SMOKE_METHODS if args.smoke else [m for m, _ in METHODS]
    if args.only:
        names = [m for m in names if any(s.lower() in m.lower() for s in args.only)]
    out = []
    for label, fields in METHODS:
        if label not in names:
            continue
        for acts in args.activations:
            for outer in args.outer_scales:
                for calib_all in (False, True):
                    cfg = PTQConfig(**fields, activations=acts, expert_outer_scale=outer,
                                    calibrate_all_experts=calib_all, n_samples=args.n_samples,
                                    seq_len=args.calib_seq_len, batch_size=8, seed=0)
                    if calib_all and not cfg.needs_calibration:
                        continue  # no calibration statistics: the same model as without calibrate_all
                    name = f"{label} {acts} outer-{outer}" + (" calib-all" if calib_all else "")
                    out.append((name, dict(fields, activations=acts, expert_outer_scale=outer,
                                           calibrate_all_experts=calib_all)))
    return out


def experts_tokens(report) -> dict:
    """Calibration tokens per expert (routed, and what the statistics saw), over every fused-experts module."""
    mods = report.experts
    routed = [t for r in mods if r.routed_tokens is not None for t in r.routed_tokens]
    seen = [t for r in mods if r.tokens is not None for t in r.tokens]
    out = {"modules": len(mods), "outer_scale": sorted({r.outer_scale for r in mods}),
           "notes": [r.note for r in mods if r.note]}
    for key, vals in (("routed", routed), ("statistics", seen)):
        if vals:
            out[key] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals),
                        "zero": sum(1 for v in vals if v == 0), "per_module": [
                            (r.routed_tokens if key == "routed" else r.tokens) for r in mods]}
    return out


def run_ptq(args, lm, held_out: torch.Tensor, name: str, fields: dict) -> dict:
    path = Path(args.out) / "ptq" / f"{slug(name)}.json"
    if path.exists():
        return json.loads(path.read_text())
    fields = dict(fields)
    cfg = PTQConfig(**fields, n_samples=args.n_samples, seq_len=args.calib_seq_len, batch_size=8, seed=0)
    t0 = time.perf_counter()
    qmodel, report = quantized_copy(lm.model, lm.tokenizer, cfg, CALIB, progress=not args.quiet)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    r = perplexity(qmodel, held_out, args.seq_len, batch_size=8)
    rec = {"name": name, "label": cfg.label, "method": fields["method"], "activations": fields["activations"],
           "expert_outer_scale": fields["expert_outer_scale"],
           "calibrate_all_experts": fields["calibrate_all_experts"], "ppl": r.ppl, "loss": r.loss,
           "tokens_evaluated": r.tokens_evaluated, "ptq_seconds": seconds, "eval_seconds": time.perf_counter() - t1,
           "calibration_tokens": report.calibration_tokens, "experts": experts_tokens(report),
           "linears": len(report.linears), "kept_high_precision": list(report.kept_high_precision)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    print(f"[{name}] ppl {r.ppl:.4f} (PTQ {seconds:.1f} s)", flush=True)
    return rec


# ----------------------------------------------------------------------------- 4. the write-up

def _tok(e: dict, key: str) -> str:
    s = e.get(key)
    if not s:
        return "-"
    return f"{s['min']} / {s['median']:g} / {s['max']}" + (f" ({s['zero']} none)" if s["zero"] else "")


def write_doc(doc: Path, args, command: str, base: dict, results: list[dict], minutes: float) -> None:
    t, c = base["train"], base["train"]["config"]
    fp = base["fp_ppl"]
    lines = ["# PTQ of a small MoE (as a transformers Mixtral)", "",
             f"Command (took {minutes:.0f} min on this machine, {args.threads} threads; cached parts skipped):", "",
             "```", command, "```", "",
             f"Model: our Llama with an MoE in every block: dim {c['dim']}, {c['n_layers']} layers, "
             f"{c['moe']['n_experts']} SwiGLU experts of hidden size {c['hidden_dim']}, top-{c['moe']['top_k']} "
             f"(renormalised), {t['params'] / 1e6:.2f}M parameters. Trained with `blockscale.train.trainer.train` "
             f"on TinyStories (`tinystories_val_head.txt`, stories260K's tok512 BPE, 90/10 split of the token "
             f"stream) for {t['steps']} steps x {args.batch_size} x {args.seq_len} tokens "
             f"({t['tokens']:,} tokens), AdamW lr {args.lr:g} (warmup {args.warmup}, cosine to lr/10), "
             f"{t['train_seconds'] / 60:.1f} min: final train loss {t['final_train_loss']:.4f}, "
             f"validation loss {t['final_val_loss']:.4f} (by step: "
             + ", ".join(f"{s}: {v:.3f}" for s, v in t["val_curve"]) + ").", "",
             f"Saved with `blockscale.models.save_hf_mixtral` (the same as `blockscale to-hf {args.out}/train --out "
             f"DIR`) and loaded back with `models.hf.load_model` (as `blockscale quantize` does). Held-out "
             f"perplexity over the first {base['held_out_tokens']:,} held-out tokens (ctx {args.seq_len}, no BOS): "
             f"ours {base['ours_ppl']:.4f}, the transformers Mixtral {fp:.4f} (max |logit difference| "
             f"{base['max_logit_diff']:.1e}).", "",
             f"PTQ: NVFP4 (`blockscale.ptq.PTQConfig`), calibration {args.n_samples} windows x {args.calib_seq_len} "
             f"tokens from `{CALIB}` (the training part). The router (`mlp.gate`), embeddings and lm_head stay FP32. "
             "`outer` is `expert_outer_scale`: one NVFP4 outer scale per expert and projection (gate/up of an "
             "expert shared) or one per projection for all experts of a layer. `calib-all` is "
             "`calibrate_all_experts`: expert statistics (GPTQ Hessians, AWQ inputs, W4A4 input scales) from every "
             "calibration token instead of the tokens routed to each expert (RTN W4A16 calibrates nothing, so it "
             "has no such row). Tokens per expert: calibration tokens routed to each expert, min / median / max "
             "over all experts of all layers (each layer routes with the layers before it already quantized).", "",
             "| method | activations | outer | calib-all | held-out ppl | vs FP | tokens per expert (routed) "
             "| PTQ s | eval s |",
             "|---|---|---|---|---:|---:|---|---:|---:|",
             f"| FP32 | - | - | - | {fp:.4f} | - | - | - | - |"]
    for r in results:
        lines.append(f"| {r['name'].split(' w4a')[0]} | {r['activations'].upper()} | {r['expert_outer_scale']} | "
                     f"{'yes' if r['calibrate_all_experts'] else 'no'} | {r['ppl']:.4f} | "
                     f"{100 * (r['ppl'] / fp - 1):+.2f}% | {_tok(r['experts'], 'routed')} | {r['ptq_seconds']:.1f} | "
                     f"{r['eval_seconds']:.1f} |")
    lines += ["", "Routing of the FP model on the held-out tokens (share of the top-k assignments per expert, "
              "per layer): " + "; ".join(f"layer {i}: " + " ".join(f"{100 * f:.0f}" for f in fr) + " %"
                                         for i, fr in enumerate(base["held_out_routing"])), ""]
    notes = sorted({n for r in results for n in r["experts"]["notes"]})
    if notes:
        lines += ["Notes from the PTQ reports:", ""] + [f"- {n}" for n in notes] + [""]
    lines += [f"Machine: {base['machine']}, torch {torch.__version__}. Raw results: `{args.out}/ptq/*.json`, "
              f"`{args.out}/base.json`.", ""]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))
    print(f"wrote {doc}")


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/moe-ptq")
    p.add_argument("--doc", default=None, help="write the markdown results here (e.g. docs/results/moe-ptq.md)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=256, help="expert hidden size (a multiple of 16)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="training and evaluation context")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--n-samples", type=int, default=32, help="calibration windows")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--eval-tokens", type=int, default=16384,
                   help="held-out perplexity over the first N held-out tokens (0: all ~38K)")
    p.add_argument("--activations", nargs="+", default=["w4a16", "w4a4"], choices=("w4a16", "w4a4"))
    p.add_argument("--outer-scales", nargs="+", default=["expert", "tensor"], choices=("expert", "tensor"))
    p.add_argument("--only", nargs="+", help="run only methods whose label contains one of these strings")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check that the script runs: tiny model, 4 steps, RTN / RTN-4/6 only")
    args = p.parse_args(argv)
    if args.smoke:
        args.dim, args.layers, args.d_ff, args.steps, args.batch_size, args.seq_len = 32, 2, 64, 4, 4, 64
        args.warmup, args.eval_interval, args.eval_batches, args.n_samples, args.calib_seq_len = 1, 2, 2, 4, 64
        args.eval_tokens = 2048
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + list(argv if argv is not None
                                                                                  else sys.argv[1:]))
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tok = load_tokenizer(data_root() / "stories260K" / "tok512.bin")
    data = load_data("tinystories", encode=tok.encode, vocab_size=tok.vocab_size, val_fraction=0.1)
    model, train_info = train_model(args, data)
    held_out = data.val.long()
    if args.eval_tokens:
        held_out = held_out[:args.eval_tokens]
    print(f"trained: {train_info['params']:,} parameters, val loss {train_info['final_val_loss']:.4f}", flush=True)

    hf_dir = save_hf_mixtral(model, out / "hf", tokenizer="tok512", overwrite=True)
    lm = load_model(str(hf_dir))
    with torch.no_grad():
        x = held_out[: 4 * args.seq_len].view(4, args.seq_len)
        max_diff = float((lm.model(x).logits - model(x)).abs().max())
    ours = perplexity(model, held_out, args.seq_len, batch_size=8)
    fp = perplexity(lm.model, held_out, args.seq_len, batch_size=8)
    base = {"train": train_info, "ours_ppl": ours.ppl, "fp_ppl": fp.ppl, "max_logit_diff": max_diff,
            "held_out_tokens": fp.tokens_evaluated, "held_out_routing": routed_fraction(model, held_out, args.seq_len),
            "machine": platform.processor() or platform.machine()}
    (out / "base.json").write_text(json.dumps(base, indent=1))
    print(f"held-out ppl: ours {ours.ppl:.4f}, transformers Mixtral {fp.ppl:.4f} (max |dlogit| {max_diff:.1e})",
          flush=True)

    results = [run_ptq(args, lm, held_out, name, fields) for name, fields in configurations(args)]
    if args.doc:
        write_doc(Path(args.doc), args, command, base, results, (time.perf_counter() - t_start) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
