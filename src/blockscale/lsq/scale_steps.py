"""How many optimizer steps a block scale needs to move by one E4M3 step at a given learning rate (what
``blockscale learn-scales`` prints, and warns about when the run is shorter)."""
from __future__ import annotations

import math

import torch
from torch import nn

from .enable import learner_modules


def steps_per_scale_step(model: nn.Module, lr: float, max_samples: int = 1 << 20) -> tuple[float, float]:
    """(median block amax, lr-limited steps to move it by one E4M3 step). Adam changes a parameter by about
    ``lr`` per step whatever the gradient's size, and a stored E4M3 scale moves when its amax changes by
    1/16 to 1/8 of itself (3 mantissa bits). With param="amax" (raw amaxes) that is about
    ``median / (16 lr)`` steps (so the lr that suits a model scales with its weights' magnitude); with
    param="log" (log of the amax relative to its initial value) it is ``ln(1 + 1/16) / lr`` on every model."""
    learners = learner_modules(model)
    if not learners:
        raise ValueError("model has no LSQ amax parameters: run blockscale.lsq.enable(model, ...) first")
    flat = torch.cat([_first_amax(m).detach().flatten() for m in learners])
    if flat.numel() > max_samples:
        flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:max_samples]]
    med = float(flat.float().median())
    if all(m.param == "log" for m in learners):
        return med, math.log1p(0.0625) / lr
    return med, 0.0625 * med / lr


def _first_amax(learner: nn.Module) -> torch.Tensor:
    """The learner's (pre) amaxes; sharded by FSDP (outside forward its parameters are this rank's rows):
    the initial amaxes (param "log": a buffer, whole) or this rank's rows of the raw amaxes."""
    from torch.distributed.tensor import DTensor

    p = getattr(learner, learner.parameter_names()[0])
    if isinstance(p, DTensor):
        return learner.amax_init if learner.param == "log" else p.to_local()
    return learner.amaxes()[0]


__all__ = ["steps_per_scale_step"]
