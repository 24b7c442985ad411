"""ModelOpt's configs: hf_quant_config.json and config.json ``quantization_config`` for the schemes of
a model, each described by its codec's quant_algo (``modelopt_codecs``), and reading them back.

One quant_algo: ``quant_algo`` (NVFP4 / W4A16_NVFP4 with ``group_size`` 16: the all-NVFP4 case). Several schemes:
``quant_algo: "MIXED_PRECISION"`` + ``quantized_layers`` {module: {"quant_algo", ("group_size")}} in
hf_quant_config.json and config.json (the layout of ModelOpt's ``convert_hf_quant_config_format``:
one config group per distinct layer entry, targets sorted). KV cache: ``kv_cache_quant_algo: "FP8"``
(hf_quant_config.json), ``kv_cache_scheme`` {dynamic false, num_bits 8, type float} (config.json) and
``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` FP32 scalars (ModelOpt ``postprocess_state_dict``;
vLLM ``maybe_remap_kv_scale_name`` maps them to ``<attn>.attn.k_scale``), per layer only.
"""
from __future__ import annotations

import fnmatch
from typing import Mapping, Optional

import torch

from . import schema
from .codecs import find_codec
from .modelopt_codecs import ALGOS, FORMAT_NAME, NVFP4_ALGOS
from .registry import ParsedConfig
from .scheme_types import ModuleScheme

HF_QUANT_CONFIG = "hf_quant_config.json"
QUANT_METHOD = "modelopt"
MIXED_ALGO, KV_ALGO = "MIXED_PRECISION", "FP8"
KV_ALGOS = {"tensor": "FP8", "nvfp4": "NVFP4"}  # kv kind -> kv_cache_quant_algo (ModelOpt >= 0.42: both amax / 448)
NOT_IN_MIXED = ("FP8_PER_CHANNEL_PER_TOKEN",)
KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
GROUP_SIZE, MX_BLOCK = 16, 32
_QC = "quantization_config"
ConfigError = schema.ConfigError

# config-group args per quant_algo, as ModelOpt's convert_hf_quant_config_format writes them
_F8 = {"dynamic": False, "num_bits": 8, "type": "float"}
_F4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
GROUP_ARGS = {"NVFP4": {"input_activations": dict(_F4), "weights": dict(_F4)},
              "W4A16_NVFP4": {"weights": dict(_F4)},
              "FP8": {"input_activations": dict(_F8), "weights": dict(_F8)},
              "FP8_PER_CHANNEL_PER_TOKEN": {"input_activations": dict(_F8),
                                            "weights": {**_F8, "strategy": "channel"}},
              "MXFP8": {"input_activations": {**_F8, "group_size": MX_BLOCK},
                        "weights": {**_F8, "group_size": MX_BLOCK}}}


def layer_entry(algo: str) -> dict:
    return {"quant_algo": algo, "group_size": GROUP_SIZE} if algo in NVFP4_ALGOS else {"quant_algo": algo}


# ---- writing ----------------------------------------------------------------------------------------
def unsupported(name: str, s: ModuleScheme) -> str:
    """The refusal of a scheme ModelOpt has no quant_algo (so no codec) for."""
    return (f"{name}: scheme {s.label} has no ModelOpt quant_algo (ModelOpt stores NVFP4, W4A16_NVFP4, FP8 = "
            "fp8-w8a8 tensor weights with static tensor activations, FP8_PER_CHANNEL_PER_TOKEN = fp8-w8a8 "
            "channel/token, MXFP8); use format='compressed-tensors'")


def check(schemes: dict, kv: Optional[str]) -> None:
    """ValueError for a combination vLLM cannot load (every scheme has a quant_algo: ``unsupported``)."""
    algos = _algos(schemes)
    if len(set(algos.values())) > 1:
        for name, s in schemes.items():
            if algos[name] in NOT_IN_MIXED:
                raise ValueError(f"{name}: scheme {s.label} ({algos[name]}) cannot be one of several schemes in a "
                                 "ModelOpt MIXED_PRECISION checkpoint (vLLM's ModelOptMixedPrecisionConfig loads FP8, "
                                 "NVFP4, W4A16_NVFP4 and MXFP8 layers only); use format='compressed-tensors'")
    if kv == "head":
        raise ValueError("per-head KV-cache scales: ModelOpt stores one k_scale / v_scale per attention layer; use "
                         "format='compressed-tensors' or per-layer KV scales")


