"""NVIDIA ModelOpt unified Hugging Face checkpoint (vLLM / SGLang ``modelopt_fp4``, TensorRT-LLM).

``hf_quant_config.json`` = {"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
"group_size", "exclude_modules"}} and config.json ``quantization_config`` in the flat
(compressed-tensors-like) shape ModelOpt's ``convert_hf_quant_config_format`` writes, with
``quant_method: "modelopt"`` (``modelopt_schemes``); each Linear's tensors as its codec writes them
(``modelopt_codecs``: NVFP4 ``weight`` / ``weight_scale`` / ``weight_scale_2`` = fl(1/S) /
``input_scale`` = fl(1/S_in), FP8, MXFP8). An all-NVFP4 model without KV-cache scales is the
one-algorithm case: quant_algo "NVFP4" = W4A4 or "W4A16_NVFP4" (ModelOpt's ``QUANTIZATION_W4A16_NVFP4``;
vLLM's ModelOptNvFp4Config maps it to its Marlin W4A16 method, but TensorRT-LLM's ``QuantAlgo`` enum
has no such member, so only W4A4 loads everywhere). A scheme without a quant_algo is refused
(``modelopt_schemes.unsupported``).
"""
from __future__ import annotations

from typing import Optional

from . import modelopt_codecs  # noqa: F401  (registers the format's tensor codecs)
from .modelopt_codecs import encode_scale_from_decode
from .modelopt_schemes import (HF_QUANT_CONFIG, QUANT_METHOD, check, kv_export, kv_names, kv_shapes, parse,
                               quantization_config, side_files, unsupported)
from .registry import CheckpointFormat, KVScales, register

NAME = modelopt_codecs.FORMAT_NAME


def detects(qcfg: Optional[dict], has_file) -> bool:
    """``quantization_config.quant_method`` starts with "modelopt" (any case), or there is no
    quant_method and the directory holds hf_quant_config.json."""
    method = qcfg.get("quant_method") if qcfg is not None else None
    method = method.lower() if isinstance(method, str) else ""
    return method.startswith(QUANT_METHOD) or (not method and has_file(HF_QUANT_CONFIG))


FORMAT = register(CheckpointFormat(
    name=NAME, quant_method=QUANT_METHOD, aliases=("modelopt_fp4", "modelopt-fp4"),
    quantization_config=quantization_config, detects=detects, parse=parse, side_files=side_files,
    side_file_names={HF_QUANT_CONFIG: "ModelOpt config"}, check=check, unsupported=unsupported,
    kv=KVScales(names=kv_names, export=kv_export, shapes=kv_shapes),
    detection=f"quant_method {QUANT_METHOD!r} (or none and an {HF_QUANT_CONFIG})"))

__all__ = ["FORMAT", "HF_QUANT_CONFIG", "NAME", "detects", "encode_scale_from_decode"]
