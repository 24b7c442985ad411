"""Smoothing one decoder layer: for each of its smoothing groups, scales from a method, folded in place.

AWQ and SmoothQuant differ only in how a group's scales are chosen (``choose(group, stats, weights)``
-> ``(s, alpha)``); the loop, the skipping of groups with an excluded consumer or no calibration
tokens, the error naming and the overflow check after folding are this module's. MoE layers
(``smoothing.moe``) add groups whose consumers are routers, experts' slices of fused parameters and
Linears with different inputs: their scales come from ``choose_parts(group, parts)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...errors import QuantizationError
from ...nn.fused import fused_groups
from ...nn.gpt_oss_experts_layout import is_gpt_oss_experts
from ..finite import non_finite_error
from ..statistics import InputStatistics
from .fold import fold_smoothing
from .groups import SmoothingGroup
from ...nn.input_rotation import input_rotation
from .families import layer_smoothing_groups
from .moe import MoESmoothingGroup, fold_moe_smoothing, gpt_oss_expert_output
from .slices import WeightSlice


def check_folded(modules, method: str) -> None:
    """W * s can overflow a half-precision weight: QuantizationError naming the module if it did."""
    for name, m in modules:
        for pname, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise non_finite_error(name, pname, p, f" after method={method!r} smoothing")


@dataclass(frozen=True)
class GroupPart:
    """Quantized consumers of one ``MoESmoothingGroup`` that share one weight scale (a fused group of
    Linears, one expert's gate/up rows, all experts' with ``expert_outer_scale="tensor"``): ``inputs``
    holds, per distinct input, its statistics and the weights [N_i, K] reading it (views); ``scheme``
    their ``recipes.Scheme`` (None: the flat NVFP4 context). names: their full names. post: per input, None
    (the error is measured on the GEMM outputs) or a function of the GEMM outputs [T, N] giving what the
    error is measured on (gpt-oss experts: ``gpt_oss_expert_output``); None for all inputs."""

    names: tuple[str, ...]
    inputs: tuple[tuple[InputStatistics, tuple[torch.Tensor, ...]], ...]
    scheme: Optional[object] = None
    post: Optional[tuple[Optional[Callable], ...]] = None


def _smooth_linears(layer, method, choose, group, linear_names, alphas) -> None:
    names = [linear_names.get(id(m)) for m in group.linears]
    if any(n is None for n in names):
        return  # a consumer is excluded from quantization: leave this group alone
    st = layer.stats[names[0]]
    if st.tokens == 0:
        return
    weights = [m.weight for m in group.linears]
    try:
        s, alpha = choose(group, st, weights)
        fold_smoothing(group, s)
    except QuantizationError:
        raise
    except ValueError as err:
        raise QuantizationError(f"{', '.join(names)}: method={method!r} smoothing failed: {err}") from err
    layer_prefix = names[0][: len(names[0]) - len(group.linear_names[0])]
    check_folded([*zip(names, group.linears), (layer_prefix + group.prev_name, group.prev_module)], method)
    for n in names:
        alphas[n] = alpha


def moe_group_parts(layer, group: MoESmoothingGroup) -> list[GroupPart]:
    """The quantized consumers of ``group`` in ``layer`` (a ``LayerContext``) as ``GroupPart``s: Linears
    of ``layer.linears`` (fused siblings in one part, one input), fused experts of ``layer.experts``
    (statistics from ``layer.expert_stats``; one part per expert, or one for all experts with
    ``layer.expert_outer_scale == "tensor"`` in the post-attention-norm group). Routers, excluded
    Linears and excluded experts are not in any part (they are rescaled all the same)."""
    lin = {id(m): n for n, m in layer.linears.items()}
    exp = {id(m): n for n, m in getattr(layer, "experts", {}).items()}
    schemes = layer.schemes or {}
    linears, experts = {}, {}
    for c in group.consumers:
        w = c.weight
        if w.expert is None:
            full = lin.get(id(w.module))
            if full is not None:
                linears[full] = w.tensor()
        elif id(w.module) in exp:
            full = exp[id(w.module)]
            est = getattr(layer, "expert_stats", {}).get(full)
            if est is not None:  # gpt-oss (read transposed): its error after the clamped GLU and down
                post = gpt_oss_expert_output(w.module, w.expert) if is_gpt_oss_experts(w.module) else None
                experts.setdefault(full, []).append((est.stats[w.proj][w.expert], w.tensor(), post))
    parts = [GroupPart(tuple(g), ((layer.stats[g[0]], tuple(linears[n] for n in g)),), schemes.get(g[0]))
             for g in fused_groups(list(linears))]
    tensor = getattr(layer, "expert_outer_scale", "expert") == "tensor" and not isinstance(group.prev, WeightSlice)
    for full, entries in experts.items():
        posts = [p for _, _, p in entries]
        if tensor:
            parts.append(GroupPart((full,), tuple((st, (w,)) for st, w, _ in entries), schemes.get(full),
                                   tuple(posts) if any(posts) else None))
        else:
            parts += [GroupPart((full,), ((st, (w,)),), schemes.get(full), None if p is None else (p,))
                      for st, w, p in entries]
    return parts


def _smooth_moe(layer, method, choose_parts, group, prefix, alphas) -> None:
    parts = [p for p in moe_group_parts(layer, group) if any(st.tokens for st, _ in p.inputs)]
    if not parts:
        return  # nothing quantized reads this input, or no calibration token reached it
    names = sorted({n for p in parts for n in p.names})
    try:
        s, alpha = choose_parts(group, parts)
        fold_moe_smoothing(group, s)
    except QuantizationError:
        raise
    except ValueError as err:
        raise QuantizationError(f"{', '.join(names)}: method={method!r} smoothing failed: {err}") from err
    mods = [(prefix + c.name, c.weight.module) for c in group.consumers]
    prev = group.prev.module if isinstance(group.prev, WeightSlice) else group.prev
    check_folded([*mods, (prefix + group.prev_name, prev)], method)
    for n in names:
        alphas.setdefault(n, alpha)


def _layer_prefix(layer) -> str:
    rel = {id(m): n for n, m in layer.module.named_modules()}
    for full, m in [*layer.linears.items(), *getattr(layer, "experts", {}).items()]:
        if id(m) in rel:
            return full[: len(full) - len(rel[id(m)])]
    return ""


def _consumer_modules(group) -> list:
    """The modules reading a group's input (an MoE group's: routers, fused experts, the shared expert's Linears)."""
    if isinstance(group, MoESmoothingGroup):
        return [c.weight.module for c in group.consumers]
    return list(group.linears)


