"""Folding smoothing scales into a group in place, and the argument checks the scale functions share.

``fold_smoothing(group, s)``: the consumers' weight columns times s, the producer's output divided by s.
Fold a group before searching the next group that shares modules with it (e.g. ``v_proj`` is both a
consumer of the q/k/v group and the ``prev`` of the o_proj group; either order is exact, but each
search must see the current weights).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .groups import FLOAT_DTYPES, SmoothingGroup, check_norm_absorbs_scales
from .slices import WeightSlice, _set_, divide_rows


def check_scales(s, K: int, what: str = "s") -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(s).__name__}")
    if s.dim() != 1 or s.numel() != K:
        raise ValueError(f"{what} has shape {tuple(s.shape)}, expected ({K},): one scale per input channel")
    if s.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} has dtype {s.dtype}; expected a floating tensor")
    s = s.detach().float()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"{what} must be finite and > 0 (got min {float(s.min())!r}, max {float(s.max())!r})")
    return s


def divide_norm(norm: nn.Module, s: torch.Tensor, offset: float = 0.0) -> None:
    """A norm's per-channel weight (and bias) divided by ``s`` in FP32, stored back in their dtype: its
    output divided by s (``check_norm_absorbs_scales(norm, offset)`` says it may). With ``offset`` c (a
    ``f(x) * (c + weight)`` norm, Gemma's c = 1): weight' = (c + weight) / s - c, so c + weight' is
    (c + weight) / s up to the rounding of weight' in its dtype (see ``fold_smoothing``)."""
    sd = s.to(norm.weight.device)
    if offset == 0:
        _set_(norm.weight, norm.weight.float() / sd)
    else:
        _set_(norm.weight, (norm.weight.float() + offset) / sd - offset)
    bias = getattr(norm, "bias", None)
    if isinstance(bias, torch.Tensor):
        _set_(bias, bias.float() / sd)


def fold_smoothing(group: SmoothingGroup, s: torch.Tensor) -> None:
    """Fold per-input-channel scales ``s`` [K] into ``group`` in place: the consumers' weight columns
    are multiplied by s (``W[:, j] *= s[j]``) and the producer's output divided by s (a norm's weight
    and bias per channel, ``group.norm_offset`` c: (c + weight) / s - c; a prev linear's output rows and
    bias; a ``WeightSlice`` prev: those rows and their bias entries). Computed in FP32, then cast back to
    each parameter's dtype, so the full-precision function is unchanged up to that rounding: 2^-24
    relative per weight in FP32 for W * s, weight / s and rows / s. For c != 0 the stored weight' =
    (c + w) / s - c carries an absolute rounding error of u |weight'| (u: 2^-24 FP32, 2^-8 BF16), so the
    norm's effective gain g' = (c + w) / s is off by u |g' - c| / |g'| relatively: ~u while g' is of the
    order of c, but up to u c / |g'| where s shrinks g' far below c (BF16, g' = 0.01: ~40%).
    """
    if not isinstance(group, SmoothingGroup):
        raise TypeError(f"group must be a SmoothingGroup, got {type(group).__name__}")
    K = group.in_features
    s = check_scales(s, K)
    prev = group.prev
    if not isinstance(prev, (nn.Linear, WeightSlice)):
        check_norm_absorbs_scales(prev, group.norm_offset)  # before touching anything
    with torch.no_grad():
        if isinstance(prev, WeightSlice):
            divide_rows(prev, s)
        elif isinstance(prev, nn.Linear):
            sd = s.to(prev.weight.device)
            _set_(prev.weight, prev.weight.float() / sd[:, None])
            if prev.bias is not None:
                _set_(prev.bias, prev.bias.float() / sd)
        else:
            divide_norm(prev, s, group.norm_offset)
        for lin in group.linears:
            sd = s.to(lin.weight.device)
            _set_(lin.weight, lin.weight.float() * sd)



def check_weights(weights, K: Optional[int], fn: str) -> list:
    if isinstance(weights, (torch.Tensor, nn.Linear)):
        weights = [weights]
    try:
        weights = list(weights)
    except TypeError:
        raise TypeError(f"{fn}: weights must be a sequence of [N_i, K] tensors, got {type(weights).__name__}") from None
    if not weights:
        raise ValueError(f"{fn}: weights is empty; pass the weights of the group's linears")
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, nn.Linear):
            w = w.weight
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{fn}: weights[{i}] is a {type(w).__name__}, expected a tensor")
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: weights[{i}] has dtype {w.dtype}; expected a floating tensor")
        if w.dim() != 2:
            raise ValueError(f"{fn}: weights[{i}] has shape {tuple(w.shape)}; expected [N_i, K] (nn.Linear layout)")
        if K is None:
            K = w.shape[1]
        if w.shape[1] != K:
            raise ValueError(f"{fn}: weights[{i}] has shape {tuple(w.shape)}, expected K={K} input channels "
                             "(weights are [out_features, in_features])")
        if w.numel() and not bool(torch.isfinite(w).all()):
            raise ValueError(f"{fn}: weights[{i}] contains NaN/inf")
        out.append(w.detach())
    return out


def check_alpha(alpha, fn: str) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 <= float(alpha) <= 1.0):
        raise ValueError(f"{fn}: alpha={alpha!r} must be a number in [0, 1]")
    return float(alpha)



__all__ = ["check_alpha", "check_scales", "check_weights", "divide_norm", "fold_smoothing"]
