"""compressed-tensors' config: one ``config_groups`` entry per scheme, whose ``weights`` /
``input_activations`` / ``format`` are the scheme's codec's ``describe`` (``ct_codecs``), and reading
configs back (``parse``).

Targets: ``["Linear"]`` when every quantized Linear has one scheme (``ignore`` lists the rest), else
the exact module names, sorted. Top-level ``format``: the groups' format when they share one, else
"mixed-precision" (``_flatten_formats``). KV cache: ``kv_cache_scheme`` = {num_bits 8, float,
symmetric, strategy "tensor" (vLLM's only one) or "attn_head", dynamic false} and ``<attn>.k_scale`` /
``<attn>.v_scale`` FP32 [1] (attn_head: [H_kv, 1, 1], compressed-tensors' ``initialize_qparams``
shape), the names vLLM's ``maybe_remap_kv_scale_name`` maps to ``<attn>.attn.k_scale``.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from . import schema
from .codecs import find_codec
from .ct_codecs import E4M3_SCALE, FLOAT, FORMAT_NAME, MX_BLOCK, MXFP4, MXFP8, NAIVE, NVFP4_BLOCK, NVFP4_FORMAT, TILE, \
    U8_SCALE
from .ct_codecs import args as ct_args
from .ct_codecs import mx_element_of
from .registry import ParsedConfig
from .scheme_types import ModuleScheme

QUANT_METHOD = "compressed-tensors"
SCHEMA_VERSION = "0.20.1"
MIXED = "mixed-precision"
_QC = "quantization_config"
ConfigError = schema.ConfigError


def _describe(s: ModuleScheme) -> tuple:
    return find_codec(FORMAT_NAME, s).describe(s)


def group_format(s: ModuleScheme) -> str:
    """The config group ``format`` of a scheme."""
    return _describe(s)[2]


def scheme_args(s: ModuleScheme) -> tuple[dict, Optional[dict]]:
    """(weights, input_activations) of a scheme's config group."""
    return _describe(s)[:2]


def kv_cache_scheme(kv: str) -> dict:
    if kv == "nvfp4":  # NVFP4 K / V: E4M3 scales per 16 computed at run time, one stored scale per layer
        return ct_args(4, "tensor_group", group_size=16, dynamic="local")
    return ct_args(8, "tensor" if kv == "tensor" else "attn_head")


# ---- writing ----------------------------------------------------------------------------------------
def _groups(schemes: dict) -> dict[ModuleScheme, list[str]]:
    by: dict[ModuleScheme, list[str]] = {}
    for name, s in schemes.items():
        by.setdefault(s, []).append(name)
    return by


def quantization_config(schemes: dict, ignore: list, producer: dict, blockscale: dict, kv: Optional[str]) -> dict:
    """config.json ``quantization_config`` (see the module docstring)."""
    by = _groups(schemes)
    groups = {}
    for i, (s, names) in enumerate(by.items()):
        w, a, fmt = _describe(s)
        groups[f"group_{i}"] = {"targets": ["Linear"] if len(by) == 1 else sorted(names), "weights": w,
                                "input_activations": a, "output_activations": None, "format": fmt}
    formats = {g["format"] for g in groups.values()}
    return config_document(groups, formats.pop() if len(formats) == 1 else MIXED, ignore,
                           kv_cache_scheme(kv) if kv else None, blockscale)


def config_document(groups: dict, fmt: str, ignore: list, kv_cache: Optional[dict], blockscale: dict) -> dict:
    """The whole ``quantization_config`` around the config groups, in the key order
    ``ModelCompressor.update_config`` (0.20.1) dumps it."""
    return {
        "config_groups": groups,
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": kv_cache,
        "moe_sparsity_config": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": SCHEMA_VERSION,
        "blockscale": blockscale,
    }


def kv_names(attn: str) -> tuple[str, str]:
    return f"{attn}.k_scale", f"{attn}.v_scale"


def kv_export(t: torch.Tensor, per_head: bool) -> torch.Tensor:
    t = t.detach().to(torch.float32)
    return t.reshape(-1, 1, 1) if per_head else t.reshape(1)


def kv_shapes(kv: str, heads: int) -> tuple:
    return ((1,), ()) if kv in ("tensor", "nvfp4") else ((heads, 1, 1), (heads,))


# ---- reading ----------------------------------------------------------------------------------------
# the fields compressed-tensors 0.20.1's QuantizationScheme / QuantizationArgs define (both forbid others)
GROUP_FIELDS = ("targets", "weights", "input_activations", "output_activations", "format")
ARGS_FIELDS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
               "scale_dtype", "zp_dtype", "observer", "observer_kwargs")


