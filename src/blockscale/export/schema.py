"""Field checks for the JSON a checkpoint carries (config.json, hf_quant_config.json): a malformed
field is one ``ConfigError`` naming the key and what was expected; the loader prefixes the file.

Also the checks of config.json's model part that must hold before transformers sees it: sizes are
integers within sane bounds, every ``*_eps`` is a finite number > 0, no number is NaN / Infinity
(Python's json accepts both), and ``dtype`` is a model dtype.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterator, Optional

import torch

from ..quant.mx import MX_SCALE_RULES
from ..quant.nvfp4 import INPUT_SCALE_RULES, NVFP4_ERRORS
from .writer import DIGEST_ALGO, DIGEST_MARKER


class ConfigError(ValueError):
    """A malformed checkpoint config field; ``file`` (if set) names the JSON file it is in."""

    def __init__(self, message: str, file: Optional[str] = None):
        super().__init__(message)
        self.file = file


def kind(v: Any) -> str:
    """A JSON value's type in words: "null", "a boolean", "an integer", "a number", "a string", ..."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "a JSON object"
    return type(v).__name__


def short(v: Any, limit: int = 80) -> str:
    """``repr(v)``, cut to ``limit`` characters (values come from untrusted files)."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def obj(v: Any, key: str, *, optional: bool = False, file: Optional[str] = None) -> dict:
    """``v`` if it is a JSON object; ``{}`` for null / absent when ``optional``."""
    if v is None and optional:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{key} must be a JSON object{' or null' if optional else ''}, got {kind(v)}", file)
    return v


def string(v: Any, key: str, *, allowed: Optional[tuple] = None, file: Optional[str] = None) -> Optional[str]:
    """``v`` if it is null or a string (one of ``allowed`` when given)."""
    if v is None:
        return None
    if allowed is not None and v not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, allowed))}, got {short(v)}", file)
    if not isinstance(v, str):
        raise ConfigError(f"{key} must be a string, got {kind(v)}", file)
    return v


def str_list(v: Any, key: str, *, file: Optional[str] = None) -> list[str]:
    """``v`` if it is a list of strings; ``[]`` for null / absent."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise ConfigError(f"{key} must be a list of strings, got {kind(v)}", file)
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise ConfigError(f"{key}[{i}] must be a string, got {kind(s)}", file)
    return v


def regexes(patterns: list[str], key: str, indices: list[int], *, file: Optional[str] = None) -> list[re.Pattern]:
    out = []
    for i, p in zip(indices, patterns):
        try:
            out.append(re.compile(p))
        except (re.error, RecursionError, OverflowError) as e:
            raise ConfigError(f"{key}[{i}]={short('re:' + p)} is not a valid regular expression ({e})", file) from None
    return out


