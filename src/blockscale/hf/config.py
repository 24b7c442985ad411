"""BlockscaleConfig: the ``quantization_config`` that makes transformers' ``from_pretrained`` quantize a model
with blockscale's PTQ recipes as it loads it (``quantizer.BlockscaleHfQuantizer``; registered under the
quant method ``"blockscale"`` by ``registration``).

    model = AutoModelForCausalLM.from_pretrained(name_or_dir, quantization_config=bs.BlockscaleConfig(
        recipe="nvfp4", scale_rule="4over6"))

The result is what ``bs.quantize_model(model, config.ptq_config)`` gives on the same full-precision model, bit
for bit (RTN; no calibration).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import UsageError
from ..ptq import PTQConfig
from ..recipes import SCHEME_NAMES, PTQRecipe, Scheme, list_ptq_recipes, ptq_recipe_to_dict
from ..recipes.ptq_recipe import check_regexes
from .load_recipe import ERRORS, base_recipe, check_calibration_free, check_choice, check_method, check_scale_rule

QUANT_METHOD = "blockscale"
OPTIONS = ("recipe", "scale_rule", "error", "ignore", "method", "expert_outer_scale", "skip_indivisible",
           "allow_partial")


class BlockscaleConfig(QuantizationConfigMixin):
    """Quantize a model while ``from_pretrained`` loads it, with a blockscale PTQ recipe and no calibration.

    recipe: a built-in PTQ recipe name (``bs.list_ptq_recipes()``: "nvfp4" = NVFP4 W4A16, "mxfp4-w4a16", ...),
      a scheme name (every Linear gets it: "mxfp4" = MXFP4 W4A4 with dynamic activation scales, "mxfp8",
      "fp8-block", "nvfp4-w4a16", ...), a ``bs.PTQRecipe``, a ``bs.Scheme`` (e.g. ``bs.Scheme("fp8-w8a8",
      activations="dynamic")``) or a PTQ recipe YAML file.
    scale_rule: NVFP4 weight block scales, set on every NVFP4 scheme of the recipe: "6", "4over6" or "sweep"
      (None: the recipe's own).
    error: the block error of "4over6": "mse", "mae" or "maxabs" (None: the recipe's own).
    ignore: regular expressions (``re.search`` on module names) of Linears kept in high precision, added to the
      recipe's ignore list (which keeps embeddings, lm_head and MoE routers by default).
    method: "rtn" (round to nearest) only: calibrated methods (GPTQ, AWQ, SmoothQuant, AutoRound), Hessian-aware
      scale rules, static activation scales (NVFP4 W4A4, FP8 W8A8 static) and KV-cache scales need calibration
      data and are refused (one line: use ``bs.quantize_model`` / ``blockscale quantize``).
    expert_outer_scale, skip_indivisible, allow_partial: as ``bs.PTQConfig``.

    Every value is checked here (a ``UsageError`` naming the argument and the allowed values). ``ptq_config``:
    the ``bs.PTQConfig`` whose ``bs.quantize_model`` the loaded model equals bit for bit. ``to_dict`` is JSON:
    a recipe that is not a built-in or scheme name is written as its ``ptq_recipe_to_dict`` form.
    """

    def __init__(self, recipe: Union[str, Path, PTQRecipe, Scheme, dict] = "nvfp4", scale_rule: Optional[str] = None,
                 error: Optional[str] = None, ignore: Optional[list] = None, method: str = "rtn",
                 expert_outer_scale: str = "expert", skip_indivisible: bool = False, allow_partial: bool = False,
                 **kwargs):
        quant_method = kwargs.pop("quant_method", QUANT_METHOD)
        if quant_method != QUANT_METHOD:
            raise UsageError(f"quant_method={quant_method!r}: a BlockscaleConfig is quant_method {QUANT_METHOD!r}")
        if kwargs:
            raise UsageError(f"BlockscaleConfig: unknown argument(s) {sorted(kwargs)}; allowed: {', '.join(OPTIONS)}")
        self.quant_method = QUANT_METHOD
        self.recipe = recipe
        self.scale_rule = scale_rule
        self.error = error
        self.ignore = list(ignore) if isinstance(ignore, tuple) else ignore
        self.method = method
        self.expert_outer_scale = expert_outer_scale
        self.skip_indivisible = skip_indivisible
        self.allow_partial = allow_partial
        self.post_init()

    def post_init(self) -> None:
        """Check every option (the ``ptq_config`` they make)."""
        _ = self.ptq_config

    @property
    def ptq_recipe(self) -> PTQRecipe:
        """The effective PTQ recipe: ``recipe`` with ``scale_rule`` / ``error`` set on its NVFP4 schemes and
        ``ignore`` added to its ignore list; a UsageError for anything that needs calibration."""
        check_method(self.method)
        check_scale_rule(self.scale_rule)
        check_choice("error", self.error, ERRORS)
        recipe = base_recipe(self.recipe)
        for name in ("scale_rule", "error"):
            value = getattr(self, name)
            if value is not None:
                try:
                    recipe = recipe.with_nvfp4(**{name: value})
                except UsageError as exc:
                    raise UsageError(f"{name}={value!r}: {exc}") from None
        if self.ignore is not None:
            extra = tuple(p for p in check_regexes(self.ignore, "ignore") if p not in recipe.ignore)
            recipe = recipe.replace(ignore=recipe.ignore + extra) if extra else recipe
        check_calibration_free(recipe)
        return recipe

    @property
    def ptq_config(self) -> PTQConfig:
        """The ``bs.PTQConfig`` (method RTN, ``ptq_recipe``) that quantization on load applies."""
        return PTQConfig(method="rtn", recipe=self.ptq_recipe, expert_outer_scale=self.expert_outer_scale,
                         skip_indivisible=self.skip_indivisible, allow_partial=self.allow_partial)

    def _recipe_value(self):
        """``recipe`` as JSON: a built-in or scheme name as it is, anything else as its recipe dict."""
        if isinstance(self.recipe, str) and (self.recipe in list_ptq_recipes() or self.recipe in SCHEME_NAMES):
            return self.recipe
        return ptq_recipe_to_dict(base_recipe(self.recipe))

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "recipe": self._recipe_value(), "scale_rule": self.scale_rule,
                "error": self.error, "ignore": None if self.ignore is None else list(self.ignore),
                "method": self.method, "expert_outer_scale": self.expert_outer_scale,
                "skip_indivisible": self.skip_indivisible, "allow_partial": self.allow_partial}

    def __iter__(self):
        yield from self.to_dict().items()


__all__ = ["BlockscaleConfig", "OPTIONS", "QUANT_METHOD"]
