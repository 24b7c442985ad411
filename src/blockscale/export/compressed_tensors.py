"""compressed-tensors ``nvfp4-pack-quantized`` (what llm-compressor writes; vLLM, SGLang and
TensorRT-LLM load it).

Per quantized Linear ``<m>``: ``<m>.weight_packed`` uint8 [N, K/2] (element 2i in the low nibble),
``<m>.weight_scale`` float8_e4m3fn [N, K/16], ``<m>.weight_global_scale`` fp32 [1] = the encode
scale S (x^ = q * s / S), and for W4A4 ``<m>.input_global_scale`` fp32 [1] (activation encode scale).
config.json ``quantization_config`` follows compressed-tensors' ``QuantizationConfig`` schema as
dumped by ``ModelCompressor.update_config`` (release 0.20.1) for the NVFP4 / NVFP4A16 presets.
FP8 / MX Linears, several schemes and FP8 KV-cache scales: ``ct_schemes`` (the format's ``mixed``).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from . import schema
from .ct_schemes import MIXED_FORMAT, QUANT_METHOD, SCHEMA_VERSION, config_document
from .registry import CheckpointFormat, LayerTensors, QuantScheme, register

NAME = "compressed-tensors"
PACK_FORMAT = "nvfp4-pack-quantized"
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


def quantization_config(w4a4: bool, ignore: list[str], producer: dict, blockscale: dict) -> dict:
    """config.json ``quantization_config``: group_0 targets every Linear; ``ignore`` names every module
    kept in high precision (Linears, routers, fused 3-D MoE experts), so no engine reads it as NVFP4.
    (``producer`` is not part of compressed-tensors' schema: the report and ``blockscale`` record it.)"""
    group = {
        "targets": ["Linear"],
        "weights": _args(False),
        "input_activations": _args("local", "static_minmax") if w4a4 else None,
        "output_activations": None,
        "format": PACK_FORMAT,
    }
    return config_document({"group_0": group}, PACK_FORMAT, ignore, None, blockscale)


def export_tensor(suffix: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(on-disk suffix, tensor) for an NVFP4Linear buffer."""
    if suffix in ("weight_global_scale", "input_global_scale"):
        return RENAME[suffix], t.detach().to(torch.float32).reshape(1)
    return RENAME[suffix], t


# ---- loading ---------------------------------------------------------------------------------------
ConfigError = schema.ConfigError
_QC = "quantization_config"


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
        raise ConfigError(f"{_QC}.{where}: {schema.short(bad, 200)} is not NVFP4 (expected num_bits 4, type float, "
                          f"strategy tensor_group, group_size 16, symmetric, dynamic in {dynamic_ok})")


def _matcher(patterns: list[str], key: str):
    """name -> bool: equal to a pattern, or ``re.match`` of a ``re:`` pattern (compressed-tensors' rule)."""
    exact = {p for p in patterns if not p.startswith("re:")}
    idx = [i for i, p in enumerate(patterns) if p.startswith("re:")]
    regexes = schema.regexes([patterns[i][3:] for i in idx], key, idx)
    return lambda name: name in exact or any(r.match(name) for r in regexes)


def detects(qcfg: Optional[dict], has_file) -> bool:
    """``quantization_config.quant_method`` is "compressed-tensors" (any case)."""
    method = qcfg.get("quant_method") if qcfg is not None else None
    return isinstance(method, str) and method.lower() == QUANT_METHOD


def parse_config(qcfg: Optional[dict], side_files: Mapping[str, dict]) -> QuantScheme:
    """The scheme config.json's ``quantization_config`` describes (no side files); ``ConfigError``
    naming the key of any malformed or non-NVFP4 field."""
    qcfg = schema.obj(qcfg, _QC)
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise ConfigError(f"{_QC}.quant_method {schema.short(qcfg.get('quant_method'))} is not {QUANT_METHOD!r}")
    groups = schema.obj(qcfg.get("config_groups"), f"{_QC}.config_groups")
    if len(groups) != 1:
        raise ConfigError(f"{_QC}.config_groups: expected one config group (NVFP4 for every targeted Linear), "
                          f"found {len(groups)}: {schema.short(list(groups)[:8], 200)}")
    (gname, group), = groups.items()
    key = f"{_QC}.config_groups.{gname}"
    group = schema.obj(group, key)
    fmt = schema.string(group.get("format"), f"{key}.format") or schema.string(qcfg.get("format"), f"{_QC}.format")
    if fmt != PACK_FORMAT:
        raise ConfigError(f"{_QC}: format {schema.short(fmt)} is not {PACK_FORMAT!r}")
    weights = schema.obj(group.get("weights"), f"{key}.weights")
    _check_args(weights, f"config_groups.{gname}.weights", (False, None))
    acts = schema.obj(group.get("input_activations"), f"{key}.input_activations", optional=True)
    if acts:
        _check_args(acts, f"config_groups.{gname}.input_activations", ("local",))
    if group.get("output_activations"):
        raise ConfigError(f"{key}.output_activations: output activation quantization is not supported")
    if qcfg.get("kv_cache_scheme"):
        raise ConfigError(f"{_QC}.kv_cache_scheme: KV-cache quantization is not supported by blockscale.load")
    targets = schema.str_list(group.get("targets"), f"{key}.targets")
    type_targets = {t for t in targets if t in ("Linear", "nn.Linear")}
    name_match = _matcher(targets, f"{key}.targets")
    ignored = _matcher(schema.str_list(qcfg.get("ignore"), f"{_QC}.ignore"), f"{_QC}.ignore")
    return QuantScheme(w4a4=bool(acts), is_ignored=ignored,
                       is_target=lambda name: bool(type_targets) or name_match(name))


def expected_tensors(in_features: int, out_features: int, w4a4: bool) -> dict[str, tuple[torch.dtype, tuple]]:
    """on-disk suffix -> (dtype, allowed shapes)."""
    d = {"weight_packed": (torch.uint8, ((out_features, in_features // 2),)),
         "weight_scale": (torch.float8_e4m3fn, ((out_features, in_features // GROUP_SIZE),)),
         "weight_global_scale": (torch.float32, ((1,), ()))}
    if w4a4:
        d["input_global_scale"] = (torch.float32, ((1,), ()))
    return d


def read_layer(t: dict[str, torch.Tensor]) -> LayerTensors:
    """The module's on-disk tensors -> NVFP4Linear fields (S and S_in stored as they are, FP32 [1])."""
    S_in = t.get("input_global_scale")
    return LayerTensors(t["weight_packed"], t["weight_scale"], t["weight_global_scale"].to(torch.float32).reshape(1),
                        None if S_in is None else S_in.to(torch.float32).reshape(1))


def decode_scale(stored: torch.Tensor) -> torch.Tensor:
    """The FP32 factor dequantization multiplies by, fl(1/S), from the stored ``weight_global_scale`` S."""
    return 1.0 / stored.to(torch.float32)


FORMAT = register(CheckpointFormat(
    name=NAME, quant_method=QUANT_METHOD, aliases=("compressed_tensors", PACK_FORMAT, "ct"), tensor_names=RENAME,
    quantization_config=quantization_config, export_tensor=export_tensor, detects=detects, parse_config=parse_config,
    expected_tensors=expected_tensors, read_layer=read_layer, decode_scale=decode_scale,
    serving_dtype=torch.bfloat16, detection=f"quant_method {QUANT_METHOD!r}", mixed=MIXED_FORMAT))

__all__ = ["FORMAT", "NAME", "PACK_FORMAT", "quantization_config", "parse_config", "expected_tensors", "read_layer"]