def _known(d: dict, allowed: tuple, key: str) -> None:
    unknown = [k for k in d if k not in allowed]
    if unknown:
        raise ConfigError(f"{key}: unknown field(s) {schema.short(unknown, 120)} (compressed-tensors defines "
                          f"{', '.join(allowed)})")


def _bad(args: dict, want: dict) -> dict:
    return {k: args.get(k) for k, v in want.items() if args.get(k) != v}


def _nvfp4_args(args: dict, where: str, dynamic_ok) -> None:
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_BLOCK}
    bad = _bad(args, want)
    if args.get("symmetric", True) is not True:
        bad["symmetric"] = args.get("symmetric")
    if args.get("dynamic") not in dynamic_ok:
        bad["dynamic"] = args.get("dynamic")
    if args.get("scale_dtype") not in (None, E4M3_SCALE, "float8_e4m3fn"):
        bad["scale_dtype"] = args.get("scale_dtype")
    if bad:
        raise ConfigError(f"{_QC}.{where}: {schema.short(bad, 200)} is not NVFP4 (expected num_bits 4, type float, "
                          f"strategy tensor_group, group_size 16, symmetric, dynamic in {dynamic_ok})")


def _common_bad(args: dict, bits: int) -> dict:
    bad = _bad(args, {"num_bits": bits, "type": "float"})
    if args.get("symmetric", True) is not True:
        bad["symmetric"] = args.get("symmetric")
    return bad


def _fp8_weights(args: dict, where: str) -> str:
    bad = _common_bad(args, 8)
    strategy = args.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        bad["strategy"] = strategy
    elif strategy == "block" and list(args.get("block_structure") or []) != [TILE, TILE]:
        bad["block_structure"] = args.get("block_structure")
    if args.get("dynamic") not in (False, None):
        bad["dynamic"] = args.get("dynamic")
    if bad:
        raise ConfigError(f"{_QC}.{where}: {schema.short(bad, 200)} is not an FP8 weight scheme blockscale loads "
                          "(num_bits 8, type float, symmetric, static, strategy tensor / channel / block with "
                          "block_structure [128, 128])")
    return strategy


def _fp8_inputs(args: dict, where: str) -> str:
    bad = _common_bad(args, 8)
    got = (args.get("strategy"), args.get("dynamic"), args.get("group_size"))
    kinds = {("tensor", False): "tensor", ("token", True): "token", ("group", True): "block"}
    kind = kinds.get(got[:2])
    if kind is None or (kind == "block" and got[2] != TILE):
        bad["strategy/dynamic/group_size"] = list(got)
    if bad:
        raise ConfigError(f"{_QC}.{where}: {schema.short(bad, 200)} is not an FP8 activation scheme blockscale loads "
                          "(num_bits 8, type float, symmetric; strategy tensor static, token dynamic, or group "
                          "dynamic with group_size 128)")
    return kind


def _mx_args(args: dict, where: str, bits: int, dynamic: bool) -> None:
    bad = _common_bad(args, bits)
    bad.update(_bad(args, {"strategy": "group", "group_size": MX_BLOCK}))
    if bool(args.get("dynamic")) is not dynamic or (dynamic and args.get("dynamic") is not True):
        bad["dynamic"] = args.get("dynamic")
    if args.get("scale_dtype") not in (None, U8_SCALE, "uint8"):
        bad["scale_dtype"] = args.get("scale_dtype")
    if bad:
        raise ConfigError(f"{_QC}.{where}: {schema.short(bad, 200)} is not MXFP{bits} (expected num_bits {bits}, "
                          f"type float, symmetric, strategy group, group_size 32, scale_dtype torch.uint8, dynamic "
                          f"{str(dynamic).lower()})")


