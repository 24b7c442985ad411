"""What quantization on load accepts: the PTQ recipe a ``BlockscaleConfig`` names, and the refusal of anything
that needs calibration data (one line each, pointing to ``bs.quantize_model`` / ``blockscale quantize``).

A model loaded through ``from_pretrained`` is quantized weight by weight as its tensors arrive, with no
calibration pass, so only round-to-nearest (RTN) with the calibration-free scale rules can run there:
data-driven methods (``ptq.METHODS`` entries whose ``calibrates`` is set: GPTQ, AWQ, SmoothQuant, AutoRound),
Hessian-aware block scales, static (calibrated) activation scales (NVFP4 W4A4's activation outer scale, FP8
W8A8 static) and KV-cache scales are refused. Weights-only schemes and schemes with dynamic activation
scales (MXFP4 / MXFP8 W4A4 / W8A8, FP8 blocks, FP8 W8A8 per-token) are accepted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

from ..errors import UsageError
from ..ptq.methods import METHODS
from ..quant.nvfp4.weighted import WEIGHTED_RULES
from ..recipes import (SCHEME_NAMES, PTQRecipe, Scheme, get_ptq_recipe, list_ptq_recipes, list_recipes,
                       ptq_recipe_from_dict)

#: the calibration-free NVFP4 weight scale rules (``PTQConfig.WEIGHT_SCALE_RULES`` minus the Hessian-aware ones)
SCALE_RULES = ("6", "4over6", "sweep")
#: the 4/6 block errors (``NVFP4(error=...)``)
ERRORS = ("mse", "mae", "maxabs")
ELSEWHERE = "use bs.quantize_model (PTQConfig) or `blockscale quantize`, which calibrate, instead"


def _allowed_recipes() -> str:
    names = list(dict.fromkeys([*list_ptq_recipes(), *SCHEME_NAMES]))
    return ", ".join(map(repr, names)) + ", a bs.PTQRecipe, a bs.Scheme or a PTQ recipe YAML file"


def base_recipe(recipe: Union[str, Path, PTQRecipe, Scheme, dict]) -> PTQRecipe:
    """The PTQ recipe ``recipe`` names: a built-in PTQ recipe name (``bs.list_ptq_recipes``), a scheme name
    (every Linear gets it: ``PTQRecipe.single``), a ``PTQRecipe``, a ``Scheme``, a recipe dict (its
    ``ptq_recipe_to_dict`` form) or a YAML file; a UsageError naming ``recipe`` and the allowed values otherwise."""
    if isinstance(recipe, PTQRecipe):
        return recipe
    if isinstance(recipe, Scheme):
        return PTQRecipe.single(recipe)
    if isinstance(recipe, dict):
        return ptq_recipe_from_dict(recipe, "recipe")
    if not isinstance(recipe, (str, Path)):
        raise UsageError(f"recipe={recipe!r} is not supported; allowed values: {_allowed_recipes()}")
    name = str(recipe)
    if name in list_ptq_recipes():
        return get_ptq_recipe(name)
    if name in SCHEME_NAMES:
        return PTQRecipe.single(Scheme(name))
    if name in list_recipes():
        raise UsageError(f"recipe={name!r} is a training recipe (bs.convert), not a PTQ recipe; allowed values: "
                         f"{_allowed_recipes()}")
    if Path(name).expanduser().is_file():
        return get_ptq_recipe(Path(name).expanduser())
    raise UsageError(f"recipe={name!r} is not supported; allowed values: {_allowed_recipes()}")


def check_method(method) -> None:
    """UsageError unless ``method`` is "rtn": a calibrating method is refused pointing elsewhere."""
    if method == "rtn":
        return
    if isinstance(method, str) and method in METHODS and METHODS[method].calibrates:
        raise UsageError(f"method={method!r} needs calibration data, which quantization on load does not have: "
                         f"{ELSEWHERE}")
    raise UsageError(f"method={method!r} is not supported; allowed values: 'rtn' (calibrated methods: {ELSEWHERE})")


def check_choice(name: str, value, allowed) -> None:
    """UsageError naming the argument and its allowed values (None: the recipe's own, always allowed)."""
    if value is not None and value not in allowed:
        raise UsageError(f"{name}={value!r} is not supported; allowed values: None (the recipe's own), "
                         + ", ".join(map(repr, allowed)))


def check_scale_rule(scale_rule) -> None:
    """UsageError for a scale rule quantization on load cannot use: the Hessian-aware ones calibrate."""
    if scale_rule in WEIGHTED_RULES:
        raise UsageError(f"scale_rule={scale_rule!r} weights block errors by calibration statistics, which "
                         f"quantization on load does not have: {ELSEWHERE}")
    check_choice("scale_rule", scale_rule, SCALE_RULES)


def check_calibration_free(recipe: PTQRecipe) -> None:
    """UsageError naming the first part of ``recipe`` that needs calibration (static activation scales,
    Hessian-aware block scales, a quantized KV cache)."""
    if recipe.kv_cache is not None:
        raise UsageError(f"recipe {recipe.name!r} quantizes the KV cache ({recipe.kv_cache.label}) with calibrated "
                         f"scales, which quantization on load does not have: {ELSEWHERE}")
    for scheme in recipe.schemes():
        if scheme.hessian_scales:
            raise UsageError(f"recipe {recipe.name!r}: scheme {scheme.label} chooses block scales from calibration "
                             f"statistics, which quantization on load does not have: {ELSEWHERE}")
        if scheme.static_activations:
            raise UsageError(f"recipe {recipe.name!r}: scheme {scheme.label} has static (calibrated) activation "
                             f"scales, which quantization on load does not have: {ELSEWHERE}; without calibration "
                             "use weights-only or dynamic-activation schemes (e.g. recipe='nvfp4', 'mxfp4' for "
                             "W4A4, Scheme('fp8-w8a8', activations='dynamic'))")


__all__ = ["ELSEWHERE", "ERRORS", "SCALE_RULES", "base_recipe", "check_calibration_free", "check_choice",
           "check_method", "check_scale_rule"]
