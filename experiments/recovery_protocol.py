"""The recovery protocol's tables (experiments/recovery_results.py runs them): the models and their texts, the PTQ
starts and rows, the learned runs (name, start, settings, milestones, where) and the learning-rate sweep."""
from __future__ import annotations

from pathlib import Path

from blockscale import lsq
from blockscale.ptq import AutoRoundOptions, AWQOptions, GPTQOptions

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
                                      AGH46, "GPTQ+4/6 (aware)", G46A46, AR50)},
            "qwen2.5-coder-0.5b": {"w4a16": ("RTN hessian", "GPTQ", GH, "AWQ", "AWQ hessian", AGH, "RTN sweep",
                                             "RTN 4/6", "RTN hessian-4/6", "GPTQ+4/6 (aware)", "GPTQ hessian-4/6", AR50),
                                   "w4a4": ("RTN hessian", "GPTQ", GH, "AWQ", "AWQ hessian", AGH, "GPTQ+4/6 (aware)",
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



def cli_defaults(steps: int, retry: bool = False) -> dict:
    """The settings ``learn-scales --steps STEPS`` runs (with its lr retry when ``retry``)."""
    c = lsq.recovery_distill_config(steps)
    return dict(PIPELINE, **lsq.RECOVERY_ENABLE, lr=c.lr_scales, lr_weights=c.lr_weights, warmup=c.warmup_steps,
                holdout=lsq.RECOVERY_HOLDOUT, select_every=c.eval_every, **({"lr_retries": c.lr_retries} if retry else {}))


DEFAULTS = cli_defaults(50)
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
     dict(cli_defaults(50, retry=True), train="scales"), (50,), EVERY),
    ("defaults with the lr retry (learn-scales --steps 100)", "RTN hessian", cli_defaults(100, retry=True), (100,),
     EVERY),
    ("defaults with the lr retry (learn-scales --steps 200)", "RTN hessian", cli_defaults(200, retry=True), (200,),
     EVERY),
    ("defaults with the lr retry, scales only (learn-scales --train scales --steps 200)", "RTN hessian",
     dict(cli_defaults(200, retry=True), train="scales"), (200,), EVERY),
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
    ("defaults with the lr retry (learn-scales --steps 200)", AGH, cli_defaults(200, retry=True), (200,),
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


def _windows512(start: str, steps: int, where: set) -> tuple:
    """The run of ``learn-scales --batch-size 1 --seq-len 512 --steps STEPS`` (its lr retry) from ``start``."""
    return (f"defaults with the lr retry, 1 x 512-token windows (learn-scales --batch-size 1 --seq-len 512 --steps "
            f"{steps})", start, dict(cli_defaults(steps, retry=True), batch_size=1, seq_len=512), (steps,), where)


RUNS += [_windows512("RTN hessian", 50,
                     {"smollm2-135m/w4a16", "smollm2-135m/w4a4", "stories260k/w4a16", "stories260k/w4a4"})]
# W4A4: the best start with Four Over Six on the activations too, and that start with the longer windows (issue 32's
# 75%: the activations' own rounding is a third of SmolLM2's W4A4 gap, experiments/w4a4_floor.py); its 50 steps gave
# 73.8% (step 40 kept), 0.17 ppl short of 75%, and from RTN hessian 100 steps gained 2.5 points over 50: 100 steps too
RUNS += [("defaults with the lr retry (learn-scales --steps 50)", AGH46, _RETRY50, (50,), {"smollm2-135m/w4a4"}),
         *(_windows512(AGH46, n, {"smollm2-135m/w4a4"}) for n in (50, 100))]
# 200 steps from AWQ + GPTQ hessian kept step 40 (W4A16): the held-out loss rose after it while the training loss fell.
# Repeated windows? Four times the windows (2,048 x 128 tokens; 800 drawn in 200 steps), the held-out ones from a
# part of the text of their own (as learn-scales draws them since the thirteenth stop). Its lr retry (a third of the
# lrs, the same 200 steps) is the second half of the answer.
_DISJOINT = dict(cli_defaults(200, retry=True), disjoint_holdout=True)
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
    return dict(cli_defaults(steps, retry=True), disjoint_holdout=True, train_samples=2048, holdout=2048 // 32)


RUNS += [("defaults with the lr retry (learn-scales --steps 1000)", "RTN hessian", cli_defaults(1000, retry=True),
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
# the protocol's 50 / 100 / 200 steps for scale-only learning too (twentieth stop)
RUNS += [("defaults with the lr retry, scales only (learn-scales --train scales --steps 100)", "RTN hessian",
          dict(cli_defaults(100, retry=True), train="scales"), (100,), EVERY)]
# stories260K's W4A16 stops at 84.3% (1,000 steps on 2,048 windows; 2,000 give 82%): is the ceiling the lr or the
# gradient noise of 4-window batches? The same 1,000 steps at a third of the lr, and with 16-window batches
RUNS += [("2048 windows, a third of the lr (learn-scales --steps 1000 --n-samples 2048 --lr-scales 1e-3 "
          "--lr-weights 1e-3)", "RTN hessian", dict(_windows2048(1000), lr=1e-3, lr_weights=1e-3), (1000,),
          {"stories260k/w4a16"}),
         ("2048 windows, 16-window batches (learn-scales --steps 1000 --n-samples 2048 --batch-size 16)",
          "RTN hessian", dict(_windows2048(1000), batch_size=16), (1000,), {"stories260k/w4a16"}),
         # the runs gain their last points as the cosine reaches zero, and averaging the trained tensors over the
         # run's end does not beat its last step (twenty-third stop): a linear decay to zero spends longer at low lr
         ("2048 windows, linear decay (learn-scales --steps 1000 --n-samples 2048 --lr-schedule linear)",
          "RTN hessian", dict(_windows2048(1000), schedule="linear"), (1000,), {"stories260k/w4a16"}),
         # how far apart are two draws of the same run (the batches' seed)? and a longer low-lr phase: the cosine
         # over 800 steps to 2% of the lr, then 200 steps at 2%
         # (only the batches' seed: learn-scales --seed also redraws the training windows)
         *[(f"defaults with the lr retry, 2048 windows, batch seed {k} (learn-scales --steps 1000 --n-samples 2048; "
            f"DistillConfig(seed={k}))", "RTN hessian", dict(_windows2048(1000), seed=k), (1000,), {"stories260k/w4a16"})
           for k in (1, 2)],
         ("2048 windows, the cosine over 800 steps to 2% of the lr, then 200 steps at 2%", "RTN hessian",
          dict(_windows2048(1000), decay_steps=800, min_lr_ratio=0.02), (1000,), {"stories260k/w4a16"})]
# SmolLM2's best W4A16 with the defaults (81.1%, 100 steps from RTN hessian) drawn with two more batch seeds
RUNS += [(f"defaults with the lr retry, batch seed {k} (learn-scales --steps 100; DistillConfig(seed={k}))", "RTN hessian",
          dict(cli_defaults(100, retry=True), seed=k), (100,), {"smollm2-135m/w4a16"}) for k in (1, 2)]
TUNING_MODELS = ("smollm2-135m", "stories260k")  # the runs for every model (where None) run on these only
# learning rates of the pipeline, 50 steps each from the W4A16 start: (lr scales, lr weights)
LR_SWEEP = {"stories260k": ((1e-2, LR_WEIGHTS), (3e-3, LR_WEIGHTS), (3e-3, 1e-4), (3e-3, 3e-4), (3e-3, 2e-5)),
            "smollm2-135m": ((1e-2, LR_WEIGHTS), (3e-3, 1e-4))}

