"""NVFP4 checkpoints that vLLM / SGLang / TensorRT-LLM load, and loading them back.

    from blockscale.export import export_checkpoint, load_checkpoint
    export_checkpoint(model, "out/llama-nvfp4", format="compressed-tensors")   # or format="modelopt"
    model = load_checkpoint("out/llama-nvfp4")     # NVFP4Linear modules; same logits bit for bit

Formats: compressed-tensors ``nvfp4-pack-quantized`` (weight_packed / weight_scale /
weight_global_scale = S / input_global_scale) and the ModelOpt unified HF checkpoint (weight /
weight_scale / weight_scale_2 = 1/S / input_scale = 1/S_in, hf_quant_config.json). Same packed codes
and E4M3 block scales in both. Each is one module building a ``CheckpointFormat`` and registering it
(``registry``); ``export_checkpoint`` and ``load_checkpoint`` look formats up there.
"""
from . import compressed_tensors, modelopt  # noqa: F401  (each registers its CheckpointFormat)
from .checkpoint import REPORT_FILE, export_checkpoint
from .common import CheckpointError, is_blockscale_export
from .load import checkpoint_format, load_checkpoint
from .registry import FORMATS, CheckpointFormat, LayerTensors, QuantScheme, format_named
from .registry import register as register_format, unregister as unregister_format
from .summary import SizeBreakdown, size_breakdown

load = load_checkpoint

__all__ = ["CheckpointError", "CheckpointFormat", "FORMATS", "LayerTensors", "QuantScheme", "REPORT_FILE",
           "SizeBreakdown", "checkpoint_format", "export_checkpoint", "format_named", "is_blockscale_export", "load",
           "load_checkpoint", "register_format", "size_breakdown", "unregister_format"]
