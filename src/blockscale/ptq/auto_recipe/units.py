"""The units of an automatic recipe: the groups of weights PTQ must give one scheme.

A unit is, inside the decoder layers (``ptq.capture.decoder_layers``) and outside the ignore list (regexes on
full module names, ``re.search``; ``recipes.recipe.DEFAULT_EXCLUDE`` by default: embeddings, lm_head, routers):

    "linear"          one nn.Linear, or a fused sibling group (q/k/v, gate/up, w1/w3, MLA q_a / kv_a:
                      ``nn.fused.fused_groups``), which serving engines run as one GEMM;
    "experts"         a fused 3-D experts module (transformers >= 5 Mixtral / Qwen-MoE / OLMoE / DeepSeek-V3 /
                      gpt-oss: ``nn.experts_layouts.experts_layout_of``): all its experts;
    "expert-linears"  the per-expert Linears ``<m>.experts.{e}.<leaf>`` of the older MoE layout: all experts
                      of ``<m>.experts`` together.

PTQ finds the same modules (``ptq.preflight.plan_quantization``). Each unit carries the PTQ rule ``match``
that selects exactly its modules (``re:^...$`` on full names) and the (count, out, in) of the Linears a
checkpoint stores for it, from which ``costs`` counts stored bits. ``why_not`` says whether a scheme fits a
unit's sizes as PTQ requires (in_features in whole blocks: 16 NVFP4, 32 MX; fused experts: hidden and
intermediate sizes in whole blocks, and gate / up rows on whole 128-row FP8 tiles).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from torch import nn

from ...errors import QuantizationError, UsageError
from ...nn.experts_layout import has_fused_expert_parameters
from ...nn.experts_layouts import experts_layout_of
from ...nn.fused import fused_groups
from ...quant import format_of
from ...recipes.recipe import DEFAULT_EXCLUDE
from ..capture import decoder_layers

UNIT_KINDS = ("linear", "experts", "expert-linears")
_EXPERT_LINEAR = re.compile(r"(.*\.experts)\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Unit:
    """One unit (see the module docstring). ``name``: a label for tables (``parent.{q_proj,k_proj,v_proj}``,
    ``parent.experts (4 experts)``); ``members``: the full module names PTQ quantizes for it (the Linears, or the
    fused-experts module); ``match``: the PTQ rule match selecting exactly them; ``matrices``: (count, out, in)
    of the Linears a checkpoint stores; ``experts``: the number of experts (0 for "linear");
    ``interleaved``: gpt-oss gate / up rows (one Linear per expert)."""

    name: str
    kind: str
    members: tuple[str, ...]
    match: str
    matrices: tuple[tuple[int, int, int], ...]
    experts: int = 0
    interleaved: bool = False

    @property
    def params(self) -> int:
        """Weight elements of the unit (every expert's)."""
        return sum(c * n * k for c, n, k in self.matrices)


def _ignored(name: str, ignore) -> bool:
    return any(re.search(p, name) for p in ignore)


def _alternatives(leaves) -> str:
    return "(" + "|".join(re.escape(leaf) for leaf in leaves) + ")"


def _linear_unit(group: list[str], linears: dict[str, nn.Linear]) -> Unit:
    mats = tuple((1, linears[n].out_features, linears[n].in_features) for n in group)
    if len(group) == 1:
        return Unit(group[0], "linear", tuple(group), f"re:^{re.escape(group[0])}$", mats)
    parent = group[0].rpartition(".")[0]
    leaves = [n.rpartition(".")[2] for n in group]
    return Unit(f"{parent}.{{{','.join(leaves)}}}", "linear", tuple(group),
                f"re:^{re.escape(parent)}\\.{_alternatives(leaves)}$", mats)


def _expert_linears_unit(parent: str, names: list[str], linears: dict[str, nn.Linear]) -> Unit:
    leaves = list(dict.fromkeys(_EXPERT_LINEAR.fullmatch(n).group(3) for n in names))
    experts = len({_EXPERT_LINEAR.fullmatch(n).group(2) for n in names})
    mats = tuple((1, linears[n].out_features, linears[n].in_features) for n in names)
    return Unit(f"{parent}.*.{{{','.join(leaves)}}} ({experts} experts)", "expert-linears", tuple(names),
                f"re:^{re.escape(parent)}\\.\\d+\\.{_alternatives(leaves)}$", mats, experts)


def _experts_unit(name: str, module: nn.Module) -> Unit:
    layout = experts_layout_of(module)
    why = layout.why_not(module)
    if why is not None:
        raise QuantizationError(f"{name}: {type(module).__name__} holds fused 3-D expert parameters in a layout PTQ "
                                f"does not know ({why}); keep it in high precision with ignore=[...]")
    E, H, I = layout.dims(module)
    gate_up = ((E, 2 * I, H),) if layout.interleaved else ((2 * E, I, H),)  # gate and up: two Linears per expert
    return Unit(f"{name} ({E} experts)", "experts", (name,), f"re:^{re.escape(name)}$", gate_up + ((E, H, I),), E,
                layout.interleaved)


def find_units(model: nn.Module, ignore=DEFAULT_EXCLUDE) -> list[Unit]:
    """The units of ``model`` in module order (see the module docstring). A fused group only partly ignored is a
    UsageError naming it (PTQ would refuse it); a fused-experts module of an unknown layout a QuantizationError."""
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    units: list[Unit] = []
    for i, layer in enumerate(layers):
        lprefix = f"{prefix}.{i}"
        modules = [(f"{lprefix}.{n}", m) for n, m in layer.named_modules()]
        linears = {n: m for n, m in modules if isinstance(m, nn.Linear)}
        kept = [n for n in linears if not _ignored(n, ignore)]
        for group in fused_groups(list(linears)):
            part = [n for n in group if n in kept]
            if part and len(part) != len(group):
                raise UsageError(f"ignore={list(ignore)!r} keeps {[n for n in group if n not in kept]} in high precision "
                                 f"but not their fused siblings {part}: a fused group runs as one GEMM and takes one "
                                 "scheme; ignore all of it or none")
        by_parent: dict[str, list[str]] = {}
        plain = []
        for n in kept:
            m = _EXPERT_LINEAR.fullmatch(n)
            if m:
                by_parent.setdefault(m.group(1), []).append(n)
            else:
                plain.append(n)
        first: dict[str, Unit] = {}  # first member -> its unit (emitted in module order)
        for group in fused_groups(plain):
            first[group[0]] = _linear_unit(group, linears)
        for parent, names in by_parent.items():
            first[names[0]] = _expert_linears_unit(parent, names, linears)
        for n, m in modules:
            if has_fused_expert_parameters(m) and not _ignored(n, ignore):
                first[n] = _experts_unit(n, m)
            if n in first:
                units.append(first[n])
    return units


def why_not(unit: Unit, scheme) -> Optional[str]:
    """Why ``scheme`` (a ``recipes.Scheme``) cannot quantize ``unit``, or None when it can (as PTQ checks)."""
    if scheme.is_high_precision:
        return None
    block = scheme.block_size
    bad = sorted({k for _, _, k in unit.matrices if block and k % block})
    if bad:
        what = "hidden / intermediate size" if unit.kind == "experts" else "in_features"
        return f"{what} {', '.join(map(str, bad))} not a multiple of {block}, which {scheme.noun} needs"
    if unit.kind == "experts" and not unit.interleaved:
        spec = scheme.weight_spec
        g = format_of(spec).scale_rows(spec)
        rows = unit.matrices[0][1]  # the intermediate size: gate and up are split on a scale-row boundary
        if g > 1 and rows % g:
            return f"intermediate size {rows} not a multiple of {g}, which {scheme.name} experts need"
    return None


__all__ = ["UNIT_KINDS", "Unit", "find_units", "why_not"]
