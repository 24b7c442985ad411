"""Where an export writes: what may be replaced, never the model being read, a temporary sibling
directory named after its writer, one file mode, and the atomic rename into place.

- An existing non-empty ``out_dir`` is replaced (``overwrite=True``) only when it is a blockscale
  checkpoint (``is_blockscale_export``) holding nothing a blockscale export does not write: no
  subdirectory or symlink, no file other than our shards, index, configs, reports, tokenizer files
  and the files its own ``blockscale_report.json`` records. Anything else: ``FileExistsError``.
- ``out_dir`` may not be, lie inside or contain the model being read (``source``): ``UsageError``.
- The export is written into ``.NAME.tmp-<host>-<pid>-<hex>`` next to ``out_dir`` (host = CRC-32 of
  the host name, pid = the writing process), then the old ``out_dir`` is renamed to
  ``.NAME.old-<host>-<pid>-<hex>``, the new one renamed in, and the old one deleted. A directory of
  exactly that naming, from this host, whose process is gone, is stale (left by a killed export): the
  next export of NAME deletes it (an ``old`` one only if it holds nothing we do not write).
- Every file written gets mode ``0o666 & ~umask`` (0644 under the usual 022), shards included.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import stat
import warnings
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

from ..errors import UsageError
from ..file_errors import FileWriteError
from .common import CONFIG_FILE, REPORT_FILE, blockscale_report, is_blockscale_export
from .registry import side_file_names

# the names export_checkpoint writes itself (besides the shards and the formats' side files such as
# hf_quant_config.json), and the run reports the CLI adds
EXPORT_FILES = frozenset({CONFIG_FILE, REPORT_FILE, "generation_config.json", "model.safetensors",
                          "model.safetensors.index.json"})
RUN_FILES = frozenset({"ptq_report.json", "lsq_report.json"})
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                             "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                             "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json"})
_SHARD = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")
_KINDS = ("tmp", "old")
_ACTIVE: set[str] = set()  # temporary directories this process is writing now (absolute paths)


def written_by_export(name: str) -> bool:
    """True for a file name export_checkpoint writes itself (shards, index, configs, a registered
    format's side files, report, tokenizer)."""
    return (name in EXPORT_FILES or name in TOKENIZER_FILES or name in side_file_names()
            or bool(_SHARD.fullmatch(name)))


def is_own_name(name: str) -> bool:
    """True for a file name a blockscale checkpoint directory may hold (``written_by_export`` or a run report)."""
    return written_by_export(name) or name in RUN_FILES


def foreign_entries(directory: Union[str, os.PathLike]) -> list[str]:
    """What ``directory`` holds that a blockscale export does not write, sorted: subdirectories as
    "name/", symlinks as "name (symbolic link)", other files by name. Files recorded in its own
    ``blockscale_report.json`` (``written_files``, e.g. ``extra_files``) count as ours."""
    d = Path(directory)
    recorded = (blockscale_report(d) or {}).get("written_files")
    recorded = {n for n in recorded if isinstance(n, str) and "/" not in n} if isinstance(recorded, list) else set()
    found = []
    with os.scandir(d) as it:
        for e in it:
            if e.is_symlink():
                found.append(f"{e.name} (symbolic link)")
            elif e.is_dir(follow_symlinks=False):
                found.append(f"{e.name}/")
            elif not e.is_file(follow_symlinks=False):
                found.append(f"{e.name} (not a regular file)")
            elif not (is_own_name(e.name) or e.name in recorded):
                found.append(e.name)
    return sorted(found)


def check_destination(out_dir: Path, overwrite: bool) -> None:
    """Raise ``FileExistsError`` unless ``out_dir`` is absent, an empty directory, or (``overwrite``)
    a blockscale checkpoint holding nothing else."""
    if out_dir.is_symlink():
        raise FileExistsError(f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}); export to a real directory "
                              "path instead")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if not is_blockscale_export(out_dir):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a blockscale checkpoint (no "
                              f"quantization_config.blockscale in {CONFIG_FILE}, no {REPORT_FILE} from blockscale), "
                              "so it is never replaced: remove or rename it yourself, or choose another output "
                              "directory")
    foreign = foreign_entries(out_dir)
    if foreign:
        raise FileExistsError(f"{out_dir} is a blockscale checkpoint but holds files a blockscale export does not "
                              f"write ({', '.join(foreign)}), which replacing it would delete: move them out, or "
                              "remove or rename the directory yourself")
    if not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it "
                              "(it is a blockscale checkpoint)")


def _sources(source) -> list[Path]:
    if source is None:
        return []
    items = [source] if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, (str, os.PathLike)) for s in items):
        raise TypeError(f"source={source!r}: expected None, a path or a list of paths (the model being read)")
    return [Path(s).expanduser().absolute() for s in items]


def check_source(out_dir: Path, source) -> None:
    """Raise ``UsageError`` when ``out_dir`` (after symlinks) is, lies inside, or contains an existing
    path in ``source`` (the model being read). Sources that do not exist locally (hub ids) are skipped."""
    out = out_dir.resolve()
    for src in _sources(source):
        if not (src.exists() or src.is_symlink()):
            continue
        real = src.resolve()
        if out == real:
            how = "the same directory as"
        elif out.is_relative_to(real):
            how = "inside"
        elif real.is_relative_to(out):
            how = "a parent of"
        else:
            continue
        raise UsageError(f"out_dir {out_dir} is {how} {src}, the model being read (source=): an export never "
                         "writes into or replaces its source; choose another output directory")


