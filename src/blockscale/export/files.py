"""The files of a checkpoint directory, read as untrusted input.

* Every file read resolves (after symlinks) inside the directory, and no top-level entry is a symlink
  resolving outside it (transformers reads config.json, generation_config.json and tokenizer files
  from the directory by itself).
* JSON files are size-capped objects; a safetensors header is checked completely (entries, dtypes,
  shapes, byte ranges that tile the data section exactly, no duplicate names) before any tensor is
  read, so tensor shapes are known without reading data.
* Tensor bytes are viewed through a private memory map: validation and digests read them in place,
  and ``Shards.get`` copies one tensor out.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError
from ..data.paths import resolves_inside
from .schema import kind, short
from .writer import INDEX_FILE, SINGLE_FILE

MAX_HEADER = 100 * 1024 * 1024
MAX_JSON = 64 * 1024 * 1024
MAX_NAME = 1024  # characters of a tensor name
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2}


# ---- paths ----------------------------------------------------------------------------------------
def checkpoint_dir(path) -> Path:
    """``path`` as a checkpoint directory whose top-level symlinks all resolve inside it."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint directory")
    real = os.path.realpath(p)
    try:
        entries = sorted(os.scandir(p), key=lambda e: e.name)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot list the checkpoint directory ({e})") from None
    for e in entries:
        if e.is_symlink():
            target = os.path.realpath(e.path)
            if not resolves_inside(p, e.path):
                raise CheckpointError(f"{p / e.name}: a symlink to {target}, outside the checkpoint directory {real}; "
                                      "copy the file in instead")
    return p


def inside(root: Path, name: str, what: str) -> Path:
    """``root / name`` after checking that it resolves inside ``root``."""
    f = root / name
    target = os.path.realpath(f)
    if not resolves_inside(root, f):
        raise CheckpointError(f"{f}: a symlink to {target}, outside the checkpoint directory (the {what})")
    return f


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path`` (at most 64 MiB); CheckpointError when missing or not an object."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_JSON + 1)
        if len(data) > MAX_JSON:
            raise CheckpointError(f"{path}: {what} is larger than {MAX_JSON} bytes")
        obj = json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {kind(obj)}")
    return obj


# ---- safetensors ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a shard, from its header: absolute byte range [start, end) in the file."""
    file: str
    dtype: torch.dtype
    shape: tuple
    start: int
    end: int


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _entry(f: Path, fname: str, name: str, v, base: int) -> TensorInfo:
    if not isinstance(v, dict):
        raise CheckpointError(f"{f}: corrupt safetensors header entry for {name!r} (not a JSON object)")
    dt, shape, offs = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if dt not in DTYPES:
        raise CheckpointError(f"{f}: tensor {name!r}: unknown dtype {short(dt)} (expected one of {', '.join(DTYPES)})")
    if not isinstance(shape, list) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise CheckpointError(f"{f}: tensor {name!r}: shape {short(shape)} must be a list of integers >= 0")
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                               and o >= 0 for o in offs) and offs[0] <= offs[1]):
        raise CheckpointError(f"{f}: tensor {name!r}: data_offsets {short(offs)} must be two integers "
                              "0 <= begin <= end")
    nbytes = math.prod(shape) * DTYPES[dt].itemsize
    if nbytes != offs[1] - offs[0]:
        raise CheckpointError(f"{f}: tensor {name!r}: its shape and dtype need {nbytes} bytes, data_offsets span "
                              f"{offs[1] - offs[0]}")
    return TensorInfo(fname, DTYPES[dt], tuple(shape), base + offs[0], base + offs[1])


