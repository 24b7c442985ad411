"""Streaming PTQ: quantize a model larger than memory, one decoder layer in memory at a time, resumable.

``quantize_streaming(source_dir, out_dir, config, calibration)`` builds the transformers model on the meta
device (``models.hf_streaming``), materializes the embeddings / final norm / head, then for each decoder
layer: loads its tensors from the checkpoint shards (memory-mapped ``safe_open`` reads of those keys only),
calibrates and quantizes it exactly as ``quantize_model`` does (``quantize_model.quantize_layer``, every
method and recipe, dense and MoE), computes its exported tensors (``export.layer_tensors``), writes them to
a part file in the work directory and releases the layer (back to the meta device; its small scales stay,
the checkpoint's config and report are made of them). At the end ``export_checkpoint`` runs on that
skeleton, the layers' tensors read back from the part files one output shard at a time
(``tensor_source``), inside export's ``atomic_directory``: the files are byte-identical to
``quantize_model`` + ``export_checkpoint`` on the fully loaded model (the report's ``created`` and
``seconds`` aside).

Peak memory: embeddings + head + at most two decoder layers (the float layer while its quantized modules
are built, and its exported copy) + the calibration activations (two sets while a layer runs), and one
output shard (``max_shard_size``) while assembling. ``offload_activations=DIR`` keeps the activations
between layers on disk and reads one batch at a time (the statistics / KV passes drop each batch's output,
the pass producing the next layer's inputs writes each batch to disk as it is computed).

Resume (``stream_state``): after each layer the work directory records it; ``resume=True`` restarts at the
first unfinished layer (refused when the config / format / source / calibration differ) and gives the
same bytes. The output directory appears only when complete; the work directory is removed on success.

The steps are the methods of ``stream_quantizer.StreamingQuantizer`` (``resume()``, ``process_layer(i)``,
``export()``, ``run()``); ``quantize_streaming`` builds one and runs it. The pieces: ``stream_options``
(the keyword options), ``stream_checks`` (the source and activations directories), ``stream_state`` (the
work directory), ``stream_activations`` (hidden states on disk), ``stream_resume`` (what a resumed run
reads back), ``stream_skeleton`` (a finished layer's modules), ``stream_parts`` (the export's tensor source).
"""
from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .config import PTQConfig
from .quantize_model import PTQReport
from .stream_checks import check_offload_dir, check_streaming_source
from .stream_options import StreamingOptions
from .stream_quantizer import StreamingQuantizer


def quantize_streaming(source_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], config: PTQConfig,
                       calibration: Optional[torch.Tensor] = None, format: str = "compressed-tensors",
                       **options) -> PTQReport:
    """Quantize the transformers model in ``source_dir`` (a local directory: config.json + safetensors
    shards) layer by layer and write its checkpoint to ``out_dir`` (see the module docstring).

    config / calibration: as ``quantize_model``; format: as ``export_checkpoint``. ``options``: the keyword
    arguments ``dtype``, ``device``, ``tokenizer``, ``max_shard_size`` ("2GB"), ``metadata``,
    ``extra_files``, ``overwrite``, ``resume``, ``offload_activations``, ``progress`` (True) and
    ``on_layer(i, phase, model)``, described by ``StreamingOptions``. Returns the PTQ report."""
    return StreamingQuantizer(source_dir, out_dir, config, calibration, format, StreamingOptions(**options)).run()


__all__ = ["StreamingOptions", "StreamingQuantizer", "check_offload_dir", "check_streaming_source",
           "quantize_streaming"]
