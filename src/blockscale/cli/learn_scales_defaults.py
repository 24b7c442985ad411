"""``blockscale learn-scales``'s defaults: each flag's value when not given (docs/results/recovery.md)."""
from __future__ import annotations

DEFAULT_LR_SCALES = 3e-3  # --param amax: docs/results/scale-learning.md
DEFAULT_LR_SCALES_LOG = 3e-3  # --param log (the default): lsq.RECOVERY_LR_SCALES, docs/results/recovery.md
DEFAULT_LR_WEIGHTS = 5e-5  # --train all --weight-units raw: docs/results/recovery.md
DEFAULT_LR_WEIGHTS_BLOCK = 3e-3  # --weight-units block: relative to each block's scale, docs/results/recovery.md
DEFAULT_MODE = "dual"  # value scales on the PTQ grid (with DEFAULT_LR_PRE_FACTOR): docs/results/recovery.md
DEFAULT_PARAM = "log"
DEFAULT_WEIGHT_UNITS = "block"  # --train all: lsq.RECOVERY_ENABLE["weight_units"]
DEFAULT_SCHEDULE = "cosine"
DEFAULT_LR_PRE_FACTOR = 0.0  # --mode dual: the pre amaxes (codes) stay at the PTQ scales (docs/lsq.md "Dual scales")
MAX_LR = 1e6  # Adam's first step moves a tensor by up to 10 lr: far below FP32's range, far above any useful lr


def default_lr_scales(param: str) -> float:
    """--lr-scales when not given: per parameterisation (a raw-amax lr and a log-amax lr are different units)."""
    return DEFAULT_LR_SCALES_LOG if param == "log" else DEFAULT_LR_SCALES


def default_lr_weights(weight_units: str) -> float:
    """--lr-weights when not given: per unit (a raw lr and a block-relative lr are different units)."""
    return DEFAULT_LR_WEIGHTS_BLOCK if weight_units == "block" else DEFAULT_LR_WEIGHTS


def default_holdout(n_samples: int, world_size: int = 1) -> int:
    """--holdout when not given: a thirty-second of the training windows (a multiple of the world size), 0 below
    32 (each evaluation runs student and teacher over them: docs/results/recovery-defaults.md)."""
    h = n_samples // 32
    return h - h % world_size


def default_select_every(steps: int) -> int:
    """--select-every when not given: a fifth of the run (at least every step)."""
    return max(1, steps // 5)


def default_warmup(steps: int) -> int:
    """--warmup-steps when not given: a tenth of the run (0 below 10 steps)."""
    return steps // 10


def scales_stuck(steps_per_scale_step: float, steps: int) -> bool:
    """Whether the run is too short for a typical block scale to move by one E4M3 step at all
    (``lsq.steps_per_scale_step``'s estimate exceeds ``--steps``): then --lr-scales is too small."""
    return steps_per_scale_step > steps


def default_ckpt_interval(steps: int) -> int:
    """--ckpt-interval when not given: a tenth of the run, at least every step and at most every 50."""
    return max(1, min(50, steps // 10))


__all__ = ["DEFAULT_LR_PRE_FACTOR", "DEFAULT_LR_SCALES", "DEFAULT_LR_SCALES_LOG", "DEFAULT_LR_WEIGHTS",
           "DEFAULT_LR_WEIGHTS_BLOCK", "DEFAULT_MODE", "DEFAULT_PARAM", "DEFAULT_SCHEDULE", "DEFAULT_WEIGHT_UNITS",
           "MAX_LR", "default_ckpt_interval", "default_holdout", "default_lr_scales", "default_lr_weights",
           "default_select_every", "default_warmup", "scales_stuck"]
