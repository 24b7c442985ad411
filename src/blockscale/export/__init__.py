"""Quantized checkpoints that vLLM / SGLang / TensorRT-LLM load, and loading them back.

    from blockscale.export import export_checkpoint, load_checkpoint
    export_checkpoint(model, "out/llama-nvfp4", format="compressed-tensors")   # or format="modelopt"
    model = load_checkpoint("out/llama-nvfp4")     # the same quantized modules; same logits bit for bit

Formats: compressed-tensors ``nvfp4-pack-quantized`` (weight_packed / weight_scale /
weight_global_scale = S / input_global_scale) and the ModelOpt unified HF checkpoint (weight /
weight_scale / weight_scale_2 = 1/S / input_scale = 1/S_in, hf_quant_config.json). Same packed codes
and E4M3 block scales in both. Models mixing NVFP4Linear / FP8Linear / MXLinear and carrying FP8
KV-cache scales (``nn.set_kv_scales``) are written with one config group per scheme
(compressed-tensors, ``ct_schemes``) or ``MIXED_PRECISION`` (ModelOpt, ``modelopt_schemes``). Each
format is one module registering a ``CheckpointFormat`` (its config and naming: ``registry``) and one
``TensorCodec`` per tensor kind it stores (``codecs``; ``ct_codecs``, ``modelopt_codecs``);
``export_checkpoint`` and ``load_checkpoint`` look formats and codecs up there.
"""
from . import compressed_tensors, modelopt  # noqa: F401  (each registers its CheckpointFormat)
from .checkpoint import REPORT_FILE, export_checkpoint, layer_tensors
from .common import CheckpointError, is_blockscale_export
from .load import checkpoint_format, load_checkpoint
from .codecs import TensorCodec, check_stores, codec_for, register_codec
from .module_schemes import ModuleScheme
from .registry import FORMATS, CheckpointFormat, KVScales, ParsedConfig, format_named
from .registry import register as register_format, unregister as unregister_format
from .tensor_kinds import TensorKind
from .summary import SizeBreakdown, size_breakdown

load = load_checkpoint

__all__ = ["CheckpointError", "CheckpointFormat", "FORMATS", "KVScales", "ModuleScheme", "ParsedConfig", "REPORT_FILE",
           "SizeBreakdown", "TensorCodec", "TensorKind", "check_stores", "checkpoint_format", "codec_for",
           "export_checkpoint", "format_named", "is_blockscale_export", "layer_tensors", "load", "load_checkpoint",
           "register_codec", "register_format", "size_breakdown", "unregister_format"]
