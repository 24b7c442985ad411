"""PTQ recipes <-> plain dicts <-> YAML (``yaml.safe_load`` only). Unknown keys at any level, and bad
values, are a UsageError naming the key (or field) and what is allowed.

    name: nvfp4-experts-fp8-attention
    description: ...
    default: nvfp4-w4a4                 # or {name: nvfp4-w4a4, scale_rule: sweep}
    rules:
      - {match: attention, scheme: fp8-w8a8}
    ignore: ['embed', '(^|\\.)(lm_head|output|classifier)$', 'router', '(^|\\.)gate$']
    kv_cache: {format: fp8-e4m3, per_head: false}
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ..errors import UsageError
from .ptq_recipe import KVCacheScheme, PTQRecipe, PTQRule, Scheme
from .serialize import MAX_RECIPE_BYTES, read_recipe_yaml
from ..file_errors import write_text_atomic

RECIPE_KEYS = tuple(f.name for f in dataclasses.fields(PTQRecipe))
RULE_KEYS = ("match", "scheme")
KV_CACHE_KEYS = tuple(f.name for f in dataclasses.fields(KVCacheScheme))


def scheme_value(scheme: Scheme):
    """A scheme's YAML form: its name alone when every option is the default, else its mapping."""
    return scheme.name if scheme == Scheme(scheme.name) else scheme.to_dict()


def ptq_recipe_to_dict(recipe: PTQRecipe) -> dict:
    kv = recipe.kv_cache
    return {
        "name": recipe.name,
        "description": recipe.description,
        "default": scheme_value(recipe.default),
        "rules": [{"match": r.match, "scheme": scheme_value(r.scheme)} for r in recipe.rules],
        "ignore": list(recipe.ignore),
        "kv_cache": None if kv is None else {"format": kv.format, "per_head": kv.per_head},
    }


def _unknown(d: dict, allowed, where: str) -> None:
    unknown = sorted(str(k) for k in d if str(k) not in allowed)
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {unknown}; allowed: {list(allowed)}")


def _rule(d, where: str) -> PTQRule:
    if not isinstance(d, dict):
        raise UsageError(f"{where}: expected a mapping {{match: ..., scheme: ...}}, got {d!r}")
    _unknown(d, RULE_KEYS, where)
    for key in RULE_KEYS:
        if key not in d:
            raise UsageError(f"{where}: missing {key!r}")
    match = d["match"]
    if not isinstance(match, str):
        raise UsageError(f"{where}.match={match!r}: expected a string (a module class, 're:<regex>' or a glob)")
    try:
        return PTQRule(match, Scheme.from_value(d["scheme"], f"{where}.scheme"))
    except UsageError as exc:
        msg = str(exc)
        raise UsageError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _kv_cache(d, where: str):
    if d is None:
        return None
    if isinstance(d, str):
        d = {"format": d}
    if not isinstance(d, dict):
        raise UsageError(f"{where}: expected a mapping {{format: fp8-e4m3, per_head: false}} or null, got {d!r}")
    _unknown(d, KV_CACHE_KEYS, where)
    try:
        return KVCacheScheme(**{str(k): v for k, v in d.items()})
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None


def ptq_recipe_from_dict(d, where: str = "PTQ recipe") -> PTQRecipe:
    """Inverse of ``ptq_recipe_to_dict``; keys left out take the PTQRecipe defaults."""
    if not isinstance(d, dict):
        raise UsageError(f"{where}: expected a mapping, got {type(d).__name__}")
    _unknown(d, RECIPE_KEYS, where)
    kw = {str(k): v for k, v in d.items()}
    for key in ("name", "description"):
        if key in kw and not isinstance(kw[key], str):
            raise UsageError(f"{where}: {key}={kw[key]!r}; expected a string")
    if "default" in kw:
        kw["default"] = Scheme.from_value(kw["default"], f"{where}: default")
    if "rules" in kw:
        rules = kw["rules"] if kw["rules"] is not None else []
        if not isinstance(rules, list):
            raise UsageError(f"{where}: rules: expected a list of {{match: ..., scheme: ...}}, got {rules!r}")
        kw["rules"] = tuple(_rule(r, f"{where}: rules[{i}]") for i, r in enumerate(rules))
    if "ignore" in kw:
        ignore = kw["ignore"] if kw["ignore"] is not None else []
        if isinstance(ignore, str) or not isinstance(ignore, list):
            raise UsageError(f"{where}: ignore={ignore!r}: expected a list of regular expressions (strings)")
        kw["ignore"] = tuple(ignore)
    if "kv_cache" in kw:
        kw["kv_cache"] = _kv_cache(kw["kv_cache"], f"{where}: kv_cache")
    try:
        return PTQRecipe(**kw)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None


def save_ptq_recipe(recipe: PTQRecipe, path) -> None:
    """Write ``recipe`` as YAML."""
    write_text_atomic(path, yaml.safe_dump(ptq_recipe_to_dict(recipe), sort_keys=False))


def load_ptq_recipe_file(path) -> PTQRecipe:
    """Read a PTQ recipe YAML file (safe loader). Not a regular file, over ``MAX_RECIPE_BYTES``, not
    UTF-8, not YAML, nested too deeply, unknown keys or bad values: a UsageError naming the file."""
    p = Path(path)
    if not p.is_file():
        what = "a directory" if p.is_dir() else ("not a regular file" if p.exists() else "no such file")
        raise UsageError(f"{p}: {what}; a PTQ recipe is a YAML file")
    try:
        data = read_recipe_yaml(p, UsageError)
    except OSError as exc:
        raise UsageError(f"{p}: cannot read ({exc.strerror or exc})") from None
    try:
        return ptq_recipe_from_dict(data, where=str(p))
    except RecursionError:
        raise UsageError(f"{p}: nested too deeply to be a recipe") from None


__all__ = ["KV_CACHE_KEYS", "MAX_RECIPE_BYTES", "RECIPE_KEYS", "RULE_KEYS", "load_ptq_recipe_file",
           "ptq_recipe_from_dict", "ptq_recipe_to_dict", "save_ptq_recipe", "scheme_value"]