# ---- config.json: the model part --------------------------------------------------------------------
# integer size fields (transformers' names and common aliases) and the largest value accepted: far
# above any released model, small enough that nothing is built before the tensors are checked
SIZE_LIMITS = {
    "vocab_size": 2**24, "hidden_size": 2**18, "n_embd": 2**18, "d_model": 2**18, "intermediate_size": 2**20,
    "n_inner": 2**20, "moe_intermediate_size": 2**20, "shared_expert_intermediate_size": 2**20,
    "num_hidden_layers": 2**12, "n_layer": 2**12, "num_layers": 2**12, "num_attention_heads": 2**14,
    "n_head": 2**14, "num_key_value_heads": 2**14, "head_dim": 2**14, "max_position_embeddings": 2**31,
    "n_positions": 2**31, "num_local_experts": 2**14, "num_experts": 2**14, "n_routed_experts": 2**14,
    "num_experts_per_tok": 2**14,
}
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
MODEL_DTYPES = ("float32", "float16", "bfloat16", "float64")
_EPS = re.compile(r"(^|_)eps$|epsilon$")


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every value inside ``value`` (iterative: nesting depth is untrusted)."""
    stack = [(path, value)]
    while stack:
        p, v = stack.pop()
        yield p, v
        if isinstance(v, dict):
            stack.extend((f"{p}.{k}" if p else str(k), x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((f"{p}[{i}]", x) for i, x in reversed(list(enumerate(v))))


def _leaf(path: str) -> str:
    return re.split(r"[.\[]", path)[-1]


def check_model_config(cfg: dict) -> None:
    """config.json's fields outside ``quantization_config``: numbers finite, sizes within bounds, every
    ``*_eps`` finite and > 0, ``dtype`` / ``torch_dtype`` a model dtype (ConfigError otherwise)."""
    for path, v in _walk({k: x for k, x in cfg.items() if k != "quantization_config"}):
        if path and _EPS.search(_leaf(path)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{path}={short(v)}: a normalization epsilon must be a finite number > 0")
    for path, v in _walk(cfg):
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{path}={short(v)} is not a finite number (NaN and Infinity are not JSON)")
    for section in (cfg, cfg.get("text_config")):
        if not isinstance(section, dict):
            continue
        where = "" if section is cfg else "text_config."
        for key, hi in SIZE_LIMITS.items():
            v = section.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ConfigError(f"{where}{key}={short(v)} must be an integer in [1, {hi}]")
    for key in ("dtype", "torch_dtype"):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, str) or v.removeprefix("torch.") not in MODEL_DTYPES):
            raise ConfigError(f"{key}={short(v)} is not a model dtype (expected one of "
                              f"{', '.join(map(repr, MODEL_DTYPES))})")


def model_dtype(cfg: dict) -> Optional[torch.dtype]:
    """The dtype config.json names (after ``check_model_config``), or None."""
    v = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, v.removeprefix("torch.")) if isinstance(v, str) else None


def layer_count(cfg: dict) -> Optional[tuple[str, int]]:
    """(key, value) of config.json's decoder layer count, if it names one."""
    for key in LAYER_KEYS:
        if isinstance(cfg.get(key), int):
            return key, cfg[key]
    return None


# ---- quantization_config.blockscale ------------------------------------------------------------------
def blockscale_section(qcfg: Any) -> dict:
    """Our section of ``quantization_config`` (absent in other producers' checkpoints), checked:
    {"input_scale_rule", "input_error", "input_overrides": {module: {...}}, "mx_scale_rule",
    "mx_scale_overrides": {module: rule}, "tensor_digests", "dtype"}
    (``dtype``: the model dtype of the non-quantized tensors, when config.json's is a serving dtype)."""
    key = "quantization_config.blockscale"
    bs = obj(qcfg.get("blockscale") if isinstance(qcfg, dict) else None, key, optional=True)

    def activation(d: dict, where: str) -> dict:
        return {"input_scale_rule": string(d.get("input_scale_rule"), f"{where}.input_scale_rule",
                                           allowed=INPUT_SCALE_RULES),
                "input_error": string(d.get("input_error"), f"{where}.input_error", allowed=NVFP4_ERRORS)}

    out = activation(bs, key)
    over = obj(bs.get("input_overrides"), f"{key}.input_overrides", optional=True)
    out["input_overrides"] = {n: activation(obj(o, f"{key}.input_overrides[{short(n)}]"),
                                          f"{key}.input_overrides[{short(n)}]")
                              for n, o in over.items()}
    out["mx_scale_rule"] = string(bs.get("mx_scale_rule"), f"{key}.mx_scale_rule", allowed=MX_SCALE_RULES)
    mx_over = obj(bs.get("mx_scale_overrides"), f"{key}.mx_scale_overrides", optional=True)
    out["mx_scale_overrides"] = {n: string(r, f"{key}.mx_scale_overrides[{short(n)}]", allowed=MX_SCALE_RULES)
                                 for n, r in mx_over.items()}
    out["tensor_digests"] = string(bs.get(DIGEST_MARKER), f"{key}.{DIGEST_MARKER}", allowed=(DIGEST_ALGO,))
    out["dtype"] = string(bs.get("dtype"), f"{key}.dtype", allowed=MODEL_DTYPES)
    return out


__all__ = ["ConfigError", "blockscale_section", "check_model_config", "kind", "layer_count", "model_dtype", "obj",
           "regexes", "short", "str_list", "string"]
