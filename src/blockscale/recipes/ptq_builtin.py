"""The built-in PTQ recipes and lookup by name or YAML path (``get_ptq_recipe`` / ``list_ptq_recipes``)."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .ptq_recipe import KVCacheScheme, PTQRecipe, PTQRule, Scheme
from .ptq_serialize import load_ptq_recipe_file

BUILTIN_PTQ_RECIPES: dict[str, PTQRecipe] = {r.name: r for r in (
    PTQRecipe(
        name="nvfp4",
        description="NVFP4 W4A16 on every decoder Linear (E2M1 weights, one E4M3 scale per 16 and an FP32 outer "
                    "scale; activations stay in the model dtype): what `blockscale quantize` does without --recipe.",
        default=Scheme("nvfp4-w4a16")),
    PTQRecipe(
        name="nvfp4-experts-fp8-attention",
        description="The scale-learning write-up's mixed recipe (ModelOpt's nvfp4 + fp8 attention + fp8 kv): FP8 "
                    "W8A8 on the attention projections (E4M3 weights with one scale per tensor, static calibrated "
                    "per-tensor E4M3 inputs), NVFP4 W4A4 on the MLP / expert Linears, FP8 E4M3 KV cache with one "
                    "calibrated K and V scale per layer; embeddings, lm_head and routers stay in high precision.",
        default=Scheme("nvfp4-w4a4"),
        rules=(PTQRule("attention", Scheme("fp8-w8a8", weights="tensor", activations="static")),),
        kv_cache=KVCacheScheme("fp8-e4m3", per_head=False)),
    PTQRecipe(
        name="fp8",
        description="FP8 W8A8 on every decoder Linear: E4M3 weights with one scale per tensor, E4M3 inputs with "
                    "one static calibrated scale per tensor (compressed-tensors' FP8 preset).",
        default=Scheme("fp8-w8a8")),
    PTQRecipe(
        name="mxfp4-w4a16",
        description="MXFP4 weights on every decoder Linear (E2M1, one UE8M0 scale per 32, rounded up), "
                    "activations in the model dtype (compressed-tensors' MXFP4A16 preset).",
        default=Scheme("mxfp4-w4a16")),
)}


def list_ptq_recipes() -> list[str]:
    """Names of the built-in PTQ recipes."""
    return sorted(BUILTIN_PTQ_RECIPES)


def get_ptq_recipe(recipe) -> PTQRecipe:
    """A PTQRecipe from a PTQRecipe, a built-in name (see ``list_ptq_recipes``) or a YAML file path."""
    if isinstance(recipe, PTQRecipe):
        return recipe
    if not isinstance(recipe, (str, Path)):
        raise UsageError(f"PTQ recipe must be a PTQRecipe, a built-in name or a YAML path, got "
                         f"{type(recipe).__name__}")
    if str(recipe) in BUILTIN_PTQ_RECIPES:
        return BUILTIN_PTQ_RECIPES[str(recipe)]
    p = Path(recipe).expanduser()
    if p.exists():
        return load_ptq_recipe_file(p)
    raise UsageError(f"PTQ recipe {str(recipe)!r} is neither a built-in PTQ recipe ({', '.join(list_ptq_recipes())}) "
                     "nor an existing YAML file")


__all__ = ["BUILTIN_PTQ_RECIPES", "get_ptq_recipe", "list_ptq_recipes"]
