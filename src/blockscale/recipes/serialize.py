"""Recipes <-> plain dicts <-> YAML (``yaml.safe_load`` only: no object construction from text)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ..quant import format_named, format_of, formats
from .recipe import OPERANDS, LinearRecipe, Recipe
from ..file_errors import write_text_atomic

MAX_RECIPE_BYTES = 1 << 20


def _is_tuple_field(f: dataclasses.Field) -> bool:
    """A spec field holding a tuple (YAML writes it as a list): a tuple default or a tuple annotation."""
    ann = str(f.type).replace("typing.", "").lower()
    return isinstance(f.default, tuple) or ann.startswith(("tuple", "optional[tuple"))


def _to_plain(v):
    """Tuples (at any depth) as lists, for YAML."""
    return [_to_plain(x) for x in v] if isinstance(v, tuple) else v


def _to_tuple(v):
    """Lists (at any depth) as tuples: the inverse of ``_to_plain`` for tuple-valued fields."""
    return tuple(_to_tuple(x) for x in v) if isinstance(v, list) else v


def spec_to_dict(spec) -> dict | None:
    """{"format": its registered name, field: value, ...} (tuples as lists); None for None."""
    if spec is None:
        return None
    d = {"format": format_of(spec).name}
    d.update({f.name: _to_plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)})
    return d


def spec_from_dict(d, where: str = "spec"):
    """Inverse of ``spec_to_dict``: ValueError naming ``where`` and the allowed formats / options."""
    if d is None:
        return None
    names = [f.name for f in formats()]
    if not isinstance(d, dict) or "format" not in d:
        raise ValueError(f"{where}: expected a mapping with a 'format' key ({', '.join(names)}) or null, got {d!r}")
    d = dict(d)
    fmt = d.pop("format")
    if not isinstance(fmt, str) or fmt not in names:
        raise ValueError(f"{where}: format={fmt!r}; allowed values: {', '.join(map(repr, names))}")
    cls = format_named(fmt).spec_type
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(map(str, d)) - set(fields)
    if unknown:
        raise ValueError(f"{where}: unknown {fmt} option(s) {sorted(unknown)}; allowed: {sorted(fields)}")
    for k, v in d.items():
        if _is_tuple_field(fields[k]):
            d[k] = _to_tuple(v)
    return _build(cls, d, where)


def _build(cls, kwargs: dict, where: str):
    """``cls(**kwargs)``, a bad value reported as ValueError naming ``where``."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_types(d: dict, where: str) -> None:
    """The plain fields of a recipe mapping have the types a Recipe holds."""
    name = d.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name={name!r}; expected a non-empty string")
    if not isinstance(d.get("description", ""), str):
        raise ValueError(f"{where}: description={d['description']!r}; expected a string")
    last = d.get("last_blocks_recipe")
    if last is not None and not isinstance(last, str):
        raise ValueError(f"{where}: last_blocks_recipe={last!r}; expected a built-in recipe name or null")
    frac = d.get("last_blocks_fraction", 0.0)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)):
        raise ValueError(f"{where}: last_blocks_fraction={frac!r}; expected a number in [0, 1]")
    exclude = d.get("exclude", [])
    if isinstance(exclude, str) or not isinstance(exclude, (list, tuple)) or \
            not all(isinstance(p, str) for p in exclude):
        raise ValueError(f"{where}: exclude={exclude!r}; expected a list of regular expressions (strings)")
    lin = d.get("linear")
    if lin is not None and not isinstance(lin, dict):
        raise ValueError(f"{where}.linear: expected a mapping, got {type(lin).__name__}")


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
    unknown = set(map(str, d)) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "name" not in d:
        raise ValueError(f"{where}: missing 'name'")
    _check_types(d, where)
    lin = dict(d.get("linear") or {})
    lin_allowed = {f.name for f in dataclasses.fields(LinearRecipe)}
    unknown = set(map(str, lin)) - lin_allowed
    if unknown:
        raise ValueError(f"{where}.linear: unknown key(s) {sorted(unknown)}; allowed: {sorted(lin_allowed)}")
    for name in OPERANDS:
        if name in lin:
            lin[name] = spec_from_dict(lin[name], f"{where}.linear.{name}")
    kw = {k: v for k, v in d.items() if k != "linear"}
    if "exclude" in kw:
        kw["exclude"] = tuple(kw["exclude"])
    return _build(Recipe, {"linear": _build(LinearRecipe, lin, f"{where}.linear"), **kw}, where)


def save_recipe(recipe: Recipe, path) -> None:
    """Write ``recipe`` as YAML."""
    write_text_atomic(path, yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))


def load_recipe_file(path) -> Recipe:
    """Read a recipe YAML file (safe loader; unknown keys, bad values, files over ``MAX_RECIPE_BYTES``,
    nesting too deep to parse and text that is not UTF-8 raise ValueError naming the file)."""
    p = Path(path)
    data = read_recipe_yaml(p)
    try:
        return recipe_from_dict(data, where=str(p))
    except RecursionError:
        raise ValueError(f"{p}: nested too deeply to be a recipe") from None


def read_recipe_yaml(p: Path, error: type = ValueError):
    """The YAML value in the recipe file ``p`` (``yaml.safe_load``): files over ``MAX_RECIPE_BYTES``, text
    that is not UTF-8, nesting too deep to parse and invalid YAML raise ``error`` naming the file.
    Shared by the training and the PTQ recipe loaders."""
    size = p.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise error(f"{p}: {size:,} bytes; a recipe file is at most {MAX_RECIPE_BYTES:,}")
    try:
        return yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise error(f"{p}: nested too deeply to be a recipe (the YAML parser's recursion limit)") from None
    except yaml.YAMLError as exc:
        raise error(f"{p}: not valid YAML: {' '.join(str(exc).split())}") from None