def check_output(out_dir: Union[str, os.PathLike], overwrite: bool = False, source=None) -> Path:
    """``check_source`` then ``check_destination`` (what ``export_checkpoint`` checks before any work;
    a command line can call it before loading a model); returns the absolute ``out_dir``."""
    out = Path(out_dir).expanduser().absolute()
    check_source(out, source)
    check_destination(out, overwrite)
    return out


# ---- temporary directories ----------------------------------------------------------------------
def host_tag() -> str:
    """8 hex digits (CRC-32 of the host name): temporary names say which machine wrote them."""
    return f"{zlib.crc32(socket.gethostname().encode('utf-8', 'replace')):08x}"


def temp_name(name: str, kind: str) -> str:
    """``.NAME.KIND-<host>-<pid>-<8 hex>`` (KIND "tmp" or "old") for this process."""
    return f".{name}.{kind}-{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def parse_temp_name(entry: str, name: str) -> Optional[tuple[str, str, int]]:
    """(kind, host, pid) when ``entry`` is exactly a temporary name of ours for ``name``, else None."""
    m = re.fullmatch(rf"\.{re.escape(name)}\.(tmp|old)-([0-9a-f]{{8}})-([1-9][0-9]{{0,9}})-[0-9a-f]{{8}}", entry)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


def _alive(pid: int, path: Path) -> bool:
    if pid == os.getpid():
        return str(path) in _ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True  # another user's process (EPERM) or unknown: leave it
    return True


def remove_stale(out_dir: Path, kinds: Iterable[str] = _KINDS) -> list[Path]:
    """Delete the stale temporary directories of ``out_dir`` (see the module docstring); returns them.
    Anything not matching our naming exactly, symlinks, files, other hosts' and live writers' are kept."""
    removed = []
    host = host_tag()
    with contextlib.suppress(OSError), os.scandir(out_dir.parent) as it:
        for e in it:
            parsed = parse_temp_name(e.name, out_dir.name)
            if parsed is None or parsed[0] not in kinds or parsed[1] != host:
                continue
            path = out_dir.parent / e.name
            if e.is_symlink() or not e.is_dir(follow_symlinks=False) or _alive(parsed[2], path):
                continue
            if parsed[0] == "old" and foreign_entries(path):
                continue  # a replaced checkpoint that holds something we never write: not ours to delete
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ---- files ----------------------------------------------------------------------------------------
def current_umask() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc: read it by setting it (and restore at once)
    os.umask(mask)
    return mask


def fsync_path(path: Union[Path, str]) -> None:
    """fsync a file or directory (errors ignored: not every file system supports it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def finish_files(directory: Path) -> None:
    """Give every regular file under ``directory`` mode ``0o666 & ~umask`` and flush it to disk."""
    mode = 0o666 & ~current_umask()
    for root, _dirs, files in os.walk(directory):
        for name in files:
            p = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.chmod(p, mode)
                fsync_path(p)
        fsync_path(root)


@contextlib.contextmanager
def atomic_directory(out_dir: Union[str, os.PathLike], overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary sibling directory; on normal exit it replaces ``out_dir``.

    On any exception the temporary directory is removed and ``out_dir`` is left as it was.
    ``check_destination`` decides what may be replaced (checked before and again just before the
    swap); the old directory is renamed aside, the new one renamed in, and the old one deleted
    (restored if the swap fails). Stale temporaries of ``out_dir`` are deleted (see the module docstring).
    """
    out_dir = Path(out_dir).expanduser().absolute()
    check_destination(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out_dir, ("tmp",))
    tmp = out_dir.parent / temp_name(out_dir.name, "tmp")
    tmp.mkdir()
    _ACTIVE.add(str(tmp))
    try:
        yield tmp
        finish_files(tmp)
        check_destination(out_dir, overwrite)  # it may have appeared or changed while we wrote
        old = None
        if out_dir.exists():
            if any(out_dir.iterdir()):
                old = out_dir.parent / temp_name(out_dir.name, "old")
                os.rename(out_dir, old)
            else:
                out_dir.rmdir()
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            if old is not None:
                os.rename(old, out_dir)
            raise
    except FileWriteError as e:  # named by the final path: the temporary one is gone with the failure
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileWriteError(str(e).replace(str(tmp), str(out_dir))) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _ACTIVE.discard(str(tmp))
    fsync_path(out_dir.parent)
    if old is not None:
        _discard_old(old)
    remove_stale(out_dir, ("old",))


def _discard_old(old: Path) -> None:
    """Delete the replaced checkpoint, unless something we never write appeared in it after the check."""
    try:
        late = foreign_entries(old)
    except OSError:
        return
    if late:
        warnings.warn(f"kept the replaced checkpoint as {old}: it holds {', '.join(late)}", stacklevel=4)
    else:
        shutil.rmtree(old, ignore_errors=True)



__all__ = ["EXPORT_FILES", "RUN_FILES", "TOKENIZER_FILES", "atomic_directory", "check_destination", "check_output",
           "check_source", "current_umask", "finish_files", "foreign_entries", "fsync_path", "host_tag", "is_own_name",
           "parse_temp_name", "remove_stale", "temp_name", "written_by_export"]
