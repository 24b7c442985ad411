"""Safetensors shards + index, written into a temporary sibling directory that is renamed into place.

Layout (what ``save_pretrained`` writes and every serving engine reads): one ``model.safetensors``
when everything fits in ``max_shard_size``, else ``model-00001-of-0000N.safetensors`` ... plus
``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.
Safetensors only: no pickle anywhere.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterator, Union

import torch
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as "2GB" (10^9), "500MiB" (2^20), "1.5GB" (as transformers)."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size={size!r}: expected a positive int (bytes) or a string like '2GB'")
    if isinstance(size, int):
        n = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size={size!r}: expected e.g. '2GB', '500MB', '1GiB' or a number of bytes")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"max_shard_size={size!r}: expected a positive int (bytes) or a string like '2GB'")
    if n <= 0:
        raise ValueError(f"max_shard_size={size!r}: must be positive")
    return n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    """Split tensor names (in order) greedily into shards of at most ``max_shard_size`` bytes; a tensor
    larger than the limit gets a shard of its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, t in tensors.items():
        n = _nbytes(t)
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous tensor owning its whole storage (safetensors refuses shared storage)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != _nbytes(t) or t.storage_offset() != 0:
        t = t.clone()
    return t


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """One safetensors file (monkeypatched in tests to inject failures)."""
    save_file(tensors, str(path), metadata=metadata)


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], max_shard_size: int,
                      metadata: dict[str, str] | None = None) -> dict:
    """Write ``tensors`` as shards into ``directory``; returns ``{"files": [...], "total_size": n,
    "weight_map": {...}}`` (the index is written only when there are several shards)."""
    meta = {"format": "pt", **(metadata or {})}
    plan = plan_shards(tensors, max_shard_size)
    names = shard_file_names(len(plan))
    weight_map: dict[str, str] = {}
    for fname, keys in zip(names, plan):
        write_shard(directory / fname, {k: _standalone(tensors[k]) for k in keys}, meta)
        weight_map.update({k: fname for k in keys})
    total = sum(_nbytes(t) for t in tensors.values())
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(directory / INDEX_FILE, index)
    return {"files": names, "total_size": total, "weight_map": weight_map}


def write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_destination(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise FileExistsError(f"{out_dir} exists and is not a directory")
        if any(out_dir.iterdir()) and not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")


@contextlib.contextmanager
def atomic_directory(out_dir: Union[str, os.PathLike], overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary sibling directory; on normal exit it replaces ``out_dir``.

    On any exception the temporary directory is removed and ``out_dir`` is left as it was. An existing
    non-empty ``out_dir`` is refused unless ``overwrite``; then the old directory is renamed aside, the
    new one renamed in, and the old one deleted (restored if the swap fails).
    """
    out_dir = Path(out_dir).expanduser().absolute()
    check_destination(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        check_destination(out_dir, overwrite)  # it may have appeared while we wrote
        old = None
        if out_dir.exists():
            if any(out_dir.iterdir()):
                old = out_dir.parent / f".{out_dir.name}.old-{tag}"
                os.rename(out_dir, old)
            else:
                out_dir.rmdir()
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            if old is not None:
                os.rename(old, out_dir)
            raise
        _fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["INDEX_FILE", "SINGLE_FILE", "atomic_directory", "parse_size", "plan_shards", "shard_file_names",
           "write_json", "write_safetensors"]
