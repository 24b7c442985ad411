"""Pieces shared by export and load: the two format modules, tied-weight de-duplication, errors."""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import torch
from torch import nn

from . import compressed_tensors, modelopt

FORMATS = {compressed_tensors.NAME: compressed_tensors, modelopt.NAME: modelopt}
_ALIASES = {
    "compressed-tensors": compressed_tensors.NAME, "compressed_tensors": compressed_tensors.NAME,
    "nvfp4-pack-quantized": compressed_tensors.NAME, "ct": compressed_tensors.NAME,
    "modelopt": modelopt.NAME, "modelopt_fp4": modelopt.NAME, "modelopt-fp4": modelopt.NAME,
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: missing / unexpected / mis-shaped tensors, corrupt
    files, inconsistent configs. The message names the file or tensor."""


def resolve_format(name: str) -> str:
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise ValueError(f"format={name!r}; supported: 'compressed-tensors' (nvfp4-pack-quantized) and 'modelopt' "
                         "(modelopt_fp4)")
    return _ALIASES[key]


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
    try:
        import blockscale

        return str(getattr(blockscale, "__version__", "unknown"))
    except Exception:  # pragma: no cover
        return "unknown"


__all__ = ["CheckpointError", "FORMATS", "drop_shared", "model_dtype", "resolve_format", "tied_targets"]
