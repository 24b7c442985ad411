"""Pieces shared by export and load: tied-weight de-duplication, the model dtype, our version, and
recognising our own exports. (The checkpoint formats are in ``registry``; the error is
``blockscale.errors.CheckpointError``, re-exported here.)"""
from __future__ import annotations

import json
import math
import os
import stat
from collections import defaultdict
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from torch import nn

from ..errors import CheckpointError
from ..version import __version__
from .registry import FORMATS

CONFIG_FILE = "config.json"
REPORT_FILE = "blockscale_report.json"
PRODUCER = "blockscale"
_MAX_METADATA_BYTES = 64 * 2**20


def tied_targets(model: nn.Module) -> set[str]:
    """Names transformers treats as tied copies (dropped on save, re-tied on load)."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None and hasattr(model, "get_expanded_tied_weights_keys"):
        try:
            keys = model.get_expanded_tied_weights_keys(all_submodels=True)
        except Exception:  # pragma: no cover - other transformers versions
            keys = None
    if keys is None:
        keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys)


def drop_shared(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without duplicate entries of one tensor (tied embeddings), keeping the name that is
    not a tied target, as ``save_pretrained`` does (safetensors refuses shared tensors)."""
    targets = tied_targets(model)
    by_view: dict[tuple, list[str]] = defaultdict(list)
    for k, t in state.items():
        if t.numel() == 0 or t.device.type == "meta":
            continue
        by_view[(t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                 t.dtype)].append(k)
    drop: set[str] = set()
    for names in by_view.values():
        if len(names) < 2:
            continue
        keep = [n for n in names if n not in targets] or names[:1]
        keep = keep[:1]
        drop.update(n for n in names if n not in keep)
    return {k: t for k, t in state.items() if k not in drop}


def model_dtype(model: nn.Module) -> torch.dtype:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def blockscale_version() -> str:
    """``blockscale.__version__`` (pyproject.toml's ``version``), from ``blockscale.version``."""
    return __version__


def _own_json(path: Path) -> Optional[object]:
    """The JSON in ``path`` when it is a regular file (not a symlink) of at most 64 MiB, else None."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_METADATA_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def blockscale_report(path: Union[str, os.PathLike]) -> Optional[dict]:
    """The parsed ``blockscale_report.json`` of the directory ``path`` when blockscale wrote it
    (``producer.name == "blockscale"``), else None."""
    rep = _own_json(Path(path) / REPORT_FILE)
    if isinstance(rep, dict) and isinstance(rep.get("producer"), dict) and rep["producer"].get("name") == PRODUCER:
        return rep
    return None


def is_blockscale_export(path: Union[str, os.PathLike]) -> bool:
    """True when the directory ``path`` is a checkpoint written by ``export_checkpoint``, recognised by
    our metadata: config.json's ``quantization_config.blockscale`` (an object with our "version" and a
    "format" we write) or a ``blockscale_report.json`` whose ``producer.name`` is "blockscale".
    Metadata files that are symlinks, not JSON or over 64 MiB do not count. Never raises."""
    p = Path(path)
    try:
        if not p.is_dir():
            return False
    except OSError:
        return False
    if blockscale_report(p) is not None:
        return True
    cfg = _own_json(p / CONFIG_FILE)
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    ours = q.get("blockscale") if isinstance(q, dict) else None
    return isinstance(ours, dict) and isinstance(ours.get("version"), str) and ours.get("format") in FORMATS


def jsonable(obj):
    """``obj`` as strict JSON data: non-finite floats and other objects become strings (metadata and
    reports written next to a checkpoint)."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return clean(json.loads(json.dumps(obj, default=str)))


__all__ = ["CONFIG_FILE", "CheckpointError", "FORMATS", "REPORT_FILE", "blockscale_report", "drop_shared",
           "is_blockscale_export", "jsonable", "model_dtype", "tied_targets"]
