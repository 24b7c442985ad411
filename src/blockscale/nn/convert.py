"""convert / unconvert: swap a model's nn.Linear layers for QuantizedLinear in place, and back.

Rules, in order, for each ``nn.Linear`` (by qualified module name):
1. a match of any ``recipe.exclude`` regular expression -> left as it is;
2. inside one of the last ``recipe.n_last_blocks(n)`` transformer blocks -> the
   ``recipe.last_blocks_recipe`` linear recipe;
3. otherwise -> ``recipe.linear``.
Transformer blocks are the children of the model's largest ``nn.ModuleList`` (``layers`` in Llama
models, ``h`` in GPT-2, ``layer`` in BERT). Parameters are shared, not copied, so optimizers and
``state_dict`` keys are unchanged.

MoE experts (``GroupedExperts``, stacked weights, not nn.Linear) follow the same rules by module
name and get the linear recipe in place (``experts.recipe``). transformers' fused experts modules
(3-D ``gate_up_proj`` / ``down_proj``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3) follow them
too and are replaced by a ``QuantizedFusedExperts`` holding the same Parameters (``nn.hf_experts``: one
recipe GEMM per expert and projection); gpt-oss' ``GptOssExperts`` (transposed, interleaved gate / up,
biases) by a ``QuantizedGptOssExperts`` (its four Parameters; the biases stay in high precision). A fused
layout neither supports is left as it is and listed in ``report.unsupported``. MoE routers are not
nn.Linear layers, so they always stay in high precision (the default ``exclude`` names them too).

"Experts only" (e.g. NVFP4 on the experts, everything else as it is): ``experts_only(recipe)``, i.e. the
recipe with ``exclude: ['^(?!(.*\\.)?experts$)']`` (every module whose name is not ``...experts``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..recipes import Recipe, get_recipe
from .hf_experts import QuantizedFusedExperts, convertible_experts_layout, fused_experts_to_convert, quantized_experts
from .linear import QuantizedLinear
from .moe import GroupedExperts

#: the ``exclude`` pattern of ``experts_only``: every module not named ``experts`` (or ``...experts``)
EXPERTS_ONLY_EXCLUDE = r"^(?!(.*\.)?experts$)"


@dataclass
class ConversionReport:
    """What ``convert`` did: module name -> recipe name, plus the excluded linear layers. ``experts``: the
    transformers fused-experts modules among ``converted``; ``unsupported``: fused-experts modules left as
    they are (name -> why)."""

    recipe: str
    converted: dict = field(default_factory=dict)
    excluded: list = field(default_factory=list)
    blocks: str | None = None
    n_blocks: int = 0
    n_last_blocks: int = 0
    experts: list = field(default_factory=list)
    unsupported: dict = field(default_factory=dict)

    def counts(self) -> dict:
        out: dict = {}
        for r in self.converted.values():
            out[r] = out.get(r, 0) + 1
        return out

    def __str__(self) -> str:
        per = ", ".join(f"{n} x {r}" for r, n in self.counts().items()) or "nothing"
        n_lin = len(self.converted) - len(self.experts)
        what = f"{n_lin} linear layers" + (f" and {len(self.experts)} fused experts modules" if self.experts else "")
        s = f"convert({self.recipe}): {what} converted ({per}); "
        s += f"{len(self.excluded)} kept as they are"
        if self.excluded:
            s += f" ({', '.join(self.excluded[:6])}{', ...' if len(self.excluded) > 6 else ''})"
        if self.unsupported:
            s += f"; fused experts left as they are: {', '.join(f'{n} ({w})' for n, w in self.unsupported.items())}"
        if self.blocks is not None:
            s += f"; {self.n_blocks} blocks in '{self.blocks}', last {self.n_last_blocks} in the high-precision recipe"
        return s


def find_blocks(model: nn.Module) -> tuple[str | None, int]:
    """Qualified name and length of the largest nn.ModuleList (the transformer blocks), or (None, 0)."""
    best, n = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > n:
            best, n = name, len(mod)
    return (best, n) if n >= 1 else (None, 0)


def _block_index(name: str, blocks: str | None) -> int | None:
    if blocks is None:
        return None
    prefix = f"{blocks}." if blocks else ""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def convert(model: nn.Module, recipe, generator=None, verbose: bool = False) -> ConversionReport:
    """Swap ``model``'s nn.Linear layers for QuantizedLinear (and transformers' fused experts for
    QuantizedFusedExperts / QuantizedGptOssExperts) per ``recipe`` (a Recipe, built-in name or YAML path),
    in place. Already converted layers get the new recipe. Returns a report."""
    recipe: Recipe = get_recipe(recipe)
    last = get_recipe(recipe.last_blocks_recipe) if recipe.last_blocks_recipe else None
    blocks, n_blocks = find_blocks(model)
    n_last = recipe.n_last_blocks(n_blocks) if last is not None else 0
    first_last = n_blocks - n_last
    report = ConversionReport(recipe=recipe.name, blocks=blocks, n_blocks=n_blocks, n_last_blocks=n_last)
    patterns = [re.compile(p) for p in recipe.exclude]
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, (nn.Linear, GroupedExperts, QuantizedFusedExperts)) or fused_experts_to_convert(mod)]
    for name, mod in targets:
        if any(p.search(name) for p in patterns):
            report.excluded.append(name)
            continue
        hf_experts = isinstance(mod, QuantizedFusedExperts) or fused_experts_to_convert(mod)
        why = convertible_experts_layout(mod) if fused_experts_to_convert(mod) else None
        if why is not None:
            report.unsupported[name] = why
            continue
        idx = _block_index(name, blocks)
        use = last if (last is not None and idx is not None and idx >= first_last) else recipe
        if isinstance(mod, (QuantizedLinear, GroupedExperts, QuantizedFusedExperts)):
            mod.recipe, mod.generator = use.linear, generator
        elif hf_experts:
            _set_child(model, name, quantized_experts(mod, use.linear, generator))
        else:
            _set_child(model, name, QuantizedLinear.from_linear(mod, use.linear, generator))
        if hf_experts:
            report.experts.append(name)
        report.converted[name] = use.name
    if verbose:
        print(report)
    return report


def unconvert(model: nn.Module) -> int:
    """Replace every QuantizedLinear in ``model`` by a plain nn.Linear (shared parameters), every
    QuantizedFusedExperts (QuantizedGptOssExperts too) by the transformers module it replaced (holding its
    Parameters), and clear the recipe of every quantized GroupedExperts; returns the count of modules changed."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, (QuantizedLinear,
                                                                                     QuantizedFusedExperts))]
    for name, mod in targets:
        _set_child(model, name, mod.to_linear() if isinstance(mod, QuantizedLinear) else mod.original())
    experts = [mod for mod in model.modules() if isinstance(mod, GroupedExperts) and mod.recipe is not None]
    for mod in experts:
        mod.recipe, mod.generator = None, None
    return len(targets) + len(experts)


def experts_only(recipe, name: str | None = None) -> Recipe:
    """``recipe`` (a Recipe, built-in name or YAML path) applied to the MoE experts modules only: its
    ``exclude`` becomes ``EXPERTS_ONLY_EXCLUDE`` (every module whose name is not ``experts`` or ends in
    ``.experts``: attention, dense MLPs, shared experts, routers, embeddings, head stay as they are).
    Named ``name`` (default ``"<recipe>-experts"``)."""
    r = get_recipe(recipe)
    return r.with_(name=name or f"{r.name}-experts", exclude=(EXPERTS_ONLY_EXCLUDE,))
