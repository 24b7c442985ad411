"""Recipes as data: which quantizer each GEMM operand of a linear layer gets, plus model rules."""
from .recipe import DEFAULT_EXCLUDE, OPERANDS, LinearRecipe, Recipe
from .registry import get_recipe, list_recipes
from .serialize import load_recipe_file, recipe_from_dict, recipe_to_dict, save_recipe

__all__ = ["DEFAULT_EXCLUDE", "OPERANDS", "LinearRecipe", "Recipe", "get_recipe", "list_recipes",
           "load_recipe_file", "recipe_from_dict", "recipe_to_dict", "save_recipe"]