def _algos(schemes: dict) -> dict[str, str]:
    """{module: the quant_algo its codec describes it by}."""
    return {n: find_codec(FORMAT_NAME, s).describe(s) for n, s in schemes.items()}


def _single(schemes: dict) -> Optional[str]:
    algos = set(_algos(schemes).values())
    return algos.pop() if len(algos) == 1 else None


def hf_quant_config(schemes: dict, exclude: list, producer: dict, kv: Optional[str]) -> dict:
    algo = _single(schemes)
    q = {"quant_algo": algo or MIXED_ALGO, "kv_cache_quant_algo": KV_ALGOS.get(kv) if kv else None}
    if algo is None:
        q["quantized_layers"] = {n: layer_entry(a) for n, a in sorted(_algos(schemes).items())}
    elif algo in NVFP4_ALGOS:
        q["group_size"] = GROUP_SIZE
    q["exclude_modules"] = list(exclude)
    return {"producer": dict(producer), "quantization": q}


def quantization_config(schemes: dict, exclude: list, producer: dict, blockscale: dict, kv: Optional[str]) -> dict:
    """config.json ``quantization_config`` (``convert_hf_quant_config_format``'s layout, plus our
    ``blockscale`` section; one scheme: targets ``["Linear"]``)."""
    algo = _single(schemes)
    by: dict[str, list[str]] = {}
    for n, a in _algos(schemes).items():
        by.setdefault(a, []).append(n)
    groups = {f"group_{i}": {**GROUP_ARGS[a], "targets": ["Linear"] if algo else sorted(names)}
              for i, (a, names) in enumerate(by.items())}
    out: dict = {"config_groups": groups}
    if algo is None:
        out["quantized_layers"] = {n: layer_entry(a) for n, a in sorted(_algos(schemes).items())}
    out["ignore"] = list(exclude)
    out["quant_algo"] = algo or MIXED_ALGO
    if algo in NVFP4_ALGOS:
        out["group_size"] = GROUP_SIZE
    if kv:
        out["kv_cache_quant_algo"] = KV_ALGOS[kv]
        out["kv_cache_scheme"] = "NVFP4" if kv == "nvfp4" else dict(KV_SCHEME)  # (ModelOpt: the bare string)
    out.update({"producer": dict(producer), "quant_method": QUANT_METHOD, "blockscale": blockscale})
    return out


def side_files(schemes: dict, exclude: list, producer: dict, kv: Optional[str]) -> dict:
    return {HF_QUANT_CONFIG: hf_quant_config(schemes, exclude, producer, kv)}


def kv_names(attn: str) -> tuple[str, str]:
    return f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale"


def kv_export(t: torch.Tensor, per_head: bool) -> torch.Tensor:
    return t.detach().to(torch.float32).reshape(())


def kv_shapes(kv: str, heads: int) -> tuple:
    return ((), (1,))


# ---- reading ----------------------------------------------------------------------------------------
def _algo(v, key: str, file: str) -> str:
    a = schema.string(v, key, file=file)
    a = (a or "").upper()
    if a not in ALGOS and a != MIXED_ALGO:
        raise ConfigError(f"{key} {schema.short(a)} is not supported (blockscale loads "
                          f"{', '.join(map(repr, [*ALGOS, MIXED_ALGO]))})", file)
    return a


def _layers(v, key: str, file: str) -> dict[str, str]:
    layers = schema.obj(v, key, file=file)
    if not layers:
        raise ConfigError(f"{key}: {MIXED_ALGO} needs a non-empty quantized_layers object", file)
    out = {}
    for name, entry in layers.items():
        where = f"{key}[{schema.short(name)}]"
        entry = schema.obj(entry, where, file=file)
        algo = _algo(entry.get("quant_algo"), f"{where}.quant_algo", file)
        if algo == MIXED_ALGO:
            raise ConfigError(f"{where}.quant_algo {MIXED_ALGO!r} is not a layer's algorithm", file)
        gs = entry.get("group_size")
        if isinstance(gs, bool) or gs not in (None, GROUP_SIZE if algo in NVFP4_ALGOS else MX_BLOCK if algo == "MXFP8"
                                               else None):
            raise ConfigError(f"{where}.group_size {schema.short(gs)} does not fit {algo}", file)
        unknown = set(entry) - {"quant_algo", "group_size"}
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)} (blockscale reads quant_algo, group_size)",
                              file)
        out[name] = algo
    return out


