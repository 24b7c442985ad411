"""AutoRoundOptions: the options of ``method="autoround"``."""
from __future__ import annotations

from dataclasses import dataclass

from ...options import check_options, option


@dataclass(frozen=True)
class AutoRoundOptions:
    """Options of AutoRound (``ptq.methods.autoround``; Cheng et al., "Optimize Weight Rounding via Signed
    Gradient Descent for the Quantization of LLMs").

    iters: sign-SGD steps per decoder layer, each on one calibration batch (0: the start, round to nearest
      with the scale rule, bit for bit).
    lr: the step of the first iteration, decaying linearly to 0 at ``iters`` (0: ``1 / iters``, AutoRound's
      default, so the rounding offsets can travel at most about half a grid step).
    clip_scales: also learn one clip factor per block scale (NVFP4 E4M3 block scales, FP8 per-channel and
      per-block scales; FP8 per-tensor scales are shared by a fused group and MX scales are powers of two:
      those stay at the start).
    min_clip: the smallest clip factor (each block scale stays within [min_clip, 1] x its start).
    seed: the order in which the calibration batches are drawn.
    """

    iters: int = option(200, "AutoRound sign-SGD steps per decoder layer (0: round to nearest)", lo=0)
    lr: float = option(0.0, "AutoRound first step, decaying linearly to 0 (0: 1/iters)", lo=0.0)
    clip_scales: bool = option(True, "AutoRound also learns a clip factor per block scale")
    min_clip: float = option(0.5, "AutoRound smallest clip factor of a block scale", lo=0.0, hi=1.0, lo_open=True)
    seed: int = option(0, "AutoRound seed of the calibration batch order", lo=0)

    def __post_init__(self):
        check_options(self)

    @property
    def step(self) -> float:
        """The first iteration's step: ``lr``, or ``1 / iters`` when lr is 0."""
        return self.lr if self.lr > 0 else 1.0 / max(self.iters, 1)


__all__ = ["AutoRoundOptions"]
