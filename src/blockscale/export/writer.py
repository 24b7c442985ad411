"""Safetensors shards + index, written into a temporary sibling directory that is renamed into place.

Layout (what ``save_pretrained`` writes and every serving engine reads): one ``model.safetensors``
when everything fits in ``max_shard_size``, else ``model-00001-of-0000N.safetensors`` ... plus
``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.
Safetensors only: no pickle anywhere.

Content digests: every shard's ``__metadata__`` holds ``"blockscale.sha256"`` = a JSON object
{tensor name: SHA-256 hex of its stored bytes} and ``"blockscale.config_sha256"`` = the SHA-256 of
config.json's content (``config_digest``); config.json ``quantization_config.blockscale`` records
``"tensor_digests": "sha256"`` so a checkpoint whose digests were stripped is recognised.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Union

import torch
from safetensors.torch import save_file

from ..file_errors import writing
from .destination import atomic_directory, check_destination  # noqa: F401  (moved there; kept importable)

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
    """One safetensors file (monkeypatched in tests to inject failures); a full disk or a file-size limit
    raises ``FileWriteError`` naming it."""
    with writing(path):
        save_file(tensors, str(path), metadata=metadata)


DIGEST_KEY = "blockscale.sha256"
CONFIG_DIGEST_KEY = "blockscale.config_sha256"
DIGEST_MARKER = "tensor_digests"  # key in quantization_config.blockscale
DIGEST_ALGO = "sha256"


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 (hex) of the bytes safetensors stores for ``t`` (row-major, little-endian)."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy() if t.numel() else b"").hexdigest()


def config_digest(config: dict) -> str:
    """SHA-256 (hex) of a config.json object in canonical form (sorted keys, no whitespace), so the
    digest survives re-indentation but not a changed value."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], max_shard_size: int,
                      metadata: dict[str, str] | None = None, *, config: dict | None = None,
                      materialize=None) -> dict:
    """Write ``tensors`` as shards into ``directory``; returns ``{"files": [...], "total_size": n,
    "weight_map": {...}}`` (the index is written only when there are several shards). Each shard's
    metadata records the SHA-256 of each of its tensors and, given ``config`` (the config.json object
    written next to it), ``config_digest(config)``. ``materialize(name, t)``: the tensor to write for
    ``tensors[name]`` (streaming PTQ: meta-device placeholders read back one shard at a time)."""
    meta = {"format": "pt", **(metadata or {})}
    if config is not None:
        meta[CONFIG_DIGEST_KEY] = config_digest(config)
    plan = plan_shards(tensors, max_shard_size)
    names = shard_file_names(len(plan))
    weight_map: dict[str, str] = {}
    for fname, keys in zip(names, plan):
        shard = {k: _standalone(tensors[k] if materialize is None else materialize(k, tensors[k])) for k in keys}
        digests = json.dumps({k: tensor_digest(t) for k, t in shard.items()}, sort_keys=True)
        write_shard(directory / fname, shard, {**meta, DIGEST_KEY: digests})
        weight_map.update({k: fname for k in keys})
    total = sum(_nbytes(t) for t in tensors.values())
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(directory / INDEX_FILE, index)
    return {"files": names, "total_size": total, "weight_map": weight_map}


def write_json(path: Path, obj) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    with writing(path), open(path, "w", encoding="utf-8") as f:
        f.write(text)


__all__ = ["CONFIG_DIGEST_KEY", "DIGEST_ALGO", "DIGEST_KEY", "DIGEST_MARKER", "INDEX_FILE", "SINGLE_FILE",
           "atomic_directory", "config_digest", "parse_size", "plan_shards", "shard_file_names", "tensor_digest",
           "write_json", "write_safetensors"]
