"""compressed-tensors ``nvfp4-pack-quantized`` (what llm-compressor writes; vLLM, SGLang and
TensorRT-LLM load it).

Per quantized Linear ``<m>``: ``<m>.weight_packed`` uint8 [N, K/2] (element 2i in the low nibble),
``<m>.weight_scale`` float8_e4m3fn [N, K/16], ``<m>.weight_global_scale`` fp32 [1] = the encode
scale S (x^ = q * s / S), and for W4A4 ``<m>.input_global_scale`` fp32 [1] (activation encode scale).
config.json ``quantization_config`` follows compressed-tensors' ``QuantizationConfig`` schema as
dumped by ``ModelCompressor.update_config`` (release 0.20.1) for the NVFP4 / NVFP4A16 presets.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

NAME = "compressed-tensors"
QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "nvfp4-pack-quantized"
SCHEMA_VERSION = "0.20.1"  # the compressed-tensors release whose config layout this mirrors
GROUP_SIZE = 16
SCALE_DTYPE = "torch.float8_e4m3fn"

# in-memory NVFP4Linear buffer -> on-disk suffix (identity: NVFP4Linear uses compressed-tensors' names)
RENAME = {"weight_packed": "weight_packed", "weight_scale": "weight_scale",
          "weight_global_scale": "weight_global_scale", "input_global_scale": "input_global_scale"}


def _args(dynamic, observer: Optional[str] = None) -> dict:
    a = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP_SIZE, "strategy": "tensor_group",
         "dynamic": dynamic, "scale_dtype": SCALE_DTYPE}
    if observer is not None:
        a["observer"] = observer
    return a


def quantization_config(w4a4: bool, ignore: list[str], blockscale: dict) -> dict:
    """config.json ``quantization_config`` (group_0 targets every Linear; ``ignore`` the high-precision ones)."""
    group = {
        "targets": ["Linear"],
        "weights": _args(False),
        "input_activations": _args("local", "static_minmax") if w4a4 else None,
        "output_activations": None,
        "format": PACK_FORMAT,
    }
    return {
        "config_groups": {"group_0": group},
        "format": PACK_FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": SCHEMA_VERSION,
        "blockscale": blockscale,
    }


def export_tensor(suffix: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(on-disk suffix, tensor) for an NVFP4Linear buffer."""
    if suffix in ("weight_global_scale", "input_global_scale"):
        return RENAME[suffix], t.detach().to(torch.float32).reshape(1)
    return RENAME[suffix], t


# ---- loading ---------------------------------------------------------------------------------------
class ConfigError(ValueError):
    pass


def _check_args(args: dict, where: str, dynamic_ok) -> None:
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP_SIZE}
    bad = {k: args.get(k) for k, v in want.items() if args.get(k) != v}
    if args.get("symmetric", True) is not True:
        bad["symmetric"] = args.get("symmetric")
    if args.get("dynamic") not in dynamic_ok:
        bad["dynamic"] = args.get("dynamic")
    sd = args.get("scale_dtype")
    if sd not in (None, SCALE_DTYPE, "float8_e4m3fn"):
        bad["scale_dtype"] = sd
    if bad:
        raise ConfigError(f"quantization_config {where}: {bad} is not NVFP4 (expected num_bits 4, type float, "
                          f"strategy tensor_group, group_size 16, symmetric, dynamic in {dynamic_ok})")


def _matcher(patterns: list[str]):
    exact = {p for p in patterns if not p.startswith("re:")}
    regexes = [re.compile(p[3:]) for p in patterns if p.startswith("re:")]
    return lambda name: name in exact or any(r.match(name) for r in regexes)


def parse_config(qcfg: dict) -> dict:
    """-> {"w4a4": bool, "is_ignored": f(name), "is_target": f(name, module_type_name)}."""
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise ConfigError(f"quant_method {qcfg.get('quant_method')!r} is not {QUANT_METHOD!r}")
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"expected one config group (NVFP4 for every targeted Linear), found {len(groups)}: "
                          f"{list(groups)}")
    (gname, group), = groups.items()
    fmt = group.get("format") or qcfg.get("format")
    if fmt != PACK_FORMAT:
        raise ConfigError(f"format {fmt!r} is not {PACK_FORMAT!r}")
    if not group.get("weights"):
        raise ConfigError(f"config group {gname!r} has no weights scheme")
    _check_args(group["weights"], f"config_groups.{gname}.weights", (False, None))
    acts = group.get("input_activations")
    if acts:
        _check_args(acts, f"config_groups.{gname}.input_activations", ("local",))
    if group.get("output_activations"):
        raise ConfigError("output activation quantization is not supported")
    if qcfg.get("kv_cache_scheme"):
        raise ConfigError("kv_cache_scheme (KV-cache quantization) is not supported by blockscale.load")
    targets = group.get("targets") or []
    type_targets = {t for t in targets if t in ("Linear", "nn.Linear")}
    name_match = _matcher([t for t in targets if t not in type_targets])
    ignored = _matcher(list(qcfg.get("ignore") or []))
    return {
        "w4a4": bool(acts),
        "is_ignored": ignored,
        "is_target": lambda name: bool(type_targets) or name_match(name),
    }


def expected_tensors(in_features: int, out_features: int, w4a4: bool) -> dict[str, tuple[torch.dtype, tuple]]:
    """on-disk suffix -> (dtype, allowed shapes)."""
    d = {"weight_packed": (torch.uint8, ((out_features, in_features // 2),)),
         "weight_scale": (torch.float8_e4m3fn, ((out_features, in_features // GROUP_SIZE),)),
         "weight_global_scale": (torch.float32, ((1,), ()))}
    if w4a4:
        d["input_global_scale"] = (torch.float32, ((1,), ()))
    return d


def encode_scales(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(S, S_in) as FP32 [1] from the module's on-disk tensors."""
    S = t["weight_global_scale"].to(torch.float32).reshape(1)
    S_in = t.get("input_global_scale")
    return S, (None if S_in is None else S_in.to(torch.float32).reshape(1))


def weight_tensors(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return t["weight_packed"], t["weight_scale"]


def global_scale_tensors(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors fused siblings must share (name -> stored value)."""
    return {k: t[k] for k in ("weight_global_scale", "input_global_scale") if k in t}


__all__ = ["NAME", "PACK_FORMAT", "quantization_config", "parse_config", "expected_tensors"]
