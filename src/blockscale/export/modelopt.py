"""NVIDIA ModelOpt unified Hugging Face checkpoint, NVFP4 (vLLM / SGLang ``modelopt_fp4``, TensorRT-LLM).

Per quantized Linear ``<m>``: ``<m>.weight`` packed uint8 [N, K/2], ``<m>.weight_scale``
float8_e4m3fn [N, K/16], ``<m>.weight_scale_2`` fp32 scalar = fl(1/S) (ModelOpt: amax/2688, the
decode scale: x^ = q * s * weight_scale_2), and for W4A4 ``<m>.input_scale`` fp32 scalar = fl(1/S_in).
``hf_quant_config.json`` = {"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
"group_size", "exclude_modules"}} and config.json ``quantization_config`` in the flat
(compressed-tensors-like) shape ModelOpt's ``convert_hf_quant_config_format`` writes, with
``quant_method: "modelopt"``.

quant_algo: "NVFP4" = W4A4; "W4A16_NVFP4" = NVFP4 weights with 16-bit activations (ModelOpt's
``QUANTIZATION_W4A16_NVFP4``; vLLM's ModelOptNvFp4Config maps it to its Marlin W4A16 method, but
TensorRT-LLM's ``QuantAlgo`` enum has no such member, so only W4A4 loads everywhere).
FP8 / MXFP8 Linears, ``MIXED_PRECISION`` and FP8 KV-cache scales: ``modelopt_schemes`` (``mixed``).
"""
from __future__ import annotations

import fnmatch
from typing import Mapping, Optional

import torch

from . import schema
from .modelopt_schemes import MIXED_FORMAT
from .registry import CheckpointFormat, LayerTensors, QuantScheme, register

NAME = "modelopt"
QUANT_METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"
GROUP_SIZE = 16
ALGO_W4A4 = "NVFP4"
ALGO_W4A16 = "W4A16_NVFP4"
FLT_MAX = torch.finfo(torch.float32).max

