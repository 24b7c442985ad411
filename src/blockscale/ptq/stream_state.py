"""The work directory of a streaming PTQ run (``ptq.streaming``): what lets a killed run resume.

``.<out name>.streaming/`` next to the output directory holds

- ``state.json``: the run's fingerprint (SHA-256 of the PTQ config, the checkpoint format and dtype, the
  source's config.json, index and the SHA-256 of each safetensors shard's contents, the calibration ids),
  the shards' digests with the ``os.stat`` they were computed at (``source_files``), and, after each
  finished layer, ``done`` (layers finished), the PTQ report so far and each finished layer's skeleton
  record;
- ``part-NNNNN.safetensors``: layer N's exported tensors (``export.layer_tensors``);
- ``skeleton-NNNNN.safetensors``: layer N's small tensors (``stream_skeleton``);
- ``inputs.pt`` (the calibration batches' call arguments, ``torch.load(weights_only=True)``) and
  ``hidden-NNNNN.safetensors``: the hidden states entering layer N (the next unfinished one).

Every file is written to a ``.partial`` name, flushed and renamed, and ``state.json`` last, so at any
kill the directory describes a consistent prefix of finished layers (a write that fails, e.g. on a full
disk, removes its ``.partial`` file and raises ``file_errors.FileWriteError`` naming it).

Source digests: the shards are hashed in full (SHA-256, one sequential read: about 0.7-1.4 GB/s on
one core here, seconds for a 7B model in bf16, against hours of PTQ) when a run starts. On ``--resume``
a shard whose size, modification and change times (ns), inode and device equal those recorded is not
read again (the change time cannot be set back by a user: any rewrite, copy or rename onto the name
changes it); any other shard is hashed again, so a model re-saved with other weights of the same sizes
is refused. A shard recorded within 2 s of its last change is always hashed again (a write in progress). The directory is ours when its
``state.json`` says so (``MARKER``); anything else of that name is never touched.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, UsageError
from ..export.destination import fsync_path
from ..file_errors import reading, writing

MARKER = "blockscale-streaming-ptq"
VERSION = 1
STATE = "state.json"


def work_dir_for(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.streaming"


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename onto ``path`` (a kill leaves the old file or none, never half a one)."""
    tmp = path.with_name(path.name + ".partial")
    try:
        with writing(path):
            write(tmp)
            fsync_path(tmp)
            os.replace(tmp, path)
            fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _standalone(tensors: dict) -> dict:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def save_tensors(path: Path, tensors: dict) -> None:
    atomic_write(path, lambda p: save_file(_standalone(tensors), str(p)))


def load_tensors(path: Path, what: str = "streaming work file") -> dict:
    with reading(path, what):
        return load_file(str(path))


HASH_CHUNK = 16 << 20
RECENT_NS = 2_000_000_000  # a shard changed this recently may still be being written: never trusted by its stat


def _stat_key(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_sha256(path: Path, on_bytes: Optional[Callable[[int], None]] = None) -> str:
    h = hashlib.sha256()
    with reading(path, "model file"), open(path, "rb") as f:
        while True:
            b = f.read(HASH_CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)
            if on_bytes is not None:
                on_bytes(len(b))


def source_files(source: Path, recorded: Optional[dict] = None, progress: bool = False) -> dict:
    """{shard name: {"stat": [...], "sha256": hex}} of the safetensors files in ``source`` (a GGUF file: of it; see
    the module docstring); ``recorded``: the same of an earlier run, whose digests are reused for unchanged files."""
    recorded = recorded if isinstance(recorded, dict) else {}
    out, todo = {}, []
    for p in [source] if source.is_file() else sorted(source.glob("*.safetensors")):
        with reading(p, "model file"):
            st = p.stat()
        key = _stat_key(st)
        old = recorded.get(p.name)
        if isinstance(old, dict) and old.get("stat") == key and isinstance(old.get("sha256"), str) \
                and old.get("trusted", False):
            out[p.name] = old
        else:
            todo.append((p, key, st))
    bar = None
    total = sum(st.st_size for _, _, st in todo)
    if progress and total > (256 << 20):
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="hashing the source shards", unit="B", unit_scale=True)
    try:
        for p, key, st in todo:
            digest = file_sha256(p, bar.update if bar is not None else None)
            trusted = time.time_ns() - st.st_ctime_ns > RECENT_NS and _stat_key(p.stat()) == key
            out[p.name] = {"stat": key, "sha256": digest, "trusted": trusted}
    finally:
        if bar is not None:
            bar.close()
    return out


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(config_dict: dict, fmt: str, dtype, device, source: Path, calibration,
                files: Optional[dict] = None) -> dict:
    """{part: SHA-256} of what the layers' results depend on (see the module docstring), parts "ptq",
    "format", "source" and "calibration", and "digest" over all; ``files``: the ``source_files`` of
    ``source`` (computed when not given)."""
    # a GGUF file holds its config: its digest (in the shards) covers it
    src = {} if source.is_file() else {"config.json": (source / "config.json").read_bytes().decode("utf-8", "replace")}
    index = source / "model.safetensors.index.json"
    if not source.is_file() and index.is_file():
        src["index"] = index.read_bytes().decode("utf-8", "replace")
    files = source_files(source) if files is None else files
    src["shards"] = sorted((name, f["stat"][0], f["sha256"]) for name, f in files.items())
    parts = {"ptq": _sha(config_dict), "format": _sha([fmt, str(dtype), str(device)]), "source": _sha(src)}
    h = hashlib.sha256()
    if calibration is not None:
        c = calibration.detach().to("cpu").contiguous()
        h.update(str((tuple(c.shape), str(c.dtype))).encode())
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    parts["calibration"] = h.hexdigest()
    parts["digest"] = _sha(parts)
    return parts


