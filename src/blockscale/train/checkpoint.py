"""Training checkpoints (what a run resumes from; ``export`` writes the other kind, deployable model
checkpoints): atomic ``torch.save`` writes, ``weights_only`` reads with clear errors, and the run record
(recipe, model config, ...) a resumed run is compared with.

Two contents (``CheckpointContents``): the whole model, {"format": CKPT_FORMAT, "step", "model",
"optimizer", "rng", "config", **extra} (pretraining), or only the tensors that train, {"format", "step",
"trainable", "optimizer", "config", **extra} (a frozen base, as in LSQ distillation). Every value is a
tensor or plain data, so ``torch.load(weights_only=True)`` reads it.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..file_errors import writing

CKPT_FORMAT = "blockscale.train/1"


class TrainingCheckpointError(CheckpointError, RuntimeError):
    """A training checkpoint that cannot be read or does not fit the model / optimizer / run (a
    ``blockscale.errors.CheckpointError``, as a bad exported checkpoint is; a RuntimeError too, as it was)."""


def save_training_checkpoint(path: Union[str, Path], model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                             cfg, **extra) -> Path:
    """Write {model, optimizer, step, rng, config: cfg.to_dict(), **extra} to ``path`` atomically (tmp +
    os.replace); ``cfg``: a ``TrainConfig`` (anything with ``to_dict()``).
    Everything is a tensor or a primitive, so ``torch.load(weights_only=True)`` reads it."""
    return CheckpointContents().save(path, model, optimizer, step, cfg.to_dict(), **extra)


def save_atomic(path: Union[str, Path], obj: dict) -> Path:
    """torch.save ``obj`` to ``path`` through a temporary file and os.replace (never half-written). A full
    disk or a file-size limit is a ``file_errors.FileWriteError`` naming ``path``; the temporary file is
    removed and an earlier ``path`` stays as it was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(path):
            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_weights_only(path: Union[str, Path]):
    """``torch.load(path, weights_only=True)`` on CPU; TrainingCheckpointError when corrupt, truncated or holding
    objects beyond tensors and plain data; FileNotFoundError when absent."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for bad zip / pickle data
        if zipfile.is_zipfile(path) and "weights only" in str(exc).lower():
            raise TrainingCheckpointError(f"checkpoint {path} holds objects that torch.load(weights_only=True) refuses "
                                          f"(checkpoints may hold only tensors and plain data): {exc}") from exc
        raise TrainingCheckpointError(f"checkpoint {path} is corrupt or truncated and cannot be loaded "
                                      f"({type(exc).__name__}: {exc}); delete it to start over") from exc


def load_training_checkpoint(path: Union[str, Path]) -> dict:
    """Read a checkpoint with ``weights_only=True`` (tensors on CPU). Raises TrainingCheckpointError when the
    file is corrupt, truncated or not a blockscale.train checkpoint; FileNotFoundError when absent."""
    return CheckpointContents().read(path)


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
    teacher, ...) with this run's ``current`` one. A mismatch raises TrainingCheckpointError naming what differs,
    unless ``force``; returns a one-line note to print (a forced mismatch, or a checkpoint written before
    runs were recorded), or None."""
    if current is None:
        return None
    if saved is None:
        return (f"note: {path} records no {' / '.join(current)} (an older checkpoint): they are not checked "
                "against this run")
    if not isinstance(saved, dict):
        raise TrainingCheckpointError(f"checkpoint {path}: its run record is a {type(saved).__name__}, not a mapping")
    diffs = [_difference(k, saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current), key=str)
             if saved.get(k) != current.get(k)]
    if not diffs:
        return None
    if not force:
        raise TrainingCheckpointError(f"checkpoint {path} was written by another run: {'; '.join(diffs)}; resume "
                                      "anyway with force=True (--force), or start a new run in another directory")
    return f"note: resuming although {'; '.join(diffs)} (--force)"


