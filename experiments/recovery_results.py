"""Recovering the 4-bit loss: how much of the RTN -> full-precision perplexity gap each stage of the
pipeline closes (PTQ, then learned block scales and latent weights at 50 / 100 / 200 steps), W4A16 and W4A4,
and the same for the variants (scales only, tied vs dual, raw vs log amax units, constant vs cosine lr,
learning rates, learned W4A4 input scales, larger batches).

    python experiments/recovery_results.py --model stories260k --out runs/recovery-stories260k      # resumable
    python experiments/recovery_results.py --model smollm2-135m --out runs/recovery-smollm2         # resumable
    python experiments/recovery_results.py --report-only runs/recovery-smollm2 runs/recovery-stories260k \
        --notes docs/results/recovery-reading.md > docs/results/recovery.md
    python experiments/recovery_results.py --model qwen2.5-coder-0.5b --out runs/recovery-qwen05 \
        --activations w4a16 --only 'defaults (learn-scales --steps 50)'    # a model nobody tuned on: lsq's defaults

Models: the two the defaults were chosen on (stories260k, smollm2-135m: every run) and Qwen2.5-Coder-0.5B-Instruct
(the GGUF of experiments/fetch_qwen_gguf.py --model 0.5b; only the runs that name it: lsq's defaults unchanged).
The PTQ rows of each table (``PTQ_ROWS``) include GPTQ, AWQ and AutoRound started from the Hessian-aware scales;
``--only LABEL`` with a PTQ row's label runs that row.

``--only NAME ...`` runs just those runs (e.g. ``pipeline``), ``--activations w4a16`` one activation mode.
The pipeline: PTQ with Hessian-aware block scales (``scale_rule="hessian"``), then distillation from the
full-precision model with dual scales whose pre amaxes stay at the PTQ scales (codes from the PTQ grid, learned
value scales: the dual fix of docs/lsq.md) in log units at lr 3e-3, and the latent FP32 weights at lr
``LR_WEIGHTS``, cosine with 10 warm-up steps, one 200-step schedule evaluated at 50 / 100 / 200; latent weights
from ``quantize_model(latent_weights=...)`` / ``lsq.exact_latent_weights``. W4A4 runs it twice: with the
activations scaled to 6 (what serving engines compute) and with Four Over Six on the activations.
Evaluation: SmolLM2 on the first 40 windows of WikiText-2 test at ctx 1024; stories260K on the first 128
windows of 512 of the held-out TinyStories split (``tinystories#0:0.8``). Calibration and training
text: C4 (SmolLM2) / ``tinystories#0.8:1`` (stories260K), disjoint from the evaluation text. Every result is
one JSON line in OUT/results.jsonl; a rerun skips what is there, and a learned-scale run resumes from its
last milestone (``lsq.distill(..., resume=True)``: exact). Gap closed = (ppl_RTN - ppl) / (ppl_RTN - ppl_fp),
against RTN-6 with the same activations (W4A4: activations scaled to 6).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from blockscale import lsq
from blockscale.data.text_sources import calibration_batches
from blockscale.models.hf import load_model
from blockscale.ptq import AutoRoundOptions, AWQOptions, GPTQOptions, PTQConfig
from blockscale.ptq.pipeline import calibrate_and_quantize, default_texts, evaluate_ppl

MODELS = {
    "smollm2-135m": dict(eval="wikitext2", eval_tokens=40 * 1024, ctx=1024, calib_samples=32, calib_seq_len=512,
                         train_samples=512, train_seq_len=128, batch_size=4, skip_indivisible=False),
    "stories260k": dict(eval="tinystories#0:0.8", eval_tokens=128 * 512, ctx=512, calib_samples=128, calib_seq_len=512,
                        train_samples=512, train_seq_len=256, batch_size=4, skip_indivisible=True),
    # nobody tuned on it: the GGUF of experiments/fetch_qwen_gguf.py --model 0.5b (dequantized Q4_K_M weights are
    # the full-precision baseline); 16 evaluation windows (a 40-window evaluation takes ~7 min on 2 cores)
    "qwen2.5-coder-0.5b": dict(path=str(Path.home() / ".cache/blockscale/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
                               eval="wikitext2", eval_tokens=16 * 1024, ctx=1024, calib_samples=32, calib_seq_len=512,
                               train_samples=512, train_seq_len=128, batch_size=4, skip_indivisible=False),
    # a small MoE trained with our trainer (experiments/moe_ptq_results.py: 4 layers, 8 experts top-2, 3.4M
    # parameters, tok512, the first 90% of the TinyStories head's tokens), saved as a transformers Mixtral;
    # evaluated on the last 8% of that text (never trained on), calibrated and distilled on its training part
    "moe-3m": dict(path=str(Path.home() / ".cache/blockscale/runs/moe-ptq/hf"), eval="tinystories#0.92:1",
                   eval_tokens=64 * 256, ctx=256, calib_samples=32, calib_seq_len=256, train_samples=512,
                   train_seq_len=256, batch_size=4, skip_indivisible=False, calib="tinystories#0:0.9",
                   calib_bos=False, bos="none"),
}
TEXT_OVERRIDES = ("calib", "calib_bos", "bos")  # a spec's own texts, where default_texts does not know the model

# PTQ starts: label -> PTQConfig fields (activations added per run)
A46 = "RTN hessian, activations 4/6"
AR50 = "AutoRound hessian, 50 iters"
GH = "GPTQ hessian"
AGH = "AWQ + GPTQ hessian"
AGH46 = "AWQ + GPTQ hessian, activations 4/6"
G46A46 = "GPTQ+4/6 (aware), activations 4/6"
STARTS = {
    "RTN-6": dict(method="rtn"),
    "AWQ+4/6": dict(method="awq", scale_rule="4over6", options=AWQOptions(clip=False)),  # (as measured)
    "GPTQ+4/6 (aware)": dict(method="gptq", scale_rule="4over6", options=GPTQOptions(four_over_six="aware")),
    G46A46: dict(method="gptq", scale_rule="4over6", options=GPTQOptions(four_over_six="aware"),
                 act_scale_rule="4over6"),
    "RTN hessian": dict(method="rtn", scale_rule="hessian"),
    A46: dict(method="rtn", scale_rule="hessian", act_scale_rule="4over6"),
    "GPTQ": dict(method="gptq"),
    "AWQ": dict(method="awq", options=AWQOptions(clip=False)),
    "AWQ, auto-clip": dict(method="awq", options=AWQOptions(clip=True)),  # AWQ's default since 2026-12-05
    # AutoRound from the Hessian-aware scales with a quarter of its default 200 iterations per decoder layer (200
    # take ~90 min on SmolLM2 on 2 cores: 0.9 s per iteration and layer)
    AR50: dict(method="autoround", scale_rule="hessian", options=AutoRoundOptions(iters=50)),
    AR50 + ", 128 windows": dict(method="autoround", scale_rule="hessian", options=AutoRoundOptions(iters=50),
                                 n_samples=128),
    "RTN hessian, 128 windows": dict(method="rtn", scale_rule="hessian", n_samples=128),
    # GPTQ whose group scales are the Hessian-aware rule's, chosen inside its loop from the corrected weights
    GH: dict(method="gptq", scale_rule="hessian"),
    "AWQ hessian": dict(method="awq", scale_rule="hessian"),  # AWQ's smoothing, then RTN with Hessian-aware scales
    AGH: dict(method="awq", scale_rule="hessian", options=AWQOptions(quantizer="gptq")),  # ... then GPTQ hessian
    AGH46: dict(method="awq", scale_rule="hessian", options=AWQOptions(quantizer="gptq"), act_scale_rule="4over6"),
    # the unweighted rules under the Hessian-aware ones (which of the two hurts on Qwen: the sweep's MSE, or d)
    "RTN sweep": dict(method="rtn", scale_rule="sweep"), "RTN 4/6": dict(method="rtn", scale_rule="4over6"),
    "RTN hessian-4/6": dict(method="rtn", scale_rule="hessian-4over6"),
    "GPTQ hessian-4/6": dict(method="gptq", scale_rule="hessian-4over6"),
}
# PTQ rows of the tables (the pipeline's starts and, for comparison, the best methods of docs/results/ptq.md)
PTQ_ROWS = {"smollm2-135m": {"w4a16": ("RTN hessian", "GPTQ", GH, "AWQ", "AWQ, auto-clip", "AWQ hessian", AGH, AR50,
                                       "RTN hessian, 128 windows", AR50 + ", 128 windows", "GPTQ+4/6 (aware)"),
                             "w4a4": ("RTN hessian", A46, "GPTQ", GH, "AWQ", "AWQ, auto-clip", "AWQ hessian", AGH,
                                      AGH46, "GPTQ+4/6 (aware)", G46A46)},
            "qwen2.5-coder-0.5b": {"w4a16": ("RTN hessian", "GPTQ", GH, "AWQ", "AWQ hessian", AGH, "RTN sweep",
                                             "RTN 4/6", "RTN hessian-4/6", "GPTQ+4/6 (aware)", "GPTQ hessian-4/6"),
                                   "w4a4": ("RTN hessian", "GPTQ", GH, "AWQ hessian", AGH, "GPTQ+4/6 (aware)",
                                            G46A46)},
            "moe-3m": {"w4a16": ("RTN hessian", "GPTQ", GH, "AWQ", "AWQ, auto-clip", "AWQ hessian", AGH, AR50,
                                 "GPTQ+4/6 (aware)"),
                       "w4a4": ("RTN hessian", "GPTQ", GH, "AWQ", "AWQ, auto-clip", "AWQ hessian", AGH, AR50, A46)},
            "stories260k": {"w4a16": ("GPTQ+4/6 (aware)", "RTN hessian", "GPTQ", GH, "AWQ", "AWQ, auto-clip",
                                      "AWQ hessian", AGH, AR50),
                            "w4a4": ("GPTQ+4/6 (aware)", "RTN hessian", A46, "GPTQ", GH, "AWQ", "AWQ, auto-clip",
                                     "AWQ hessian", AGH, AR50)}}
# the pipeline's starts: W4A4 twice (activations scaled to 6, as engines do; Four Over Six on the activations)
PIPELINE_STARTS = {"w4a16": ("RTN hessian",), "w4a4": ("RTN hessian", A46)}

LR_WEIGHTS = 5e-5  # the latent weights' lr (raw units): docs/results/recovery.md
# the pipeline's distillation: dual scales, pre amaxes frozen (codes on the PTQ grid), value scales in log units,
# latent weights trained too, cosine lr with 10 warm-up steps
PIPELINE = dict(mode="dual", param="log", dual_form="pair", lr=3e-3, schedule="cosine", warmup=10, lr_pre_factor=0.0,
                train="all", lr_weights=LR_WEIGHTS)
SCALES_ONLY = dict(PIPELINE, train="scales")
TIED = dict(SCALES_ONLY, mode="tied", lr_pre_factor=1.0)
# runs: (name, start: "pipeline" (each of the pipeline's starts) or a STARTS label, settings, milestones,
#        where: None (everywhere) or a set of "model/acts" it runs for)
ALL = None
RUNS = [
    ("pipeline", "pipeline", PIPELINE, (50, 100, 200), ALL),
    ("scales only", "pipeline", SCALES_ONLY, (50, 100, 200), {"stories260k/w4a16", "stories260k/w4a4"}),
    ("from RTN, learned scales and weights", "RTN-6", PIPELINE, (50, 200), {"stories260k/w4a16", "stories260k/w4a4"}),
    ("pipeline, batch 16", "RTN hessian", dict(PIPELINE, batch_size=16), (50, 200), {"stories260k/w4a4"}),
    ("pipeline, 1 x 512-token windows", "RTN hessian", dict(PIPELINE, batch_size=1, seq_len=512), (50, 100, 200),
     {"smollm2-135m/w4a16"}),
    # 50-step comparisons from the W4A16 / W4A4 (activations 6) start, each its own 50-step schedule
    ("scales only: dual pair, pre frozen (the fix), log", "RTN hessian", SCALES_ONLY, (50,), ALL),
    ("scales only: tied, log, cosine", "RTN hessian", TIED, (50,), ALL),
    ("scales only: tied, log, constant lr", "RTN hessian", dict(TIED, schedule="constant", warmup=0), (50,),
     {"stories260k/w4a16", "stories260k/w4a4"}),
    ("scales only: tied, raw amax (write-up units), cosine", "RTN hessian", dict(TIED, param="amax"), (50,), ALL),
    ("scales only: dual pair (write-up), log", "RTN hessian", dict(SCALES_ONLY, lr_pre_factor=1.0), (50,), ALL),
    ("scales only: dual ratio, log", "RTN hessian", dict(SCALES_ONLY, dual_form="ratio", lr_pre_factor=1.0), (50,),
     {"stories260k/w4a16", "stories260k/w4a4"}),
    ("learned input scales", "RTN hessian", dict(PIPELINE, learn_input_scales=True), (50,), {"stories260k/w4a4"}),
    ("tied scales + weights", "RTN hessian", dict(PIPELINE, mode="tied", lr_pre_factor=1.0), (50,),
     {"stories260k/w4a16", "stories260k/w4a4"}),
]
# latent weights in block units (lsq.latent_weight: lr relative to each block's scale) and best-step selection on
# 32 held-out training windows (the distillation loss, every 5 steps and the start): issue 32
BLOCK_UNITS = dict(PIPELINE, weight_units="block", lr_weights=1e-3)
SELECTED = dict(holdout=32, select_every=5)
RUNS += [
    ("pipeline, raw weight units (lr 5e-5), 50 steps", "RTN hessian", PIPELINE, (50,), ALL),
    ("pipeline, block weight units (lr 1e-3)", "RTN hessian", BLOCK_UNITS, (50,), ALL),
    ("pipeline, block weight units (lr 3e-3)", "RTN hessian", dict(BLOCK_UNITS, lr_weights=3e-3), (50,), ALL),
    ("pipeline, block weight units (lr 1e-3), held-out best step", "RTN hessian", dict(BLOCK_UNITS, **SELECTED),
     (50,), {"stories260k/w4a16", "stories260k/w4a4"}),
    ("pipeline, block weight units (lr 3e-3), held-out best step", "RTN hessian",
     dict(BLOCK_UNITS, lr_weights=3e-3, **SELECTED), (50,), ALL),
    ("scales only, held-out best step", "RTN hessian", dict(SCALES_ONLY, **SELECTED), (50,), ALL),
    ("scales only (lr 1e-2), held-out best step", "RTN hessian", dict(SCALES_ONLY, lr=1e-2, **SELECTED), (50,), ALL),
]
# lsq's recovery defaults exactly as ``learn-scales --steps 50`` runs them (lsq.RECOVERY_*, recovery_distill_config:
# warm-up a tenth, held-out selection every fifth of the run on RECOVERY_HOLDOUT windows), on models nobody tuned on
_CLI50 = lsq.recovery_distill_config(50)


def probe_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments the probes built on these runs share (``--model``, ``--start``, ``--activations``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(MODELS))
    ap.add_argument("--start", default="GPTQ hessian", choices=sorted(STARTS))
    ap.add_argument("--activations", default="w4a4", choices=("w4a16", "w4a4"))
    return ap


def _cli_defaults(steps: int, retry: bool = False) -> dict:
    """The settings ``learn-scales --steps STEPS`` runs (with its lr retry when ``retry``)."""
    c = lsq.recovery_distill_config(steps)
    return dict(PIPELINE, **lsq.RECOVERY_ENABLE, lr=c.lr_scales, lr_weights=c.lr_weights, warmup=c.warmup_steps,
                holdout=lsq.RECOVERY_HOLDOUT, select_every=c.eval_every, **({"lr_retries": c.lr_retries} if retry else {}))


DEFAULTS = _cli_defaults(50)
UNTUNED = {"qwen2.5-coder-0.5b/w4a16", "qwen2.5-coder-0.5b/w4a4"}
EVERY = {f"{m}/{a}" for m in ("smollm2-135m", "stories260k", "qwen2.5-coder-0.5b", "moe-3m") for a in ("w4a16", "w4a4")}
RUNS += [
    ("defaults (learn-scales --steps 50)", "RTN hessian", DEFAULTS, (50,),
     UNTUNED | {"smollm2-135m/w4a16", "stories260k/w4a16"}),
    ("defaults, scales only (--train scales)", "RTN hessian", dict(DEFAULTS, train="scales"), (50,), UNTUNED),
    ("defaults at a third of the lr (1e-3 / 1e-3)", "RTN hessian", dict(DEFAULTS, lr=1e-3, lr_weights=1e-3), (50,),
     UNTUNED | {"smollm2-135m/w4a16", "stories260k/w4a16"}),
    # the same from GPTQ (PTQ alone: 58% of the gap on Qwen2.5-0.5B, where the Hessian-aware start is below RTN)
    ("defaults at a third of the lr, from GPTQ", "GPTQ", dict(DEFAULTS, lr=1e-3, lr_weights=1e-3), (50,),
     {"qwen2.5-coder-0.5b/w4a16", "smollm2-135m/w4a16"}),
    # the defaults with their retry (DistillConfig.lr_retries: when the best step is the start, again from it at a
    # third of the lrs); the rows above were measured before the retry existed (lr_retries 0)
    ("defaults with the lr retry (learn-scales --steps 50)", "RTN hessian",
     dict(DEFAULTS, lr_retries=_CLI50.lr_retries), (50,),
     UNTUNED | {"smollm2-135m/w4a16", "stories260k/w4a16", "moe-3m/w4a16", "moe-3m/w4a4"}
     | {"smollm2-135m/w4a4", "stories260k/w4a4"}),
    # scale-only learning and longer runs with the same defaults, each its own schedule (learn-scales --steps N)
    ("defaults with the lr retry, scales only (learn-scales --train scales --steps 50)", "RTN hessian",
     dict(_cli_defaults(50, retry=True), train="scales"), (50,), EVERY),
    ("defaults with the lr retry (learn-scales --steps 100)", "RTN hessian", _cli_defaults(100, retry=True), (100,),
     EVERY),
    ("defaults with the lr retry (learn-scales --steps 200)", "RTN hessian", _cli_defaults(200, retry=True), (200,),
     EVERY),
    ("defaults with the lr retry, scales only (learn-scales --train scales --steps 200)", "RTN hessian",
     dict(_cli_defaults(200, retry=True), train="scales"), (200,), EVERY),
]
# the same defaults from the best PTQ starts of 2026-12-06 (GPTQ with Hessian-aware scales, alone or after AWQ's
# smoothing): learn-scales --method M --scale-rule R --steps 50
_RETRY50 = dict(DEFAULTS, lr_retries=_CLI50.lr_retries)
RUNS += [
    ("defaults with the lr retry (learn-scales --steps 50)", GH, _RETRY50, (50,),
     {"stories260k/w4a16", "stories260k/w4a4", "qwen2.5-coder-0.5b/w4a16"}),
    ("defaults with the lr retry (learn-scales --steps 50)", AGH, _RETRY50, (50,),
     {"smollm2-135m/w4a16", "stories260k/w4a16", "moe-3m/w4a16", "smollm2-135m/w4a4", "qwen2.5-coder-0.5b/w4a16",
      "moe-3m/w4a4"}),
    ("defaults with the lr retry (learn-scales --steps 200)", AGH, _cli_defaults(200, retry=True), (200,),
     {"smollm2-135m/w4a4", "smollm2-135m/w4a16"}),
    # Qwen's best PTQ (GPTQ with 4/6-aware group scales, 63%: the Hessian-aware rules lose there)
    ("defaults with the lr retry (learn-scales --steps 50)", "GPTQ+4/6 (aware)", _RETRY50, (50,),
     {"qwen2.5-coder-0.5b/w4a16", "stories260k/w4a16", "moe-3m/w4a16", "qwen2.5-coder-0.5b/w4a4",
      "smollm2-135m/w4a16", "smollm2-135m/w4a4"}),
    # (Qwen 99%: does that start carry? On Qwen in W4A4 too: its first learned W4A4 row, seventeenth stop; on
    # SmolLM2, where it had never been measured, eighteenth stop)
]
# the next-token loss on the training text mixed into the KL (learn-scales --ce-weight W): on Qwen2.5-0.5B a lower KL
# to the full-precision model did not give a lower perplexity (experiments/position_kl_diagnosis.py)
RUNS += [(f"defaults with the lr retry, ce-weight {w:g} (learn-scales --ce-weight {w:g} --steps 50)", st,
          dict(_RETRY50, ce_weight=w), (50,), where) for w in (0.5, 1.0)
         for st, where in ((AGH, {"smollm2-135m/w4a16", "stories260k/w4a16", "moe-3m/w4a16", "smollm2-135m/w4a4"}),
                           ("GPTQ+4/6 (aware)", {"qwen2.5-coder-0.5b/w4a16"}))]
# longer training windows, the same training tokens (512 x 128 in 128 windows of 512; 512 tokens a step): do the
# 128-token windows cap recovery on a 1024-token evaluation? (learn-scales --batch-size 1 --seq-len 512)
RUNS += [("defaults with the lr retry, 1 x 512-token windows (learn-scales --batch-size 1 --seq-len 512 --steps 50)",
          "RTN hessian", dict(_RETRY50, batch_size=1, seq_len=512), (50,),
          {"smollm2-135m/w4a16", "smollm2-135m/w4a4", "stories260k/w4a16", "stories260k/w4a4"})]
# W4A4: the best start with Four Over Six on the activations too, and that start with the longer windows (issue 32's
# 75%: the activations' own rounding is a third of SmolLM2's W4A4 gap, experiments/w4a4_floor.py)
RUNS += [("defaults with the lr retry (learn-scales --steps 50)", AGH46, _RETRY50, (50,), {"smollm2-135m/w4a4"}),
         ("defaults with the lr retry, 1 x 512-token windows (learn-scales --batch-size 1 --seq-len 512 --steps 50)",
          AGH46, dict(_RETRY50, batch_size=1, seq_len=512), (50,), {"smollm2-135m/w4a4"})]
# 200 steps from AWQ + GPTQ hessian kept step 40 (W4A16): the held-out loss rose after it while the training loss fell.
# Repeated windows? Four times the windows (2,048 x 128 tokens; 800 drawn in 200 steps), the held-out ones from a
# part of the text of their own (as learn-scales draws them since the thirteenth stop). Its lr retry (a third of the
# lrs, the same 200 steps) is the second half of the answer.
_DISJOINT = dict(_cli_defaults(200, retry=True), disjoint_holdout=True)
RUNS += [("defaults with the lr retry, 2048 windows (learn-scales --steps 200 --n-samples 2048)", AGH,
          dict(_DISJOINT, train_samples=2048, holdout=2048 // 32), (200,), {"smollm2-135m/w4a16", "smollm2-135m/w4a4"}),
         # that retry alone (its first run was stopped by a time limit at retry step 160): 80.9% (50 steps: 80.4%)
         ("2048 windows, a third of the lr (learn-scales --steps 200 --n-samples 2048 --lr-scales 1e-3 --lr-weights "
          "1e-3)", AGH, dict(_DISJOINT, train_samples=2048, holdout=2048 // 32, lr=1e-3, lr_weights=1e-3), (200,),
          {"smollm2-135m/w4a16"})]
RUNS += [("defaults at a third of the lr, from GPTQ, ce-weight 1", "GPTQ",
          dict(DEFAULTS, lr=1e-3, lr_weights=1e-3, ce_weight=1.0), (50,), {"qwen2.5-coder-0.5b/w4a16"})]
# the two small models still gained from 100 to 200 steps in W4A4 (stories260K 50% -> 57%, the MoE 35% -> 45%): is
# the 75% a matter of steps? 1,000 steps, the defaults' schedule for that length (learn-scales --steps 1000), on the
# defaults' 512 windows and on 2,048 with the held-out ones apart
_SMALL = {f"{m}/{a}" for m in ("stories260k", "moe-3m") for a in ("w4a16", "w4a4")}


def _windows2048(steps: int) -> dict:
    """``learn-scales --steps STEPS --n-samples 2048`` (its lr retry; the held-out 64 from a text part of their own)."""
    return dict(_cli_defaults(steps, retry=True), disjoint_holdout=True, train_samples=2048, holdout=2048 // 32)


RUNS += [("defaults with the lr retry (learn-scales --steps 1000)", "RTN hessian", _cli_defaults(1000, retry=True),
          (1000,), _SMALL),
         ("defaults with the lr retry, 2048 windows (learn-scales --steps 1000 --n-samples 2048)", "RTN hessian",
          _windows2048(1000), (1000,), _SMALL),
         # stories260K still gained in the last fifth of 1,000 steps (W4A16 84.3%): twice the steps
         ("defaults with the lr retry, 2048 windows (learn-scales --steps 2000 --n-samples 2048)", "RTN hessian",
          _windows2048(2000), (2000,), {"stories260k/w4a16", "stories260k/w4a4"})]
# the same 1,000 steps on 2,048 windows from each small model's better start: W4A4 (stories260K: GPTQ hessian, 45%;
# the MoE: 4/6 on the activations, 25%) and stories260K W4A16 from its best 50-step start (AWQ + GPTQ hessian 73.4%
# vs RTN hessian 65.6%; eighteenth stop)
RUNS += [("defaults with the lr retry, 2048 windows (learn-scales --steps 1000 --n-samples 2048)", start,
          _windows2048(1000), (1000,), {where})
         for start, where in ((GH, "stories260k/w4a4"), (A46, "moe-3m/w4a4"), (AGH, "stories260k/w4a16"))]
# Qwen W4A4 from GPTQ+4/6 (aware) reached 73.9%: that start with Four Over Six on the activations too (on SmolLM2
# the activations' 4/6 gave +0.8 points after learning, twelfth stop); on SmolLM2 too (nineteenth stop)
RUNS += [("defaults with the lr retry (learn-scales --steps 50)", G46A46, _RETRY50, (50,),
          {"qwen2.5-coder-0.5b/w4a4", "smollm2-135m/w4a4"})]
# SmolLM2 W4A16 gained from 50 to 200 steps from RTN hessian (77.0% -> 80.0%, best step the last); stories260K's
# 1,000 steps on 2,048 windows from that start gave its best W4A16 (84.3%): 500 such steps on SmolLM2 (about an
# hour on 2 cores; nineteenth stop)
RUNS += [("defaults with the lr retry, 2048 windows (learn-scales --steps 500 --n-samples 2048)", "RTN hessian",
          _windows2048(500), (500,), {"smollm2-135m/w4a16"})]
TUNING_MODELS = ("smollm2-135m", "stories260k")  # the runs for every model (where None) run on these only
# learning rates of the pipeline, 50 steps each from the W4A16 start: (lr scales, lr weights)
LR_SWEEP = {"stories260k": ((1e-2, LR_WEIGHTS), (3e-3, LR_WEIGHTS), (3e-3, 1e-4), (3e-3, 3e-4), (3e-3, 2e-5)),
            "smollm2-135m": ((1e-2, LR_WEIGHTS), (3e-3, 1e-4))}


def model_and_texts(model: str):
    """(spec, loaded model, texts) of ``MODELS[model]``, as ``run_all`` uses them (for the diagnosis scripts)."""
    spec = MODELS[model]
    lm = load_model(spec.get("path", model))
    d = default_texts(spec.get("path", model))
    return spec, lm, dataclasses.replace(d, **{k: spec[k] for k in TEXT_OVERRIDES if k in spec})


def _ppl(model, lm, spec, d) -> float:
    return evaluate_ppl(model, lm.tokenizer, spec["eval"], spec["ctx"], d.bos, spec["eval_tokens"]).ppl


_CACHE: dict = {}  # (start, acts) -> (quantized model, seconds, latent): each PTQ runs once per process


def _quantized(lm, start: str, acts: str, spec, d, keep: bool = True):
    """The ``start`` quantization of a copy of the model, its seconds and latent weights; kept for the learned-scale
    runs that start from it when ``keep`` (a 0.5B model's copy and latent weights hold 4 GB), else handed over and
    dropped from the cache."""
    if (start, acts) in _CACHE:  # the last run from it takes the cached model itself (no copy, the cache freed)
        qm, sec, latent = _CACHE[(start, acts)] if keep else _CACHE.pop((start, acts))
        return (copy.deepcopy(qm) if keep else qm), sec, latent
    student = copy.deepcopy(lm.model)
    fields = dict(STARTS[start])  # a start may calibrate on more windows than the model's default
    cfg = PTQConfig(activations=acts, n_samples=fields.pop("n_samples", spec["calib_samples"]),
                    seq_len=spec["calib_seq_len"], skip_indivisible=spec["skip_indivisible"], **fields)
    t = time.time()
    latent = {}
    calibrate_and_quantize(student, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False, latent_weights=latent)
    sec = time.time() - t
    if keep:
        _CACHE[(start, acts)] = (copy.deepcopy(student), sec, latent)
    return student, sec, latent


def _dirname(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in key)


class Results:
    def __init__(self, out: Path):
        self.path = out / "results.jsonl"
        self.rows = [json.loads(x) for x in self.path.read_text().splitlines()] if self.path.exists() else []

    def get(self, key):
        return next((r for r in self.rows if r["key"] == key), None)

    def add(self, row):
        self.rows = [r for r in self.rows if r["key"] != row["key"]] + [row]
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def run_lsq(lm, spec, d, res, out, tokens, key, start, s, milestones, acts, keep: bool = True):
    """One learned-scale run: PTQ start (the ``start`` quantization, exactly), lsq.enable with the settings,
    distill to each milestone of one schedule of ``milestones[-1]`` steps, evaluating at each. ``keep``: keep the
    PTQ start for a later run of this process (on Qwen2.5-0.5B its copy and latent weights hold 4 GB: a run with
    the lr retry that kept them was killed for memory at its end)."""
    todo = [m for m in milestones if res.get(f"{key}@{m}") is None]
    if not todo:
        return
    L, n = s.get("seq_len", spec["train_seq_len"]), s.get("train_samples", spec["train_samples"])
    if (L, n) != (spec["train_seq_len"], spec["train_samples"]) or s.get("disjoint_holdout"):
        # the same training tokens in longer windows, more windows, or the held-out windows from a part of the text
        # of their own (the rows before 2026-12-06's thirteenth stop drew them among the training windows)
        tokens = calibration_batches(lm.tokenizer, d.calib, n * spec["train_seq_len"] // L, L, seed=1,
                                     bos=d.calib_bos, holdout=s.get("holdout", 0) if s.get("disjoint_holdout") else 0)
    student, ptq_s, latent = _quantized(lm, start, acts, spec, d, keep=keep)
    # latent weights: the full-precision (transformed) weights PTQ rounded where they reproduce its codes
    weights, dequantized = lsq.exact_latent_weights(student, latent)
    lsq.enable(student, mode=s["mode"], init="stored", weights=weights, param=s["param"], dual_form=s["dual_form"],
               learn_input_scales=s.get("learn_input_scales", False), weight_units=s.get("weight_units", "raw"))
    n_dequantized, n_latent = len(dequantized), len(weights)
    del weights, latent  # cloned into the LSQ layers: up to two more FP32 copies (2.9 GB on Qwen2.5-0.5B) not held
    tokens, held = lsq.split_holdout(tokens, s.get("holdout", 0))  # held-out windows choose the step
    if s.get("lr_retries") and len(milestones) > 1:
        raise SystemExit(f"run {key!r}: lr_retries needs one milestone (a retry restarts the schedule)")
    for m in milestones:
        cfg = lsq.DistillConfig(steps=m, lr_scales=s["lr"], batch_size=s.get("batch_size", spec["batch_size"]),
                                seq_len=s.get("seq_len", spec["train_seq_len"]), lr_schedule=s["schedule"],
                                warmup_steps=s["warmup"],
                                schedule_steps=milestones[-1], lr_pre_factor=s.get("lr_pre_factor", 1.0),
                                train=s.get("train", "scales"), lr_weights=s.get("lr_weights", 1e-5),
                                min_lr_ratio=0.0, seed=0, out_dir=str(out / "train" / _dirname(key)), log_every=10,
                                keep_best=held is not None, eval_loss="distill" if held is not None else "next_token",
                                eval_every=s.get("select_every", 0) if held is not None else 0,
                                ckpt_every=0, lr_retries=s.get("lr_retries", 0) if held is not None else 0,
                                ce_weight=s.get("ce_weight", 0.0))
        t = time.time()
        r = lsq.distill(student, lm.model, tokens, cfg, eval_tokens=held, resume=True, progress=False)
        train_s = time.time() - t
        if res.get(f"{key}@{m}") is not None:
            continue
        ppl = _ppl(student, lm, spec, d)
        res.add({"key": f"{key}@{m}", "run": key.split(" [")[0], "activations": acts, "start": start, "steps": m,
                 "settings": s, "ppl": ppl, "ptq_seconds": ptq_s, "train_seconds_segment": train_s,
                 "seconds_per_step": r["seconds_per_step"], "optimizer_state_bytes": r["optimizer_state_bytes"],
                 "trainable_params": r["trainable_params"], "final_loss": r["final_loss"],
                 "best_step": r["best_step"], "eval_losses": r["eval_losses"],
                 "latent_dequantized": n_dequantized, "latent_total": n_latent,
                 **({"attempts": r["attempts"]} if "attempts" in r else {})})


def _runs(model: str, acts: str):
    """(name, start, settings, milestones) of every run for ``model`` / ``acts``: RUNS (the pipeline once per
    pipeline start) and, in W4A16, the learning-rate sweep."""
    out = []
    for name, start, s, milestones, where in RUNS:
        if (where is None and model not in TUNING_MODELS) or (where is not None and f"{model}/{acts}" not in where):
            continue
        for st in (PIPELINE_STARTS[acts] if start == "pipeline" else (start,)):
            out.append((name, st, s, milestones))
    if acts == "w4a16":
        for lr, lw in LR_SWEEP.get(model, ()):
            out.append((f"lr {lr:g} / {lw:g}", PIPELINE_STARTS[acts][0], dict(PIPELINE, lr=lr, lr_weights=lw), (50,)))
    return out


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec = MODELS[args.model]
    if "path" in spec and not Path(spec["path"]).exists():
        how = ("python experiments/moe_ptq_results.py --out ~/.cache/blockscale/runs/moe-ptq --only RTN "
               "--activations w4a16" if args.model == "moe-3m" else "python experiments/fetch_qwen_gguf.py --model 0.5b")
        raise SystemExit(f"--model {args.model}: {spec['path']} is missing; make it first with {how}")
    spec, lm, d = model_and_texts(args.model)
    res = Results(out)
    meta = {"model": args.model, **{k: v for k, v in spec.items()}, "calib": d.calib, "bos": d.bos,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "pipeline": PIPELINE, "pipeline_starts": PIPELINE_STARTS}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    if res.get("fp") is None:
        res.add({"key": "fp", "ppl": _ppl(lm.model, lm, spec, d)})
    tokens = calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                 bos=d.calib_bos)
    for acts in args.activations:
        for start in ("RTN-6",) + PTQ_ROWS[args.model][acts]:
            key = f"ptq {start} | {acts}"
            if res.get(key) is None and (not args.only or start in PIPELINE_STARTS[acts] or start == "RTN-6"
                                         or start in args.only):
                used = any(st == start and (not args.only or name in args.only or f"{name} [{st}]" in args.only)
                           for name, st, _, _ in _runs(args.model, acts))
                qm, sec, _ = _quantized(lm, start, acts, spec, d, keep=used)
                res.add({"key": key, "start": start, "activations": acts, "ppl": _ppl(qm, lm, spec, d),
                         "ptq_seconds": sec})
                del qm
        todo = [(name, start, s, milestones) for name, start, s, milestones in _runs(args.model, acts)
                if not args.only or name in args.only or f"{name} [{start}]" in args.only]
        todo = [t for t in todo if any(res.get(f"{t[0]} [{t[1]}] | {acts}@{m}") is None for m in t[3])]
        for i, (name, start, s, milestones) in enumerate(todo):
            later = any(st == start for _, st, _, _ in todo[i + 1:])  # keep the PTQ start only for a later run
            run_lsq(lm, spec, d, res, out, tokens, f"{name} [{start}] | {acts}", start, s, milestones, acts,
                    keep=later)


def main(argv=None) -> int:
    import recovery_report  # (it imports this module's tables)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k", choices=sorted(MODELS))
    ap.add_argument("--out")
    ap.add_argument("--activations", nargs="+", default=["w4a16", "w4a4"], choices=("w4a16", "w4a4"))
    ap.add_argument("--only", nargs="*", help="run names to run (e.g. pipeline), or one run from one start as "
                    "'NAME [START]', or PTQ rows")
    ap.add_argument("--report-only", nargs="+", metavar="DIR")
    ap.add_argument("--notes")
    ap.add_argument("--title", help="the report's title (default: the recovery pipeline's)")
    ap.add_argument("--generated-by", help="the report's 'Generated by' paragraph (default: recovery.md's commands)")
    args = ap.parse_args(argv)
    if args.report_only:
        kw = {k: v for k, v in (("title", args.title), ("generated_by", args.generated_by)) if v}
        print(recovery_report.report(args.report_only, args.notes, **kw))
        return 0
    if not args.out:
        ap.error("--out is required (or --report-only)")
    run_all(args)
    print(recovery_report.report([args.out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
