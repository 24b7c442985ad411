"""blockscale training recipes in torchtitan (0.3): a model converter, the extension point torchtitan's
float8 / MXFP8 / NVFP4 training uses (``torchtitan.components.quantization``).

torchtitan 0.3 converters rewrite the model CONFIG tree before the model is built on the meta device
(``ModelConfigConverter.convert(model_config) -> model_config``; ``model_registry(flavor,
converters=[...])`` applies them), and every built submodule must satisfy torchtitan's ``Module``
protocol (``verify_module_protocol``), so ``bs.convert`` on a built model is not an option there. This
converter swaps, by the blockscale recipe's rules on torchtitan's module names:

- ``Linear.Config``          -> ``BlockscaleLinear.Config``: a torchtitan ``Linear`` whose forward is
  ``quantized_linear(x, weight, bias, recipe)`` (the same function as ``bs.nn.QuantizedLinear``);
- ``GroupedExperts.Config``  -> a ``Blockscale<cls>`` subclass of the experts class: one recipe GEMM per
  expert and projection on that expert's FP32 weight slice (per-expert NVFP4 outer scales), as
  ``bs.nn.moe.GroupedExperts`` computes it, instead of torchtitan's bf16 ``_grouped_mm``.

Rules (those of ``bs.convert``): a Linear whose torchtitan FQN matches ``recipe.exclude`` (``re.search``;
the default names embeddings, ``lm_head``, routers / ``gate``) or contains one of ``filter_fqns`` (the
float8 converter's rule) stays; blocks ``layers.{i}`` with ``i`` among the last
``recipe.n_last_blocks(len(layers))`` take ``recipe.last_blocks_recipe``; ``experts_only`` converts the
routed experts only. Parameters keep their names and shapes (``w1_EFD`` ..., ``weight``), so torchtitan
checkpoints, FSDP and the optimizer see the same state. Nothing is cached between steps (operands are
quantized from the master weights at every forward), so ``post_optimizer_hook`` has nothing to do.

Command line (``model_spec`` is not a CLI field in torchtitan 0.3, so the converter comes with a config
function; the recipe from ``BLOCKSCALE_RECIPE``, a built-in name or a YAML path)::

    BLOCKSCALE_RECIPE=nvfp4-nvidia torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module blockscale.train.torchtitan --config llama3_debugmodel_blockscale
    BLOCKSCALE_RECIPE=nvfp4-nvidia BLOCKSCALE_EXPERTS_ONLY=1 torchrun ... --config qwen3_debugmodel_moe_blockscale

or in a config_registry function of one's own::

    config.model_spec = model_registry("8B", converters=[blockscale_converter_config("nvfp4-nvidia")])

torchtitan itself is imported lazily: this module imports without it, and ``torchtitan_available()``
says whether it can be used.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..nn.linear import quantized_linear
from ..recipes import LinearRecipe, Recipe, get_recipe

CONVERTER_NAME = "blockscale"
RECIPE_ENV, EXPERTS_ONLY_ENV = "BLOCKSCALE_RECIPE", "BLOCKSCALE_EXPERTS_ONLY"


def torchtitan_available() -> bool:
    return importlib.util.find_spec("torchtitan") is not None


def _block_index(fqn: str) -> Optional[int]:
    m = re.match(r"layers\.(\d+)\.", fqn)
    return int(m.group(1)) if m else None


def conversion_plan(linears, experts, n_blocks: int, recipe, experts_only: bool = False,
                    filter_fqns=()) -> dict[str, Recipe]:
    """FQN -> the Recipe whose linear recipe it gets, for torchtitan FQNs of Linear modules (``linears``)
    and routed-experts modules (``experts``) in a model of ``n_blocks`` blocks ``layers.{i}``; modules not
    in the result stay as they are. The rules of ``bs.convert`` (see the module docstring)."""
    recipe = get_recipe(recipe)
    last = get_recipe(recipe.last_blocks_recipe) if recipe.last_blocks_recipe else None
    first_last = n_blocks - (recipe.n_last_blocks(n_blocks) if last is not None else 0)
    patterns = [re.compile(p) for p in recipe.exclude]
    plan = {}
    for fqn in list(() if experts_only else linears) + list(experts):
        if any(s in fqn for s in filter_fqns):
            continue
        if fqn not in experts and any(p.search(fqn) for p in patterns):
            continue  # (routed experts: named ``...inner_experts``; only linears follow ``exclude``)
        i = _block_index(fqn)
        plan[fqn] = last if (last is not None and i is not None and i >= first_last) else recipe
    return plan


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3, recipe: LinearRecipe,
                   generator=None) -> torch.Tensor:
    """torchtitan's routed-experts math, one recipe GEMM per expert: rows of ``x`` [R, D] grouped by expert
    (``counts[e]`` rows for expert e, in order; rows past ``sum(counts)``, a dispatcher's padding, give
    zeros), w1 / w3 [E, F, D], w2 [E, D, F]: ``w2[e](silu(w1[e] x) * w3[e] x)``. The same ops as
    ``bs.nn.moe.GroupedExperts`` with ``recipe`` (bit for bit)."""
    sizes = counts.tolist()
    w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
    outs, start = [], 0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        xe = x[start:start + n]
        start += n
        h = F.silu(quantized_linear(xe, w1s[e], None, recipe, generator)) * \
            quantized_linear(xe, w3s[e], None, recipe, generator)
        outs.append(quantized_linear(h, w2s[e], None, recipe, generator))
    tail = x.shape[0] - start
    if not outs or tail:  # keep the weights in the graph (zero gradients, never None)
        tie = (w1.sum() + w2.sum() + w3.sum()) * 0.0
        outs.append(x.new_zeros((tail, w2.shape[1]), dtype=outs[0].dtype if outs else x.dtype) + tie)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class _RecipeFromConfig:
    """Base of the converted torchtitan modules (before the torchtitan class): keeps the config's
    ``recipe`` and ``recipe_name``; ``generator`` None (stochastic rounding draws from the global RNG)."""

    def __init__(self, config):
        super().__init__(config)
        self.recipe, self.recipe_name, self.generator = config.recipe, config.recipe_name, None


def _linear_class(Linear: type) -> type:
    """BlockscaleLinear: a subclass of torchtitan's ``Linear`` whose forward is the config's recipe."""

    class BlockscaleLinear(_RecipeFromConfig, Linear):
        """A torchtitan Linear computing ``quantized_linear(x, weight, bias, recipe)``."""

        @dataclass(kw_only=True, slots=True)
        class Config(Linear.Config):
            recipe: LinearRecipe = field(default_factory=LinearRecipe)
            recipe_name: str = ""

        def forward(self, x):
            bias = None if self.bias is None else _local(self.bias)
            return quantized_linear(x, _local(self.weight), bias, self.recipe, self.generator)

        def extra_repr(self) -> str:
            return f"{super().extra_repr()}, recipe={self.recipe_name}"

    return BlockscaleLinear


@functools.cache
def _experts_class(parent_cls: type) -> type:
    """A subclass of the experts class ``parent_cls`` (GroupedExperts or a subclass) whose forward is
    ``grouped_swiglu`` with the config's recipe (one class per ``parent_cls``)."""

    class BlockscaleExperts(_RecipeFromConfig, parent_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(parent_cls.Config):
            recipe: LinearRecipe = field(default_factory=LinearRecipe)
            recipe_name: str = ""

        def forward(self, x_RD, num_tokens_per_expert_E):
            out = grouped_swiglu(x_RD, num_tokens_per_expert_E, _local(self.w1_EFD), _local(self.w2_EDF),
                                 _local(self.w3_EFD), self.recipe, self.generator)
            return out.type_as(x_RD)

    BlockscaleExperts.__name__ = BlockscaleExperts.__qualname__ = f"Blockscale{parent_cls.__name__}"
    return BlockscaleExperts


def _converted_config(cfg, use: Recipe, is_experts: bool, linear_cls: type):
    """The config replacing ``cfg`` (a routed-experts or a Linear config) for the recipe ``use``."""
    if is_experts:
        return _experts_class(type(cfg)._owner).Config(
            **{f.name: getattr(cfg, f.name) for f in fields(cfg)}, recipe=use.linear, recipe_name=use.name)
    return linear_cls.Config(in_features=cfg.in_features, out_features=cfg.out_features, bias=cfg.bias,
                             param_init=cfg.param_init, sharding_config=cfg.sharding_config, recipe=use.linear,
                             recipe_name=use.name)


def _converter_class(QuantizationConverter: type, Linear: type, GroupedExperts: type, linear_cls: type) -> type:
    """BlockscaleConverter: a torchtitan ``QuantizationConverter`` swapping the configs of ``Linear`` and
    ``GroupedExperts`` by ``conversion_plan``."""

    class BlockscaleConverter(QuantizationConverter):
        """torchtitan model converter applying a blockscale training recipe (see the module docstring)."""

        @dataclass(kw_only=True, slots=True)
        class Config(QuantizationConverter.Config):
            recipe: str = "nvfp4-nvidia"
            """A built-in blockscale training recipe (bf16, mxfp8, nvfp4-nvidia, ...) or a recipe YAML path."""
            experts_only: bool = False
            """Convert the routed experts only (attention, dense and shared MLPs, head stay as they are)."""
            filter_fqns: list[str] = field(default_factory=list)
            """Modules whose FQN contains one of these stay as they are."""

        def __init__(self, config):
            self.config = config
            try:
                self.recipe = get_recipe(config.recipe)
            except (ValueError, TypeError, OSError) as exc:
                raise UsageError(f"BlockscaleConverter.Config.recipe {config.recipe!r}: {exc}") from None
            self.report: dict[str, str] = {}

        def convert(self, model_config):
            linears = {fqn: (c, p, a) for fqn, c, p, a in model_config.traverse(Linear.Config)}
            experts = {fqn: (c, p, a) for fqn, c, p, a in model_config.traverse(GroupedExperts.Config)}
            n_blocks = len(getattr(model_config, "layers", ()) or ())
            plan = conversion_plan(linears, experts, n_blocks, self.recipe, self.config.experts_only,
                                   self.config.filter_fqns)
            for fqn, use in plan.items():
                cfg, parent, attr = linears.get(fqn) or experts[fqn]
                new = _converted_config(cfg, use, fqn in experts, linear_cls)
                if parent is None:
                    model_config = new
                elif isinstance(parent, list):
                    parent[attr] = new
                else:
                    setattr(parent, attr, new)
                self.report[fqn] = use.name
            return model_config

        def post_optimizer_hook(self, model) -> None:
            """Nothing to refresh after an optimizer step: operands are quantized from the master weights
            at every forward (unlike float8's FSDP amax precompute)."""

    return BlockscaleConverter


@functools.cache
def torchtitan_classes():
    """(BlockscaleConverter, BlockscaleLinear, blockscale_experts_class) built on torchtitan's classes;
    ImportError without torchtitan."""
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts

    linear_cls = _linear_class(Linear)
    return _converter_class(QuantizationConverter, Linear, GroupedExperts, linear_cls), linear_cls, _experts_class


def blockscale_converter_config(recipe: str = "nvfp4-nvidia", experts_only: bool = False, filter_fqns=(),
                                model_compile_enabled: bool = False):
    """A ``BlockscaleConverter.Config`` for ``model_registry(..., converters=[...])``."""
    converter = torchtitan_classes()[0]
    return converter.Config(recipe=str(recipe), experts_only=bool(experts_only), filter_fqns=list(filter_fqns),
                            model_compile_enabled=model_compile_enabled)


def _from_env():
    return blockscale_converter_config(os.environ.get(RECIPE_ENV, "nvfp4-nvidia"),
                                       os.environ.get(EXPERTS_ONLY_ENV, "0") not in ("", "0", "false", "False"))


def llama3_debugmodel_blockscale():
    """torchtitan's ``llama3_debugmodel`` Trainer.Config with the blockscale converter (``BLOCKSCALE_RECIPE``)."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=[_from_env()])
    return config


def qwen3_debugmodel_moe_blockscale():
    """torchtitan's Qwen3 MoE debug model (``qwen3_moe_debug``'s Trainer.Config) with the blockscale
    converter (``BLOCKSCALE_RECIPE``, ``BLOCKSCALE_EXPERTS_ONLY``)."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    config.model_spec = model_registry("debugmodel_moe", converters=[_from_env()])
    return config


__all__ = ["CONVERTER_NAME", "blockscale_converter_config", "conversion_plan", "grouped_swiglu",
           "llama3_debugmodel_blockscale", "qwen3_debugmodel_moe_blockscale", "torchtitan_available",
           "torchtitan_classes"]
