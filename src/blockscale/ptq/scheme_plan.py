"""Which scheme each Linear gets under a PTQ recipe: module classes, first-match rules, fused groups.

``module_classes`` reads a Linear's place in the model (its parents' class names and its path) as the
words a rule can match ("attention", "mlp", "experts", "shared_experts", "router"); ``assign_schemes``
applies the recipe's rules (first match wins, else the default) and refuses a split fused group
(q/k/v, gate/up, w1/w3 run as one GEMM in serving engines, so they need one scheme).
"""
from __future__ import annotations

import re

from torch import nn

from ..errors import QuantizationError
from ..nn.fused import fused_groups
from ..recipes.ptq_recipe import PTQRecipe, Scheme

_ATTENTION_PATH = (".self_attn.", ".attn.", ".attention.")
_MLP_PATH = (".mlp.", ".feed_forward.")
_ROUTER_LEAVES = ("gate", "router")
_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def _is_moe_block(module: nn.Module) -> bool:
    """A mixture-of-experts block: it holds an ``experts`` child, or its class name says MoE."""
    cls = type(module).__name__.lower()
    return hasattr(module, "experts") or "moe" in cls


def module_classes(model: nn.Module, name: str) -> frozenset[str]:
    """The module classes of the Linear ``name`` (its full module name in ``model``):

    "attention": a parent's class name contains "Attention", or the path has .self_attn. / .attn. / .attention.;
    "mlp": a parent's class name contains "MLP" / "FeedForward", or the path has .mlp. / .feed_forward.;
    "experts": the path has .experts.;  "shared_experts": the path has .shared_expert(s);
    "router": the leaf is "gate" / "router" directly under a mixture-of-experts block.
    A Linear can have several (an expert's Linear inside ``.mlp.`` is "mlp" and "experts").
    """
    path = f".{name}."
    parts = name.split(".")
    parents = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
    names = [type(m).__name__ for m in parents]
    out = set()
    if any("Attention" in n for n in names) or any(p in path for p in _ATTENTION_PATH):
        out.add("attention")
    if any("MLP" in n or "FeedForward" in n for n in names) or any(p in path for p in _MLP_PATH):
        out.add("mlp")
    if ".experts." in path:
        out.add("experts")
    if ".shared_expert" in path:
        out.add("shared_experts")
    if parts[-1] in _ROUTER_LEAVES and _is_moe_block(parents[-1]):
        out.add("router")
    return frozenset(out)


def _source(recipe: PTQRecipe, index) -> str:
    return "the default" if index is None else f"rule {index} match {recipe.rules[index].match!r}"


def assign_schemes(model: nn.Module, names: list[str], recipe: PTQRecipe, used=None) -> dict[str, Scheme]:
    """{Linear name: its scheme} for ``names`` (the Linears PTQ quantizes, already past ``recipe.ignore``):
    the first rule of ``recipe.rules`` that matches, else ``recipe.default``. A fused group
    (``nn.fused.fused_groups``) whose members get different schemes is a QuantizationError naming both
    modules, their schemes and the rules that chose them (rule indices count from 0). ``used``: a set
    the indices of the rules that chose some scheme are added to."""
    chosen = {n: recipe.rule_for(n, module_classes(model, n)) for n in names}
    if used is not None:
        used.update(i for i, _ in chosen.values() if i is not None)
    for group in fused_groups(list(names)):
        first = group[0]
        for other in group[1:]:
            (ia, sa), (ib, sb) = chosen[first], chosen[other]
            if sa != sb:
                raise QuantizationError(
                    f"{first} gets {sa.label} ({_source(recipe, ia)}) but its fused sibling {other} gets "
                    f"{sb.label} ({_source(recipe, ib)}): fused layers (q/k/v, gate/up, w1/w3) run as one GEMM "
                    "and need one scheme")
    return {n: s for n, (_, s) in chosen.items()}


def unused_rule_warnings(recipe: PTQRecipe, used) -> list[str]:
    """One line per rule of ``recipe`` that chose no module's scheme (not in ``used``): a misspelled
    match would otherwise leave its modules on the default scheme without a word."""
    return [f"recipe {recipe.name!r}: rule {i} (match {r.match!r} -> {r.scheme.label}) selects no module PTQ "
            "quantizes, so it has no effect (check the spelling; an earlier rule or the ignore list may take all it "
            "matches). A match is a module class (attention, mlp, experts, shared_experts, router), a glob or "
            "'re:<regex>' on full module names"
            for i, r in enumerate(recipe.rules) if i not in used]


def fold_names(names) -> list[str]:
    """Module names with their indices folded: ``model.layers.*.mlp.down_proj (5)``, first-appearance order."""
    counts: dict[str, int] = {}
    for n in names:
        key = _INDEX.sub(".*", n)
        counts[key] = counts.get(key, 0) + 1
    return [k + (f" ({c})" if c > 1 else "") for k, c in counts.items()]


def describe_assignment(assign: dict) -> list[str]:
    """One line per scheme (first-appearance order) of {Linear name: Scheme or its label}:
    ``"fp8-w8a8 (8 Linears): model.layers.*.self_attn.q_proj (2), ..."``."""
    by_label: dict[str, list[str]] = {}
    for name, scheme in assign.items():
        by_label.setdefault(scheme.label if isinstance(scheme, Scheme) else str(scheme), []).append(name)
    return [f"{label} ({len(ns)} Linear{'s' if len(ns) != 1 else ''}): {', '.join(fold_names(ns))}"
            for label, ns in by_label.items()]


__all__ = ["assign_schemes", "describe_assignment", "fold_names", "module_classes", "unused_rule_warnings"]
