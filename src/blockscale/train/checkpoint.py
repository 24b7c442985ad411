"""Training checkpoints: atomic ``torch.save`` writes, ``weights_only`` reads with clear errors, and the
run record (recipe, model config, ...) a resumed run is compared with.

A checkpoint is {"format": CKPT_FORMAT, "step", "model", "optimizer", "rng", "config", **extra}; every
value is a tensor or plain data, so ``torch.load(weights_only=True)`` reads it.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn as nn

from .. import errors

if TYPE_CHECKING:
    from .trainer import TrainConfig

CKPT_FORMAT = "blockscale.train/1"


class CheckpointError(errors.CheckpointError, RuntimeError):
    """A checkpoint file that cannot be read or does not fit the model / optimizer / run (a
    ``blockscale.errors.CheckpointError``; a RuntimeError too, as it was)."""


def save_checkpoint(path: Union[str, Path], model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    cfg: TrainConfig, **extra) -> Path:
    """Write {model, optimizer, step, rng, config, **extra} to ``path`` atomically (tmp + os.replace).
    Everything is a tensor or a primitive, so ``torch.load(weights_only=True)`` reads it."""
    path = Path(path)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    obj = {"format": CKPT_FORMAT, "step": int(step), "model": model.state_dict(),
           "optimizer": optimizer.state_dict(), "rng": rng, "config": cfg.to_dict(), **extra}
    return save_atomic(path, obj)


def save_atomic(path: Union[str, Path], obj: dict) -> Path:
    """torch.save ``obj`` to ``path`` through a temporary file and os.replace (never half-written)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_weights_only(path: Union[str, Path]):
    """``torch.load(path, weights_only=True)`` on CPU; CheckpointError when corrupt, truncated or holding
    objects beyond tensors and plain data; FileNotFoundError when absent."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for bad zip / pickle data
        if zipfile.is_zipfile(path) and "weights only" in str(exc).lower():
            raise CheckpointError(f"checkpoint {path} holds objects that torch.load(weights_only=True) refuses "
                                  f"(checkpoints may hold only tensors and plain data): {exc}") from exc
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated and cannot be loaded "
                              f"({type(exc).__name__}: {exc}); delete it to start over") from exc


def load_checkpoint(path: Union[str, Path]) -> dict:
    """Read a checkpoint with ``weights_only=True`` (tensors on CPU). Raises CheckpointError when the
    file is corrupt, truncated or not a blockscale.train checkpoint; FileNotFoundError when absent."""
    obj = load_weights_only(path)
    missing = [k for k in ("step", "model", "optimizer", "rng", "config") if not isinstance(obj, dict) or k not in obj]
    if missing or obj.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"{path} is not a {CKPT_FORMAT} checkpoint (missing {missing or ['format']})")
    return obj


def _short(value) -> str:
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return repr(value["name"])
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _difference(key: str, saved, current) -> str:
    """``key``'s difference in words: the recipe names, or the first differing fields of two mappings."""
    if isinstance(saved, dict) and isinstance(current, dict) and saved.get("name") == current.get("name"):
        keys = [k for k in sorted(set(saved) | set(current), key=str) if saved.get(k) != current.get(k)]
        shown = ", ".join(f"{k} {_short(saved.get(k))} -> {_short(current.get(k))}" for k in keys[:4])
        return f"{key}: {shown}{', ...' if len(keys) > 4 else ''} (checkpoint -> this run)"
    return f"{key} {_short(saved)} in the checkpoint, {_short(current)} in this run"


def check_record(saved, current: Optional[dict], path, force: bool = False) -> Optional[str]:
    """Compare a checkpoint's run record (what defines a run beyond its config: recipe, model config,
    teacher, ...) with this run's ``current`` one. A mismatch raises CheckpointError naming what differs,
    unless ``force``; returns a one-line note to print (a forced mismatch, or a checkpoint written before
    runs were recorded), or None."""
    if current is None:
        return None
    if saved is None:
        return (f"note: {path} records no {' / '.join(current)} (an older checkpoint): they are not checked "
                "against this run")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path}: its run record is a {type(saved).__name__}, not a mapping")
    diffs = [_difference(k, saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current), key=str)
             if saved.get(k) != current.get(k)]
    if not diffs:
        return None
    if not force:
        raise CheckpointError(f"checkpoint {path} was written by another run: {'; '.join(diffs)}; resume anyway "
                              "with force=True (--force), or start a new run in another directory")
    return f"note: resuming although {'; '.join(diffs)} (--force)"


def _load_into(obj, state_dict: dict, what: str, path: Path) -> None:
    """obj.load_state_dict(state_dict), a mismatch reported as CheckpointError."""
    try:
        obj.load_state_dict(state_dict)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} does not fit this {what}: {exc}") from exc


__all__ = ["CKPT_FORMAT", "CheckpointError", "check_record", "load_checkpoint", "load_weights_only", "save_atomic",
           "save_checkpoint"]
