"""Built-in recipes (YAML files in ``builtin/``) and lookup by name or path."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .recipe import Recipe
from .serialize import load_recipe_file

BUILTIN_DIR = Path(__file__).with_name("builtin")


def list_recipes() -> list[str]:
    """Names of the built-in recipes."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


@lru_cache(maxsize=None)
def _builtin(name: str) -> Recipe:
    recipe = load_recipe_file(BUILTIN_DIR / f"{name}.yaml")
    if recipe.name != name:
        raise ValueError(f"built-in recipe file {name}.yaml names itself {recipe.name!r}")
    return recipe


def get_recipe(recipe) -> Recipe:
    """A Recipe from a Recipe, a built-in name (see ``list_recipes``) or a YAML file path."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, (str, Path)):
        raise TypeError(f"recipe must be a Recipe, a built-in name or a YAML path, got {type(recipe).__name__}")
    if str(recipe) in list_recipes():
        return _builtin(str(recipe))
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return load_recipe_file(p)
    raise ValueError(f"recipe {str(recipe)!r} is neither a built-in recipe ({', '.join(list_recipes())}) "
                     "nor an existing .yaml file")