_PART_WORDS = {"ptq": "PTQ config", "format": "checkpoint format, dtype or device",
               "source": "source model (config.json, index or the shards' contents)", "calibration": "calibration set"}


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
        """The state of our run, None when there is none (or the file is not ours); CheckpointError when
        ``state.json`` is there, among only our files, but unreadable."""
        path = self.path / STATE
        try:
            text = path.read_text()
        except OSError:
            return None
        try:
            d = json.loads(text)
        except ValueError as e:
            if self._only_ours(besides=(STATE,)):
                raise CheckpointError(f"{path}: the streaming run's state is corrupt ({e}); remove {self.path} to "
                                      "start over") from None
            return None
        return d if isinstance(d, dict) and d.get("marker") == MARKER else None

    def check_state(self, state: dict, n_layers: int, needs_inputs: bool) -> None:
        """CheckpointError naming ``state.json`` or the missing file when the recorded state does not
        describe finished layers this directory holds."""
        where = self.path / STATE
        done, records, batches = state.get("done"), state.get("records"), state.get("batches")
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= n_layers:
            raise CheckpointError(f"{where}: done={done!r} is not a layer count of this model (0..{n_layers}); "
                                  f"remove {self.path} to start over")
        if not isinstance(records, dict) or any(not isinstance(records.get(str(i)), dict) for i in range(done)):
            raise CheckpointError(f"{where}: records of the {done} finished layer(s) are missing or malformed; "
                                  f"remove {self.path} to start over")
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise CheckpointError(f"{where}: batches={batches!r} is not a batch count; remove {self.path} to start "
                                  "over")
        from safetensors import safe_open

        for i in range(done):
            for f in (self.part(i), self.skeleton(i)):
                if not f.is_file():
                    raise CheckpointError(f"{f}: missing, but {where} records layer {i} as finished; remove "
                                          f"{self.path} to start over")
                try:
                    with reading(f, "streaming work file"), safe_open(str(f), framework="pt") as st:
                        st.keys()  # the header, checked against the file's length
                except CheckpointError as e:
                    raise CheckpointError(f"{e}; remove {self.path} to start over") from None
        if needs_inputs and done < n_layers and not self.inputs.is_file():
            raise CheckpointError(f"{self.inputs}: missing, but the run calibrates; remove {self.path} to start over")

    def write_state(self, state: dict) -> None:
        def w(p):
            with open(p, "w", encoding="utf-8") as f:
                json.dump({"marker": MARKER, "version": VERSION, **state}, f)
        atomic_write(self.path / STATE, w)

    def open(self, digest: dict, resume: bool) -> Optional[dict]:
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
        if state.get("digest") != digest["digest"]:
            was = state.get("parts") if isinstance(state.get("parts"), dict) else {}
            diff = [w for k, w in _PART_WORDS.items() if was.get(k) != digest[k]] if was else []
            what = " and ".join(diff) if diff else ("PTQ config, format, dtype, device, source model or calibration "
                                                    "set")
            raise UsageError(f"--resume: the streaming run in {self.path} was made with another {what}; resume with "
                             "the same inputs, or remove the directory to start over")
        return state

    def _only_ours(self, besides: tuple = ()) -> bool:
        ok = ("part-", "skeleton-", "hidden-", "inputs.pt", *besides)
        return all(p.is_file() and p.name.startswith(ok) for p in self.path.iterdir())

    def remove(self) -> None:
        if self._only_ours(besides=(STATE,)):
            shutil.rmtree(self.path, ignore_errors=True)


__all__ = ["MARKER", "STATE", "WorkDir", "atomic_write", "fingerprint", "load_tensors", "save_tensors", "work_dir_for"]