def _group_scheme(group: dict, gname: str, top_format) -> ModuleScheme:
    key = f"{_QC}.config_groups.{gname}"
    fmt = schema.string(group.get("format"), f"{key}.format") or top_format
    if fmt in (None, MIXED):
        raise ConfigError(f"{key}.format: missing; with {_QC}.format {schema.short(top_format)} every group must "
                          "name its format")
    where = f"config_groups.{gname}"
    weights = schema.obj(group.get("weights"), f"{key}.weights")
    acts = schema.obj(group.get("input_activations"), f"{key}.input_activations", optional=True)
    _known(group, GROUP_FIELDS, key)
    _known(weights, ARGS_FIELDS, f"{key}.weights")
    _known(acts, ARGS_FIELDS, f"{key}.input_activations")
    if weights.get("actorder") is not None:
        raise ConfigError(f"{key}.weights.actorder {schema.short(weights.get('actorder'))}: activation reordering "
                          "is not supported")
    if group.get("output_activations"):
        raise ConfigError(f"{key}.output_activations: output activation quantization is not supported")
    if fmt == NVFP4_FORMAT:
        _nvfp4_args(weights, f"{where}.weights", (False, None))
        if acts:
            _nvfp4_args(acts, f"{where}.input_activations", ("local",))
        return ModuleScheme("nvfp4", "nvfp4", "nvfp4" if acts else None)
    if fmt in (FLOAT, NAIVE):
        w = _fp8_weights(weights, f"{where}.weights")
        return ModuleScheme("fp8", w, _fp8_inputs(acts, f"{where}.input_activations") if acts else None)
    if fmt in (MXFP8, MXFP4):
        element, bits = mx_element_of(fmt)
        _mx_args(weights, f"{where}.weights", bits, False)
        if acts:
            _mx_args(acts, f"{where}.input_activations", bits, True)
        return ModuleScheme("mx", element, element if acts else None)
    raise ConfigError(f"{_QC}: format {schema.short(fmt)} of {key} is not one blockscale loads ("
                      f"{', '.join(map(repr, (NVFP4_FORMAT, FLOAT, NAIVE, MXFP8, MXFP4)))})")


def _kv(v) -> Optional[str]:
    key = f"{_QC}.kv_cache_scheme"
    if v is None:
        return None
    args = schema.obj(v, key, optional=True)
    _known(args, ARGS_FIELDS, key)
    if args.get("num_bits") == 4:
        bad = _bad(args, {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                          "dynamic": "local"})
        if args.get("symmetric", True) is not True:
            bad["symmetric"] = args.get("symmetric")
        if bad:
            raise ConfigError(f"{key}: {schema.short(bad, 200)} is not an NVFP4 KV cache blockscale loads (num_bits 4, "
                              "type float, symmetric, strategy tensor_group, group_size 16, dynamic local)")
        return "nvfp4"
    bad = _common_bad(args, 8)
    if args.get("dynamic") is not False:
        bad["dynamic"] = args.get("dynamic")
    if args.get("strategy") not in ("tensor", "attn_head"):
        bad["strategy"] = args.get("strategy")
    if bad:
        raise ConfigError(f"{key}: {schema.short(bad, 200)} is not an FP8 KV cache blockscale loads (num_bits 8, "
                          "type float, symmetric, dynamic false, strategy tensor or attn_head)")
    return "tensor" if args["strategy"] == "tensor" else "head"


def _matcher(patterns: list, key: str):
    exact = {p for p in patterns if not p.startswith("re:")}
    idx = [i for i, p in enumerate(patterns) if p.startswith("re:")]
    regs = schema.regexes([patterns[i][3:] for i in idx], key, idx)
    return exact, regs


def parse(qcfg: Optional[dict], side: Mapping[str, dict]) -> ParsedConfig:
    """The per-module schemes config.json's ``quantization_config`` describes; ``ConfigError`` naming
    the key of any malformed or unsupported field. A module's group: the one naming it exactly, else
    the first whose ``re:`` target matches (``re.match``), else the first targeting ``Linear``."""
    qcfg = schema.obj(qcfg, _QC)
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise ConfigError(f"{_QC}.quant_method {schema.short(qcfg.get('quant_method'))} is not {QUANT_METHOD!r}")
    groups = schema.obj(qcfg.get("config_groups"), f"{_QC}.config_groups")
    if not groups:
        raise ConfigError(f"{_QC}.config_groups: no config group (nothing is quantized)")
    top = schema.string(qcfg.get("format"), f"{_QC}.format")
    table = []
    for gname, group in groups.items():
        key = f"{_QC}.config_groups.{gname}"
        group = schema.obj(group, key)
        scheme = _group_scheme(group, gname, top)
        targets = schema.str_list(group.get("targets"), f"{key}.targets")
        exact, regs = _matcher(targets, f"{key}.targets")
        table.append((scheme, exact, regs, bool({"Linear", "nn.Linear"} & exact)))
    kv = _kv(qcfg.get("kv_cache_scheme"))
    ig_exact, ig_regs = _matcher(schema.str_list(qcfg.get("ignore"), f"{_QC}.ignore"), f"{_QC}.ignore")

    def scheme_of(name: str) -> Optional[ModuleScheme]:
        if name in ig_exact or any(r.match(name) for r in ig_regs):
            return None
        for test in (lambda e, r, t: name in e, lambda e, r, t: any(x.match(name) for x in r),
                     lambda e, r, t: t):
            for scheme, e, r, t in table:
                if test(e, r, t):
                    return scheme
        return None

    return ParsedConfig(scheme_of=scheme_of, kv=kv)


__all__ = ["config_document", "group_format", "kv_cache_scheme", "kv_export", "kv_names", "kv_shapes", "parse",
           "quantization_config", "scheme_args"]
