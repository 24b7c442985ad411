"""The recovery pipeline's scale-learning settings (docs/results/recovery.md), in one place: after a calibrated
PTQ (best: Hessian-aware block scales, ``scale_rule="hessian"``), distill from the full-precision model with

- dual block scales whose pre amaxes (the codes' grid) stay at the PTQ scales, so only the value scales learn
  (``mode="dual"``, ``lr_pre_factor=0``), in log units (``param="log"``) at ``RECOVERY_LR_SCALES``;
- the latent FP32 weights trained too (``train="all"``) at ``RECOVERY_LR_WEIGHTS`` in units of each block's scale
  (``weight_units="block"``: the same share of a quantization step on every model), moving codes;
- a cosine schedule with a tenth of the steps as linear warm-up;
- the step chosen on ``RECOVERY_HOLDOUT`` held-out training windows (``RecoveryConfig.holdout``; the distillation
  loss on them every fifth of the run, the PTQ start included: ``DistillConfig.keep_best``);
- when that step is the start (learning never beat the PTQ model there), one retry from the start at a third of
  both learning rates (``DistillConfig.lr_retries``: ``RECOVERY_LR_RETRIES``; Qwen2.5-0.5B, where lr 3e-3 never
  beats the start and 1e-3 closes 58% of the gap: docs/results/recovery-models.md).

Measured (50 steps, 4 x 128 tokens each): SmolLM2-135M W4A16 and W4A4 and stories260K, in
docs/results/recovery.md. ``blockscale learn-scales --train all`` and ``blockscale demo`` use these values.

    lsq.enable(model, init="stored", weights=latent, **lsq.RECOVERY_ENABLE)
    train, held = lsq.split_holdout(tokens, lsq.RECOVERY_HOLDOUT)
    lsq.distill(model, teacher, train, lsq.recovery_distill_config(50, keep_best=True, eval_loss="distill"),
                eval_tokens=held)
"""
from __future__ import annotations

from .distill import DistillConfig

RECOVERY_LR_SCALES = 3e-3  # log units: the same relative step on every model
RECOVERY_LR_WEIGHTS = 3e-3  # block units (5e-5 in raw units before issue 32)
RECOVERY_ENABLE = {"mode": "dual", "param": "log", "dual_form": "pair", "weight_units": "block"}
RECOVERY_LR_RETRIES = 1  # runs again at a third of the lrs when the best step is the start
RECOVERY_HOLDOUT = 16  # windows of the training text held out to choose the step (2,048 tokens of 128-token windows)


def recovery_distill_config(steps: int, **overrides) -> DistillConfig:
    """The pipeline's ``DistillConfig`` for ``steps`` steps (4 x 128 tokens per step; held-out evaluations every
    fifth of the run when given ``eval_tokens``); ``overrides`` replace any field (e.g. ``out_dir``,
    ``batch_size``, ``train="scales"``)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}; allowed values: integers >= 1")
    fields = dict(steps=steps, train="all", lr_scales=RECOVERY_LR_SCALES, lr_weights=RECOVERY_LR_WEIGHTS,
                  lr_pre_factor=0.0, lr_schedule="cosine", warmup_steps=steps // 10, min_lr_ratio=0.0, batch_size=4,
                  seq_len=128, eval_every=max(1, steps // 5), lr_retries=RECOVERY_LR_RETRIES)
    fields.update(overrides)
    return DistillConfig(**fields)


__all__ = ["RECOVERY_HOLDOUT", "RECOVERY_LR_RETRIES", "RECOVERY_ENABLE", "RECOVERY_LR_SCALES", "RECOVERY_LR_WEIGHTS", "recovery_distill_config"]