@torch.no_grad()
def smooth_layer(layer, method: str, choose: Callable, choose_parts: Optional[Callable] = None) -> dict[str, float]:
    """Fold per-group scales into ``layer`` (a ``LayerContext``) in place. ``choose(group, stats,
    weights)`` gives ``(s [K], alpha)`` for a ``SmoothingGroup`` from the statistics of its first
    consumer; ``choose_parts(group, parts)`` for a ``MoESmoothingGroup`` of an MoE layer from its
    ``GroupPart``s (``moe_group_parts``). Returns the consumers' full names (a fused-experts module's
    name for its experts) -> alpha. What stays unsmoothed in a supported layer (MLA's o_proj) is noted
    in ``layer.notes`` when the context has that list."""
    groups, notes = layer_smoothing_groups(layer.module)
    rotated = [g for g in groups if any(input_rotation(m) is not None for m in _consumer_modules(g))]
    if rotated:  # x Q then W Q: a per-channel scale folded before Q cannot be undone on W Q's columns
        notes = list(notes) + [f"{g.name}: not smoothed (its Linears' inputs are rotated online)" for g in rotated]
        groups = [g for g in groups if not any(g is r for r in rotated)]
    if notes and isinstance(getattr(layer, "notes", None), list):
        layer.notes.extend(notes)
    linear_names = {id(m): n for n, m in layer.linears.items()}
    prefix = _layer_prefix(layer) if any(isinstance(g, MoESmoothingGroup) for g in groups) else ""
    alphas = {}
    for group in groups:
        if isinstance(group, MoESmoothingGroup):
            if choose_parts is None:
                raise QuantizationError(f"{prefix}{group.name}: method={method!r} cannot smooth MoE groups")
            _smooth_moe(layer, method, choose_parts, group, prefix, alphas)
        else:
            _smooth_linears(layer, method, choose, group, linear_names, alphas)
    return alphas


def check_smoothable(layer, name: str, method: str) -> None:
    """QuantizationError naming the layer when no smoothing family (``families``) understands it."""
    try:
        layer_smoothing_groups(layer)
    except (NotImplementedError, ValueError) as err:
        raise QuantizationError(f"{name}: method={method!r} cannot smooth this layer: {err}; "
                                "use method='rtn' or 'gptq'") from err


__all__ = ["GroupPart", "SmoothingGroup", "check_folded", "check_smoothable", "moe_group_parts", "smooth_layer"]
