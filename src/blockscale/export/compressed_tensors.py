"""compressed-tensors (what llm-compressor writes; vLLM, SGLang and TensorRT-LLM load it).

config.json ``quantization_config`` follows compressed-tensors' ``QuantizationConfig`` schema as dumped
by ``ModelCompressor.update_config`` (release 0.20.1): one config group per scheme (``ct_schemes``),
each Linear's tensors as its codec writes them (``ct_codecs``: NVFP4 ``nvfp4-pack-quantized``
weight_packed / weight_scale / weight_global_scale = the encode scale S / input_global_scale, FP8, MX).
An all-NVFP4 model without KV-cache scales is the one-group case: group_0 targets every Linear and
``ignore`` names every module kept in high precision (Linears, routers, fused 3-D MoE experts), so no
engine reads it as NVFP4. KV cache: ``kv_cache_scheme`` and ``<attn>.k_scale`` / ``<attn>.v_scale`` (FP8; NVFP4 as a
tensor_group scheme with the engines' s = amax / 448, read back by blockscale only: a warning says so).
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional

import torch

from . import ct_codecs  # noqa: F401  (registers the format's tensor codecs)
from .ct_schemes import QUANT_METHOD, kv_export, kv_names, kv_shapes, parse, quantization_config
from .ct_transforms import parse_transforms, transform_config
from .registry import CheckpointFormat, KVScales, ParsedConfig, register

NAME = ct_codecs.FORMAT_NAME
PACK_FORMAT = ct_codecs.NVFP4_FORMAT


def detects(qcfg: Optional[dict], has_file) -> bool:
    """``quantization_config.quant_method`` is "compressed-tensors" (any case)."""
    method = qcfg.get("quant_method") if qcfg is not None else None
    return isinstance(method, str) and method.lower() == QUANT_METHOD


def _parse(qcfg: Optional[dict], side) -> ParsedConfig:
    """The schemes (``ct_schemes.parse``) and the online input transforms (``ct_transforms``)."""
    parsed = parse(qcfg, side)
    return replace(parsed, transforms=parse_transforms(qcfg))


def _check(schemes: dict, kv: Optional[str]) -> None:
    """An NVFP4 KV cache is written (and read back by blockscale), with a warning: no engine reads it from here."""
    if kv == "nvfp4":
        warnings.warn("an NVFP4 KV cache in a compressed-tensors checkpoint: blockscale.load reads it, but no serving "
                      "engine reads an NVFP4 kv_cache_scheme from compressed-tensors (vLLM's loader accepts KV strategies "
                      "tensor / attn_head only); export format='modelopt' (kv_cache_quant_algo NVFP4) to serve it",
                      UserWarning, stacklevel=4)


def _transforms(rotations: dict, dtype: torch.dtype, keys: Optional[dict] = None) -> tuple[dict, dict]:
    config, tensors = transform_config(rotations, dtype, keys)
    return {"transform_config": config}, tensors


FORMAT = register(CheckpointFormat(
    name=NAME, quant_method=QUANT_METHOD, aliases=("compressed_tensors", PACK_FORMAT, "ct"),
    quantization_config=quantization_config, detects=detects, parse=_parse, transforms=_transforms, check=_check,
    kv=KVScales(names=kv_names, export=kv_export, shapes=kv_shapes),
    serving_dtype=torch.bfloat16, detection=f"quant_method {QUANT_METHOD!r}"))

__all__ = ["FORMAT", "NAME", "PACK_FORMAT", "detects"]
