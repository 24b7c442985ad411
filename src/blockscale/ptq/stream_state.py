"""The work directory of a streaming PTQ run (``ptq.streaming``): what lets a killed run resume.

``.<out name>.streaming/`` next to the output directory holds

- ``state.json``: the run's fingerprint (SHA-256 of the PTQ config, the checkpoint format and dtype, the
  source's config.json / index / shard sizes, the calibration ids) and, after each finished layer,
  ``done`` (layers finished), the PTQ report so far and each finished layer's skeleton record;
- ``part-NNNNN.safetensors``: layer N's exported tensors (``export.layer_tensors``);
- ``skeleton-NNNNN.safetensors``: layer N's small tensors (``stream_skeleton``);
- ``inputs.pt`` (the calibration batches' call arguments, ``torch.load(weights_only=True)``) and
  ``hidden-NNNNN.safetensors``: the hidden states entering layer N (the next unfinished one).

Every file is written to a ``.partial`` name, flushed and renamed, and ``state.json`` last, so at any
kill the directory describes a consistent prefix of finished layers. The directory is ours when its
``state.json`` says so (``MARKER``); anything else of that name is never touched.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ..errors import UsageError
from ..export.destination import fsync_path

MARKER = "blockscale-streaming-ptq"
VERSION = 1
STATE = "state.json"


def work_dir_for(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.streaming"


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename onto ``path`` (a kill leaves the old file or none, never half a one)."""
    tmp = path.with_name(path.name + ".partial")
    write(tmp)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def _standalone(tensors: dict) -> dict:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def save_tensors(path: Path, tensors: dict) -> None:
    atomic_write(path, lambda p: save_file(_standalone(tensors), str(p)))


def load_tensors(path: Path) -> dict:
    return load_file(str(path))


def fingerprint(config_dict: dict, fmt: str, dtype, device, source: Path, calibration) -> str:
    """SHA-256 over what the layers' results depend on (see the module docstring)."""
    h = hashlib.sha256()
    src = {"config.json": (source / "config.json").read_bytes().decode("utf-8", "replace")}
    index = source / "model.safetensors.index.json"
    if index.is_file():
        src["index"] = index.read_bytes().decode("utf-8", "replace")
    src["shards"] = sorted((p.name, p.stat().st_size) for p in source.glob("*.safetensors"))
    h.update(json.dumps({"ptq": config_dict, "format": fmt, "dtype": str(dtype), "device": str(device),
                         "source": src}, sort_keys=True, default=str).encode())
    if calibration is not None:
        c = calibration.detach().to("cpu").contiguous()
        h.update(str((tuple(c.shape), str(c.dtype))).encode())
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class WorkDir:
    def __init__(self, path: Path):
        self.path = path

    def part(self, i: int) -> Path:
        return self.path / f"part-{i:05d}.safetensors"

    def skeleton(self, i: int) -> Path:
        return self.path / f"skeleton-{i:05d}.safetensors"

    def hidden(self, i: int) -> Path:
        return self.path / f"hidden-{i:05d}.safetensors"

    @property
    def inputs(self) -> Path:
        return self.path / "inputs.pt"

    def read_state(self) -> Optional[dict]:
        try:
            d = json.loads((self.path / STATE).read_text())
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) and d.get("marker") == MARKER else None

    def write_state(self, state: dict) -> None:
        def w(p):
            with open(p, "w", encoding="utf-8") as f:
                json.dump({"marker": MARKER, "version": VERSION, **state}, f)
        atomic_write(self.path / STATE, w)

    def open(self, digest: str, resume: bool) -> Optional[dict]:
        """The saved state to resume from (None: a fresh run in a new directory). UsageError for a
        directory that is not ours, an unfinished run without ``resume``, or one made from other inputs."""
        if not self.path.exists() and not self.path.is_symlink():
            self.path.mkdir(parents=True)
            return None
        if self.path.is_symlink() or not self.path.is_dir():
            raise UsageError(f"{self.path} exists and is not a streaming work directory of blockscale: remove or "
                             "rename it, or choose another output directory")
        state = self.read_state()
        if state is None:
            if any(p.name != STATE + ".partial" for p in self.path.iterdir()) and not self._only_ours():
                raise UsageError(f"{self.path} exists and is not a streaming work directory of blockscale (no "
                                 f"{STATE} of ours): remove or rename it, or choose another output directory")
            return None  # killed before the first state was written: start over in it
        if not resume:
            raise UsageError(f"{self.path} holds an unfinished streaming run ({state.get('done', 0)} layer(s) done): "
                             "pass resume=True (--resume) to continue it, or remove the directory to start over")
        if state.get("digest") != digest:
            raise UsageError(f"--resume: the streaming run in {self.path} was made with another PTQ config, format, "
                             "dtype, device, source model or calibration set; resume with the same inputs, or remove "
                             "the directory to start over")
        return state

    def _only_ours(self) -> bool:
        ok = ("part-", "skeleton-", "hidden-", "inputs.pt")
        return all(p.is_file() and p.name.startswith(ok) for p in self.path.iterdir())

    def remove(self) -> None:
        if self.read_state() is not None or self._only_ours():
            shutil.rmtree(self.path, ignore_errors=True)


__all__ = ["MARKER", "STATE", "WorkDir", "atomic_write", "fingerprint", "load_tensors", "save_tensors", "work_dir_for"]
