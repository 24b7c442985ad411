"""The options of a streaming PTQ run (``ptq.streaming``) besides its model, output, config, calibration
and format: the keyword arguments of ``quantize_streaming``, grouped."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch


@dataclass(frozen=True)
class StreamingOptions:
    """``dtype``: the model dtype (as ``load_model``); ``device``: where each layer is processed (as
    ``quantize_model``); ``tokenizer`` / ``max_shard_size`` / ``overwrite``: as ``export_checkpoint``;
    ``metadata`` / ``extra_files``: as ``export_checkpoint``, or a callable ``(report) -> value`` called once
    the layers are done. ``resume``: continue the unfinished run recorded in the work directory
    ``.<out name>.streaming`` next to the output directory. ``offload_activations``: a directory for the
    calibration activations between layers (created if missing; only our ``hidden-*`` files are written and
    removed there). ``progress``: a progress bar over the layers. ``on_layer(i, phase, model)``: called with
    phase "loaded" once layer i is loaded and "released" once it is recorded in the work directory (a kill
    from then on resumes at layer i + 1) and released."""

    dtype: torch.dtype = torch.float32
    device: Any = None
    tokenizer: Any = None
    max_shard_size: Union[int, str] = "2GB"
    metadata: Any = None
    extra_files: Any = None
    overwrite: bool = False
    resume: bool = False
    offload_activations: Optional[Union[str, os.PathLike]] = None
    progress: bool = True
    on_layer: Optional[Callable] = None


__all__ = ["StreamingOptions"]