RENAME = {"weight_packed": "weight", "weight_scale": "weight_scale",
          "weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}


def quant_algo(w4a4: bool) -> str:
    return ALGO_W4A4 if w4a4 else ALGO_W4A16


def hf_quant_config(w4a4: bool, exclude: list[str], producer: dict) -> dict:
    """hf_quant_config.json; ``exclude``: every module kept in high precision (Linears, routers, fused
    3-D MoE experts), so no engine reads it as NVFP4."""
    return {"producer": dict(producer),
            "quantization": {"quant_algo": quant_algo(w4a4), "kv_cache_quant_algo": None,
                             "group_size": GROUP_SIZE, "exclude_modules": list(exclude)}}


def quantization_config(w4a4: bool, exclude: list[str], producer: dict, blockscale: dict) -> dict:
    """config.json ``quantization_config`` (the same ``exclude`` list, as ``ignore``)."""
    args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    group = {"weights": dict(args), "targets": ["Linear"]}
    if w4a4:
        group["input_activations"] = dict(args)
    return {"config_groups": {"group_0": group}, "ignore": list(exclude), "quant_algo": quant_algo(w4a4),
            "group_size": GROUP_SIZE, "producer": dict(producer), "quant_method": QUANT_METHOD,
            "blockscale": blockscale}


def reciprocal(S: torch.Tensor) -> torch.Tensor:
    """fl(1/S) in FP32, computed exactly as NVFP4 dequantization does (``1.0 / S``)."""
    return 1.0 / S.detach().to(torch.float32)


def export_tensor(suffix: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    if suffix in ("weight_global_scale", "input_global_scale"):
        return RENAME[suffix], reciprocal(t).reshape(())
    return RENAME[suffix], t


def encode_scale_from_decode(r: torch.Tensor, what: str = "weight_scale_2") -> torch.Tensor:
    """An FP32 S with fl(1/S) == r bit for bit (r = a stored decode scale), shape [1].

    fl(1/r) qualifies for every positive normal S (checked exhaustively on random FP32 bit patterns);
    its neighbours are tried as a safety net. Dequantization uses only fl(1/S), so the weights of the
    reloaded layer equal the original bit for bit even where S itself is not recovered.
    """
    r = r.detach().to(torch.float32).reshape(())
    if not (bool(torch.isfinite(r)) and float(r) > 0):
        raise ValueError(f"{what}={float(r)!r}: must be a positive finite FP32 value")
    c = 1.0 / r
    if not bool(torch.isfinite(c)):
        c = torch.tensor(FLT_MAX, dtype=torch.float32)
    up = down = c
    cands = [c]
    for _ in range(4):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        cands += [up, down]
    for s in cands:
        if bool(torch.isfinite(s)) and float(s) > 0 and bool((1.0 / s) == r):
            return s.reshape(1)
    raise ValueError(f"{what}={float(r)!r}: no FP32 encode scale S has fl(1/S) equal to it")


def side_files(w4a4: bool, exclude: list[str], producer: dict) -> dict[str, dict]:
    return {HF_QUANT_CONFIG: hf_quant_config(w4a4, exclude, producer)}


def check_exportable_input_scale(name: str, S_in: torch.Tensor) -> None:
    """ModelOpt stores fl(1/S_in); the activation quantizer uses S_in itself, so S_in must be a
    reciprocal fixed point (what ``input_encode_scale`` produces) to reload bit for bit."""
    s = S_in.detach().to(torch.float32).reshape(())
    if not bool((1.0 / (1.0 / s)) == s):
        raise ValueError(f"{name}.input_global_scale={float(s)!r} is not a reciprocal fixed point (fl(1/fl(1/S)) "
                         f"= {float(1.0 / (1.0 / s))!r}); the ModelOpt format stores 1/S and would reload a "
                         "different activation scale. Snap it with blockscale.nn.reciprocal_fixed_point (as "
                         "input_encode_scale does) or export to compressed-tensors")


def check_module(name: str, m) -> None:
    """An NVFP4Linear ``m`` stores bit for bit: its input scale (W4A4) is a reciprocal fixed point."""
    if m.input_global_scale is not None:
        check_exportable_input_scale(name, m.input_global_scale)


# ---- loading ---------------------------------------------------------------------------------------
ConfigError = schema.ConfigError
_QC = "quantization_config"


def detects(qcfg: Optional[dict], has_file) -> bool:
    """``quantization_config.quant_method`` starts with "modelopt" (any case), or there is no
    quant_method and the directory holds hf_quant_config.json."""
    method = qcfg.get("quant_method") if qcfg is not None else None
    method = method.lower() if isinstance(method, str) else ""
    return method.startswith(QUANT_METHOD) or (not method and has_file(HF_QUANT_CONFIG))


def parse_config(inline: Optional[dict], side: Mapping[str, dict]) -> QuantScheme:
    """``parse_quant_config`` of config.json's inline config and hf_quant_config.json (if present)."""
    return parse_quant_config(side.get(HF_QUANT_CONFIG), inline)


def parse_quant_config(hf_quant: Optional[dict], inline: Optional[dict]) -> QuantScheme:
    """From hf_quant_config.json (authoritative, as TensorRT-LLM does) or config.json's inline config
    (whose fields are type-checked either way); ``ConfigError`` (with ``.file``) naming the key of any
    malformed or unsupported field."""
    cfg = "config.json"
    if inline is not None:
        inline = schema.obj(inline, _QC, file=cfg)
        i_algo = schema.string(inline.get("quant_algo"), f"{_QC}.quant_algo", file=cfg)
        i_exclude = schema.str_list(inline.get("ignore"), f"{_QC}.ignore", file=cfg)
        i_gs, i_kv = inline.get("group_size"), inline.get("kv_cache_scheme")
    if hf_quant is not None:
        f = HF_QUANT_CONFIG
        q = schema.obj(hf_quant.get("quantization"), "quantization", file=f)
        algo = schema.string(q.get("quant_algo"), "quantization.quant_algo", file=f)
        kv, gs = q.get("kv_cache_quant_algo"), q.get("group_size")
        exclude = schema.str_list(q.get("exclude_modules"), "quantization.exclude_modules", file=f)
        where = f"{HF_QUANT_CONFIG} quantization"
    elif inline is not None:
        f, algo, kv, gs, exclude, where = cfg, i_algo, i_kv, i_gs, i_exclude, _QC
    else:
        raise ConfigError("no ModelOpt quantization config found (no hf_quant_config.json, no quantization_config)",
                          HF_QUANT_CONFIG)
    algo = (algo or "").upper()
    if algo not in (ALGO_W4A4, ALGO_W4A16):
        raise ConfigError(f"{where}.quant_algo {schema.short(algo)} is not supported (blockscale loads "
                          f"{ALGO_W4A4!r} and {ALGO_W4A16!r})", f)
    if isinstance(gs, bool) or gs not in (None, GROUP_SIZE):
        raise ConfigError(f"{where}.group_size {schema.short(gs)}: NVFP4 uses 16", f)
    if kv:
        raise ConfigError(f"{where}: KV-cache quantization ({schema.short(kv)}) is not supported by blockscale.load", f)
    exclude = list(exclude)

    def is_ignored(name: str) -> bool:
        return any(name == p or fnmatch.fnmatchcase(name, p) for p in exclude)

    return QuantScheme(w4a4=algo == ALGO_W4A4, is_ignored=is_ignored, is_target=lambda name: True)


def expected_tensors(in_features: int, out_features: int, w4a4: bool) -> dict[str, tuple[torch.dtype, tuple]]:
    d = {"weight": (torch.uint8, ((out_features, in_features // 2),)),
         "weight_scale": (torch.float8_e4m3fn, ((out_features, in_features // GROUP_SIZE),)),
         "weight_scale_2": (torch.float32, ((), (1,)))}
    if w4a4:
        d["input_scale"] = (torch.float32, ((), (1,)))
    return d


def read_layer(t: dict[str, torch.Tensor]) -> LayerTensors:
    """The module's on-disk tensors -> NVFP4Linear fields: S recovered from fl(1/S)
    (``encode_scale_from_decode``), S_in = fl(1/input_scale)."""
    S = encode_scale_from_decode(t["weight_scale_2"], "weight_scale_2")
    S_in = None
    if "input_scale" in t:
        r = t["input_scale"].to(torch.float32).reshape(())
        if not (bool(torch.isfinite(r)) and float(r) > 0):
            raise ValueError(f"input_scale={float(r)!r}: must be a positive finite FP32 value")
        S_in = (1.0 / r).reshape(1)
    return LayerTensors(t["weight"], t["weight_scale"], S, S_in)


def decode_scale(stored: torch.Tensor) -> torch.Tensor:
    """The FP32 factor dequantization multiplies by: the stored ``weight_scale_2`` = fl(1/S) itself."""
    return stored.to(torch.float32)


FORMAT = register(CheckpointFormat(
    name=NAME, quant_method=QUANT_METHOD, aliases=("modelopt_fp4", "modelopt-fp4"), tensor_names=RENAME,
    quantization_config=quantization_config, export_tensor=export_tensor, detects=detects, parse_config=parse_config,
    expected_tensors=expected_tensors, read_layer=read_layer, decode_scale=decode_scale, side_files=side_files,
    side_file_names={HF_QUANT_CONFIG: "ModelOpt config"}, check_module=check_module,
    detection=f"quant_method {QUANT_METHOD!r} (or none and an {HF_QUANT_CONFIG})", mixed=MIXED_FORMAT))

__all__ = ["FORMAT", "NAME", "HF_QUANT_CONFIG", "hf_quant_config", "quantization_config", "parse_config",
           "parse_quant_config", "expected_tensors", "encode_scale_from_decode", "read_layer"]