def _load_into(obj, state_dict: dict, what: str, path: Path) -> None:
    """obj.load_state_dict(state_dict), a mismatch reported as TrainingCheckpointError."""
    try:
        obj.load_state_dict(state_dict)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TrainingCheckpointError(f"checkpoint {path} does not fit this {what}: {exc}") from exc


def _trainable(model: nn.Module) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@dataclass(frozen=True)
class CheckpointContents:
    """What a training checkpoint of ``format`` holds besides the optimizer: the whole model state and
    the torch RNG (``trainable_only=False``), or only the parameters with ``requires_grad`` (``True``: a
    frozen base, whose other parameters and buffers every rank loads itself; DDP then syncs only those)."""

    format: str = CKPT_FORMAT
    trainable_only: bool = False

    def save(self, path: Union[str, Path], model: nn.Module, optimizer, step: int, config: dict,
             trainable: Optional[dict] = None, **extra) -> Path:
        """Write the checkpoint of ``step`` atomically (see ``save_atomic``); ``trainable``: the trainable
        tensors when they are not the model's own (gathered from a sharded model)."""
        if not self.trainable_only:
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            obj = {"format": self.format, "step": int(step), "model": model.state_dict(),
                   "optimizer": optimizer.state_dict(), "rng": rng, "config": config, **extra}
        else:
            obj = {"format": self.format, "step": int(step),
                   "trainable": trainable if trainable is not None else
                   {n: p.detach().cpu().clone() for n, p in _trainable(model).items()},
                   "optimizer": optimizer.state_dict(), "config": config, **extra}
        return save_atomic(path, obj)

    def read(self, path: Union[str, Path]) -> dict:
        """The checkpoint at ``path`` (``load_weights_only``); TrainingCheckpointError when it is not one
        of this format and contents."""
        obj = load_weights_only(path)
        keys = ("step", "trainable", "optimizer") if self.trainable_only else ("step", "model", "optimizer", "rng",
                                                                               "config")
        missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
        if missing or obj.get("format") != self.format:
            raise TrainingCheckpointError(f"{path} is not a {self.format} checkpoint (missing {missing or ['format']})")
        return obj

    def restore_model(self, model: nn.Module, state: dict, path) -> None:
        """Load the model part of ``state`` into ``model`` (in place); TrainingCheckpointError on a mismatch."""
        if not self.trainable_only:
            _load_into(model, state["model"], "model", path)
            return
        saved, trainable = state["trainable"], _trainable(model)
        if set(saved) != set(trainable):
            raise TrainingCheckpointError(f"checkpoint {path} trains other tensors than this run: "
                                          f"{sorted(set(saved) ^ set(trainable))[:4]} ...")
        with torch.no_grad():
            for n, p in trainable.items():
                if saved[n].shape != p.shape:
                    raise TrainingCheckpointError(f"checkpoint {path}: {n} has shape {tuple(saved[n].shape)}, "
                                                  f"the model {tuple(p.shape)}")
                p.copy_(saved[n])

    def restore_rng(self, state: dict, device: torch.device) -> None:
        """The torch (and CUDA) RNG state the checkpoint recorded, if it holds one."""
        if "rng" not in state:
            return
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def ddp_ignored(self, model: nn.Module) -> list[str]:
        """Names DDP must not sync: with ``trainable_only``, the frozen parameters and every buffer (packed
        FP4 / FP8 buffers gloo cannot broadcast); else none."""
        if not self.trainable_only:
            return []
        return [n for n, p in model.named_parameters() if not p.requires_grad] + [n for n, _ in model.named_buffers()]


def restore_optimizer(optimizer, state: dict, path) -> None:
    """optimizer.load_state_dict(state["optimizer"]); TrainingCheckpointError when it does not fit."""
    _load_into(optimizer, state["optimizer"], "optimizer", path)


__all__ = ["CKPT_FORMAT", "CheckpointContents", "TrainingCheckpointError", "check_record", "load_training_checkpoint",
           "load_weights_only", "restore_optimizer", "save_atomic", "save_training_checkpoint"]
