"""Recipes <-> plain dicts <-> YAML (``yaml.safe_load`` only: no object construction from text)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ..quant.specs import MX, NVFP4, S2F6
from .recipe import OPERANDS, LinearRecipe, Recipe

_SPEC_TYPES = {"nvfp4": NVFP4, "mx": MX, "s2f6": S2F6}
_SPEC_NAMES = {v: k for k, v in _SPEC_TYPES.items()}


def spec_to_dict(spec) -> dict | None:
    if spec is None:
        return None
    d = {"format": _SPEC_NAMES[type(spec)]}
    d.update({f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
    return d


def spec_from_dict(d, where: str = "spec"):
    if d is None:
        return None
    if not isinstance(d, dict) or "format" not in d:
        raise ValueError(f"{where}: expected a mapping with a 'format' key ({', '.join(_SPEC_TYPES)}) or null, got {d!r}")
    d = dict(d)
    fmt = d.pop("format")
    if fmt not in _SPEC_TYPES:
        raise ValueError(f"{where}: format={fmt!r}; allowed values: {', '.join(map(repr, _SPEC_TYPES))}")
    cls = _SPEC_TYPES[fmt]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{where}: unknown {fmt} option(s) {sorted(unknown)}; allowed: {sorted(names)}")
    return cls(**d)


def recipe_to_dict(recipe: Recipe) -> dict:
    lin = {f.name: getattr(recipe.linear, f.name) for f in dataclasses.fields(LinearRecipe)}
    for name in OPERANDS:
        lin[name] = spec_to_dict(lin[name])
    return {
        "name": recipe.name,
        "description": recipe.description,
        "linear": lin,
        "exclude": list(recipe.exclude),
        "last_blocks_fraction": recipe.last_blocks_fraction,
        "last_blocks_recipe": recipe.last_blocks_recipe,
    }


def recipe_from_dict(d: dict, where: str = "recipe") -> Recipe:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
    allowed = {f.name for f in dataclasses.fields(Recipe)}
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "name" not in d:
        raise ValueError(f"{where}: missing 'name'")
    lin = dict(d.get("linear") or {})
    lin_allowed = {f.name for f in dataclasses.fields(LinearRecipe)}
    unknown = set(lin) - lin_allowed
    if unknown:
        raise ValueError(f"{where}.linear: unknown key(s) {sorted(unknown)}; allowed: {sorted(lin_allowed)}")
    for name in OPERANDS:
        if name in lin:
            lin[name] = spec_from_dict(lin[name], f"{where}.linear.{name}")
    kw = {k: v for k, v in d.items() if k != "linear"}
    if "exclude" in kw:
        kw["exclude"] = tuple(kw["exclude"])
    return Recipe(linear=LinearRecipe(**lin), **kw)


def save_recipe(recipe: Recipe, path) -> None:
    """Write ``recipe`` as YAML."""
    Path(path).write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))


def load_recipe_file(path) -> Recipe:
    """Read a recipe YAML file (safe loader; unknown keys and bad values raise ValueError)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{p}: not valid YAML: {exc}") from exc
    return recipe_from_dict(data, where=str(p))
