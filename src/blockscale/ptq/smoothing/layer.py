"""Smoothing one decoder layer: for each of its smoothing groups, scales from a method, folded in place.

AWQ and SmoothQuant differ only in how a group's scales are chosen (``choose(group, stats, weights)``
-> ``(s, alpha)``); the loop, the skipping of groups with an excluded consumer or no calibration
tokens, the error naming and the overflow check after folding are this module's.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...errors import QuantizationError
from ..finite import non_finite_error
from .fold import fold_smoothing
from .groups import SmoothingGroup, find_smoothing_groups


def check_folded(modules, method: str) -> None:
    """W * s can overflow a half-precision weight: QuantizationError naming the module if it did."""
    for name, m in modules:
        for pname, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise non_finite_error(name, pname, p, f" after method={method!r} smoothing")


@torch.no_grad()
def smooth_layer(layer, method: str, choose: Callable) -> dict[str, float]:
    """Fold per-group scales into ``layer`` (a ``LayerContext``) in place. ``choose(group, stats,
    weights)`` gives ``(s [K], alpha)`` for a ``SmoothingGroup`` from the statistics of its first
    consumer. Returns the consumers' full names -> alpha."""
    linear_names = {id(m): n for n, m in layer.linears.items()}
    alphas = {}
    for group in find_smoothing_groups(layer.module):
        names = [linear_names.get(id(m)) for m in group.linears]
        if any(n is None for n in names):
            continue  # a consumer is excluded from quantization: leave this group alone
        st = layer.stats[names[0]]
        if st.tokens == 0:
            continue
        weights = [m.weight for m in group.linears]
        try:
            s, alpha = choose(group, st, weights)
            fold_smoothing(group, s)
        except QuantizationError:
            raise
        except ValueError as err:
            raise QuantizationError(f"{', '.join(names)}: method={method!r} smoothing failed: {err}") from err
        layer_prefix = names[0][: len(names[0]) - len(group.linear_names[0])]
        check_folded([*zip(names, group.linears), (layer_prefix + group.prev_name, group.prev)], method)
        for n in names:
            alphas[n] = alpha
    return alphas


def check_smoothable(layer, name: str, method: str) -> None:
    """QuantizationError naming the layer when ``find_smoothing_groups`` does not understand it."""
    try:
        find_smoothing_groups(layer)
    except (NotImplementedError, ValueError) as err:
        raise QuantizationError(f"{name}: method={method!r} cannot smooth this layer: {err}; "
                                "use method='rtn' or 'gptq'") from err


__all__ = ["SmoothingGroup", "check_folded", "check_smoothable", "smooth_layer"]
