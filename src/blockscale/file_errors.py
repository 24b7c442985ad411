"""One error path for files that cannot be read or written (a leaf module: every layer may import it).

The libraries blockscale reads and writes files through report ordinary file problems in their own ways:
safetensors raises ``SafetensorError`` ("incomplete metadata, file not fully covered" for a truncated
file, "I/O error: No space left on device (os error 28)" for a full disk), ``torch.save`` raises a
``RuntimeError`` ("unexpected pos ...") when the disk fills or a file-size limit is hit, ``torch.load``
raises ``RuntimeError`` / ``EOFError`` / ``UnpicklingError`` for a truncated file, and ``tokenizers``
raises a bare ``Exception`` that names no file. ``reading(path, what)`` and ``writing(path)`` turn each
into one of blockscale's errors whose message names the file and says what is wrong:

- reading: ``CheckpointError("<path>: <what> is corrupt or truncated (<library's first line>)")``;
- writing: ``FileWriteError("could not write <path>: no space left on device")`` (``ENOSPC`` /
  ``EDQUOT``), ``"... the file-size limit was reached (ulimit -f) or the file system cannot hold a file
  this large"`` (``EFBIG``), or ``"... <the OS's message>"``.

The command line prints either as one line with exit code 1. The writers that use ``writing`` remove
the partial file (``write_text_atomic`` here, ``atomic_write`` in ``ptq.stream_state``,
``train.checkpoint.save_atomic``, the export's temporary directory).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Iterator, Optional, Union

from .errors import BlockscaleError, CheckpointError

PathLike = Union[str, "os.PathLike[str]"]

_OS_ERROR_CODE = re.compile(r"os error (\d+)|\[Errno (\d+)\]")
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# torch.save's messages when its writer could not write all bytes (disk full, file-size limit)
_TORCH_WRITE = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


class FileWriteError(BlockscaleError, OSError):
    """A file blockscale writes could not be written (full disk, file-size limit, permissions); the
    message names the file."""


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__


def _code(exc: BaseException) -> Optional[int]:
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    m = _OS_ERROR_CODE.search(str(exc))
    return int(m.group(1) or m.group(2)) if m else None


def is_safetensors_error(exc: BaseException) -> bool:
    return type(exc).__name__ == "SafetensorError"


def _torch_write_cause(path: PathLike) -> Optional[str]:
    """Why torch.save stopped short (its message keeps no errno): a finite file-size limit of this process,
    or no free space left where ``path`` lies; None when neither shows."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY:
            return f"the file-size limit was reached (ulimit -f: {soft} bytes)"
    except (ImportError, OSError, ValueError):
        pass
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        if st.f_bavail * st.f_frsize < (1 << 20):
            return "no space left on device"
    except (OSError, AttributeError):
        pass
    return None


def write_problem(path: PathLike, exc: BaseException) -> Optional[FileWriteError]:
    """The FileWriteError for ``exc`` raised while writing ``path``, or None when ``exc`` is not a file
    problem (a bug: let it propagate as it is)."""
    code = _code(exc)
    torch_write = isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE)
    if not (isinstance(exc, OSError) or is_safetensors_error(exc) or torch_write):
        return None
    if code in _FULL:
        why = "no space left on device"
    elif code == errno.EFBIG:
        why = "the file-size limit was reached (ulimit -f) or the file system cannot hold a file this large"
    elif torch_write:
        why = _torch_write_cause(path) or ("the file could not be written in full (a full disk or a file-size "
                                           f"limit, ulimit -f); torch: {first_line(exc)}")
    elif isinstance(exc, OSError):
        why = exc.strerror or first_line(exc)
    else:
        why = first_line(exc)
    return FileWriteError(f"could not write {path}: {why}")


def read_problem(path: PathLike, exc: BaseException, what: str = "file") -> Optional[BaseException]:
    """The error to raise for ``exc`` raised while reading ``path`` (``what``: e.g. "safetensors file"),
    or None when ``exc`` is not a file problem."""
    if isinstance(exc, BlockscaleError):
        return None
    if isinstance(exc, OSError):
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return type(exc)(exc.errno, f"cannot read {what} {path}: {exc.strerror}")
        return OSError(exc.errno, f"cannot read {what} {path}: {exc.strerror or first_line(exc)}")
    if is_safetensors_error(exc) or isinstance(exc, (EOFError, RuntimeError, ValueError, KeyError)) \
            or type(exc).__name__ in ("UnpicklingError", "Exception"):
        return CheckpointError(f"{path}: {what} is corrupt or truncated ({first_line(exc)})")
    return None


@contextlib.contextmanager
def reading(path: PathLike, what: str = "file") -> Iterator[None]:
    """Inside: reading ``path``; a file problem becomes one error naming it (see the module docstring)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001: translated when it is a file problem, re-raised otherwise
        new = read_problem(path, exc, what)
        if new is None:
            raise
        raise new from exc


@contextlib.contextmanager
def writing(path: PathLike) -> Iterator[None]:
    """Inside: writing ``path``; a full disk, a file-size limit or another OS error becomes one
    FileWriteError naming it."""
    try:
        yield
    except FileWriteError:
        raise
    except Exception as exc:  # noqa: BLE001
        new = write_problem(path, exc)
        if new is None:
            raise
        raise new from exc


def write_text_atomic(path: PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file next to it, fsync and rename: a kill or a
    full disk leaves the old file or none, never half a one; file problems are one ``FileWriteError``
    naming ``path`` (the temporary file is removed)."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        with writing(path):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


__all__ = ["FileWriteError", "first_line", "is_safetensors_error", "read_problem", "reading", "write_problem",
           "write_text_atomic", "writing"]
