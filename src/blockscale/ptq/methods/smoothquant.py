"""SmoothQuant (Xiao et al., 2023): static per-input-channel scales ``s_j = max|X_j|^alpha /
max|W_j|^(1-alpha)`` move activation outliers into the weights, which are easier to quantize; folded into
the preceding norm / linear (the full-precision function is unchanged), then the weights are RTN.

MoE layers (``ptq.smoothing.moe``): for a group whose consumers read different tokens (the post-attention
norm -> router, every expert's gate/up rows, the shared expert), max |X_j| runs over the union of the
quantized consumers' inputs (every token an expert was routed, or with calibrate_all every token) and
max |W_j| over the columns of the quantized consumers only (experts, shared expert Linears; the router
stays in high precision, so it is rescaled but does not limit s)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..options import check_options, option
from ..protocol import PTQMethod
from ..smoothing import FLOAT_DTYPES, check_alpha, check_smoothable, check_weights, smooth_layer
from ..statistics import StatisticsRequest

SQ_MIN, SQ_MAX = 1e-8, 1e8  # SmoothQuant's raw formula is not normalised, so its clamp is wide


def smoothquant_scales(act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant scales ``s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha)`` (FP32, shape [K]).

    act_absmax: [K] per-channel max |activation| over the calibration data (of the group's input).
    weights: the group's consumer weights [N_i, K] (the max runs over all their rows).
    Channels whose activation max or weight max is 0 get s = 1; the result is clamped to
    [SQ_MIN, SQ_MAX] = [1e-8, 1e8], so it is always finite and > 0. Computed in float64.
    """
    fn = "smoothquant_scales"
    alpha = check_alpha(alpha, fn)
    if not isinstance(act_absmax, torch.Tensor):
        raise TypeError(f"{fn}: act_absmax must be a torch.Tensor, got {type(act_absmax).__name__}")
    if act_absmax.dim() != 1:
        raise ValueError(f"{fn}: act_absmax has shape {tuple(act_absmax.shape)}; expected [K] (one max per channel)")
    if act_absmax.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: act_absmax has dtype {act_absmax.dtype}; expected a floating tensor")
    a = act_absmax.detach().double()
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise ValueError(f"{fn}: act_absmax must be finite and >= 0 (it is a max of |x|)")
    ws = check_weights(weights, a.numel(), fn)
    wmax = torch.stack([w.to(a.device).abs().double().amax(0) if w.shape[0] else torch.zeros_like(a)
                        for w in ws]).amax(0)
    valid = (a > 0) & (wmax > 0)
    ones = torch.ones_like(a)
    s = torch.where(valid, a, ones).pow(alpha) / torch.where(valid, wmax, ones).pow(1.0 - alpha)
    s = torch.where(valid, s, ones).clamp(SQ_MIN, SQ_MAX)
    return s.float()


@dataclass(frozen=True)
class SmoothQuantOptions:
    """Options of ``method="smoothquant"``."""

    alpha: float = option(0.5, "SmoothQuant migration strength", lo=0.0, hi=1.0)

    def __post_init__(self):
        check_options(self)


class SmoothQuant(PTQMethod):
    """Scales from the per-channel max |x| of each smoothing group's input, folded; then RTN."""

    name = "smoothquant"
    Options = SmoothQuantOptions
    flag_prefix = "sq"
    quantizes_fused_experts = True

    def check_layer(self, layer, name: str) -> None:
        check_smoothable(layer, name, self.name)

    def statistics(self) -> StatisticsRequest:
        return StatisticsRequest(channel_absmax=True)

    def transform_layer(self, layer) -> dict[str, float]:
        alpha = self.options.alpha

        def choose_parts(group, parts):  # an MoE group: max |x| over the union of the consumers' inputs
            absmax = torch.stack([st.absmax for p in parts for st, _ in p.inputs if st.tokens]).amax(0)
            return smoothquant_scales(absmax, [w for p in parts for _, ws in p.inputs for w in ws], alpha), alpha

        return smooth_layer(layer, self.name, lambda group, st, weights: (
            smoothquant_scales(st.absmax, weights, alpha), alpha), choose_parts)


__all__ = ["SQ_MAX", "SQ_MIN", "SmoothQuant", "SmoothQuantOptions", "smoothquant_scales"]