def _kv_algo(v, key: str, file: str) -> Optional[str]:
    """None (no KV cache), "tensor" (FP8) or "nvfp4"."""
    if v is None:
        return None
    kinds = {a: k for k, a in KV_ALGOS.items()}
    if isinstance(v, str) and v.upper() in kinds:
        return kinds[v.upper()]
    raise ConfigError(f"{key} {schema.short(v)}: blockscale loads FP8 and NVFP4 KV-cache scales ('FP8', 'NVFP4')",
                      file)


def _kv_scheme(v, key: str, file: str) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, str):
        return _kv_algo(v, key, file)
    args = schema.obj(v, key, file=file)
    if args.get("num_bits") == 8 and args.get("type") == "float" and args.get("dynamic", False) is False:
        return "tensor"
    raise ConfigError(f"{key} {schema.short(v)}: blockscale loads FP8 KV-cache scales only (num_bits 8, type float, "
                      "dynamic false)", file)


def parse(inline: Optional[dict], side: Mapping[str, dict]) -> ParsedConfig:
    """From hf_quant_config.json (authoritative, as TensorRT-LLM reads it) or config.json's inline
    config (type-checked either way; the two must agree on quant_algo and the KV cache)."""
    cfg, hf = "config.json", side.get(HF_QUANT_CONFIG)
    i_algo = i_kv = i_layers = None
    if inline is not None:
        inline = schema.obj(inline, _QC, file=cfg)
        i_exclude = schema.str_list(inline.get("ignore"), f"{_QC}.ignore", file=cfg)
        if inline.get("quant_algo") is not None or hf is None:
            i_algo = _algo(inline.get("quant_algo"), f"{_QC}.quant_algo", cfg)
        i_kv = _kv_algo(inline.get("kv_cache_quant_algo"), f"{_QC}.kv_cache_quant_algo", cfg) or \
            _kv_scheme(inline.get("kv_cache_scheme"), f"{_QC}.kv_cache_scheme", cfg)
        if i_algo == MIXED_ALGO:
            i_layers = _layers(inline.get("quantized_layers"), f"{_QC}.quantized_layers", cfg)
        gs = inline.get("group_size")
        if isinstance(gs, bool) or gs not in (None, GROUP_SIZE):
            raise ConfigError(f"{_QC}.group_size {schema.short(gs)}: NVFP4 uses 16", cfg)
    if hf is not None:
        f, where = HF_QUANT_CONFIG, "quantization"
        q = schema.obj(hf.get("quantization"), where, file=f)
        algo = _algo(q.get("quant_algo"), f"{where}.quant_algo", f)
        kv = _kv_algo(q.get("kv_cache_quant_algo"), f"{where}.kv_cache_quant_algo", f)
        exclude = schema.str_list(q.get("exclude_modules"), f"{where}.exclude_modules", file=f)
        gs = q.get("group_size")
        if isinstance(gs, bool) or gs not in (None, GROUP_SIZE):
            raise ConfigError(f"{where}.group_size {schema.short(gs)}: NVFP4 uses 16", f)
        layers = _layers(q.get("quantized_layers"), f"{where}.quantized_layers", f) if algo == MIXED_ALGO else None
        if i_algo is not None and i_algo != algo:
            raise ConfigError(f"{where}.quant_algo {schema.short(algo)} is not supported together with {cfg} "
                              f"{_QC}.quant_algo {i_algo!r}: the two files must agree", f)
        if inline is not None and i_kv != kv:
            raise ConfigError(f"{where}.kv_cache_quant_algo {schema.short(q.get('kv_cache_quant_algo'))} disagrees "
                              f"with {cfg} {_QC} (KV-cache scales {'present' if i_kv else 'absent'})", f)
        if i_layers is not None and i_layers != layers:
            raise ConfigError(f"{where}.quantized_layers disagrees with {cfg} {_QC}.quantized_layers", f)
    elif inline is not None:
        algo, kv, exclude, layers = i_algo, i_kv, i_exclude, i_layers
    else:
        raise ConfigError("no ModelOpt quantization config found (no hf_quant_config.json, no quantization_config)",
                          HF_QUANT_CONFIG)
    exclude = list(exclude)

    def scheme_of(name: str) -> Optional[ModuleScheme]:
        if any(name == p or fnmatch.fnmatchcase(name, p) for p in exclude):
            return None
        if layers is not None:
            a = layers.get(name)
            return None if a is None else ALGOS[a]
        return ALGOS[algo]

    return ParsedConfig(scheme_of=scheme_of, kv=kv)


__all__ = ["check", "hf_quant_config", "kv_export", "kv_names", "kv_shapes", "layer_entry", "parse",
           "quantization_config", "side_files", "unsupported"]
