"""Recipes as data: which quantizer each GEMM operand of a linear layer gets, plus model rules (training);
and PTQ recipes: which quantization scheme each Linear gets after training (``ptq_recipe``)."""
from .recipe import DEFAULT_EXCLUDE, OPERANDS, LinearRecipe, Recipe
from .registry import get_recipe, list_recipes
from .serialize import load_recipe_file, recipe_from_dict, recipe_to_dict, save_recipe
from .ptq_recipe import MODULE_CLASSES, SCHEME_NAMES, SCHEME_OPTIONS, KVCacheScheme, PTQRecipe, PTQRule, Scheme
from .ptq_serialize import load_ptq_recipe_file, ptq_recipe_from_dict, ptq_recipe_to_dict, save_ptq_recipe
from .ptq_builtin import get_ptq_recipe, list_ptq_recipes

__all__ = ["DEFAULT_EXCLUDE", "KVCacheScheme", "LinearRecipe", "MODULE_CLASSES", "OPERANDS", "PTQRecipe", "PTQRule",
           "Recipe", "SCHEME_NAMES", "SCHEME_OPTIONS", "Scheme", "get_ptq_recipe", "get_recipe", "list_ptq_recipes",
           "list_recipes", "load_ptq_recipe_file", "load_recipe_file", "ptq_recipe_from_dict", "ptq_recipe_to_dict",
           "recipe_from_dict", "recipe_to_dict", "save_ptq_recipe", "save_recipe"]