def read_header(f: Path, fname: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors, ``__metadata__``) of a safetensors file, every entry checked and the byte ranges
    tiling the data section exactly (a truncated file would otherwise fault inside the memory map)."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{f}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):
                raise CheckpointError(f"{f}: corrupt or truncated safetensors file (header length {n} > file size "
                                      f"{size})")
            header = json.loads(fh.read(n).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except CheckpointError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{f}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{f}: corrupt safetensors header: __metadata__ must map strings to strings")
    long = next((k for k in header if len(k) > MAX_NAME), None)
    if long is not None:
        raise CheckpointError(f"{f}: corrupt safetensors header: a tensor name is longer than {MAX_NAME} characters "
                              f"({short(long)})")
    infos = {name: _entry(f, fname, name, v, 8 + n) for name, v in header.items()}
    end = 8 + n
    for name, t in sorted(infos.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != end:
            raise CheckpointError(f"{f}: corrupt safetensors header: the data_offsets of {name!r} overlap or leave "
                                  "gaps with the previous tensor")
        end = t.end
    if end != size:
        raise CheckpointError(f"{f}: truncated or corrupt safetensors file: the header describes {end} bytes, "
                              f"the file has {size}")
    return infos, meta


def _shard_names(root: Path) -> tuple[list[str], Optional[dict], Optional[Path]]:
    index = root / INDEX_FILE
    if not (index.exists() or index.is_symlink()):
        if (root / SINGLE_FILE).exists() or (root / SINGLE_FILE).is_symlink():
            return [SINGLE_FILE], None, None
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")
    idx = read_json(inside(root, INDEX_FILE, "shard index"), INDEX_FILE)
    wm = idx.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{index}: weight_map must be a non-empty JSON object {{tensor name: shard file}}, "
                              f"got {kind(wm)}")
    for k, v in wm.items():
        if len(k) > MAX_NAME:
            raise CheckpointError(f"{index}: weight_map has a tensor name longer than {MAX_NAME} characters "
                                  f"({short(k)})")
        if not isinstance(v, str):
            raise CheckpointError(f"{index}: weight_map[{k!r}] must be a shard file name (a string), got {kind(v)}")
        if v in ("", ".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise CheckpointError(f"{index}: weight_map[{k!r}]={short(v)} is not a file name inside the checkpoint "
                                  "directory")
    return sorted(set(wm.values())), wm, index


class Shards:
    """The safetensors shards of one checkpoint: headers checked, weight_map-consistent, memory-mapped."""

    def __init__(self, root: Path):
        files, wm, index = _shard_names(root)
        self.root = root
        self.files = files
        self.index_file = index
        self.infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        self._maps: dict[str, mmap.mmap] = {}
        for fname in files:
            f = inside(root, fname, "shard")
            if not f.is_file():
                raise CheckpointError(f"{root}: shard {fname!r} listed in {INDEX_FILE} is missing" if wm is not None
                                      else f"{f}: not a file")
            infos, self.metadata[fname] = read_header(f, fname)
            for k, t in infos.items():
                if k in self.infos:
                    raise CheckpointError(f"tensor {k!r} is stored twice ({self.infos[k].file} and {fname})")
                self.infos[k] = t
            try:
                with open(f, "rb") as fh:
                    self._maps[fname] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{f}: cannot map the file ({e})") from None
        if wm is not None:
            bad = sorted(k for k, v in wm.items() if k not in self.infos or self.infos[k].file != v)
            extra = sorted(set(self.infos) - set(wm))
            if bad or extra:
                raise CheckpointError(f"{index}: weight_map disagrees with the shards (listed elsewhere or missing: "
                                      f"{bad[:5]}, not listed: {extra[:5]})")

    def describe(self) -> str:
        """The file(s) in words, for messages."""
        return self.files[0] if len(self.files) == 1 else f"the {len(self.files)} shards of {INDEX_FILE}"

    def path(self, name: str) -> Path:
        return self.root / self.infos[name].file

    def view(self, name: str) -> torch.Tensor:
        """The stored tensor, zero-copy over the memory map (do not keep it)."""
        t = self.infos[name]
        if t.end == t.start:
            return torch.empty(t.shape, dtype=t.dtype)
        flat = torch.frombuffer(self._maps[t.file], dtype=torch.uint8, count=t.end - t.start, offset=t.start)
        return flat.view(t.dtype).reshape(t.shape)

    def get(self, name: str) -> torch.Tensor:
        """A copy of the stored tensor."""
        return self.view(name).clone()

    def sha256(self, name: str) -> str:
        t = self.infos[name]
        mv = memoryview(self._maps[t.file])[t.start:t.end]
        try:
            return hashlib.sha256(mv).hexdigest()
        finally:
            mv.release()

    def close(self) -> None:
        """Drop the maps (each is unmapped once no tensor view refers to it)."""
        self._maps.clear()


__all__ = ["DTYPES", "Shards", "TensorInfo", "checkpoint_dir", "inside", "read_header", "read_json"]
