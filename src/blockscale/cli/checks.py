"""Validation of command-line values before any work starts: every failure is a ``UsageError`` naming the
flag and what is allowed (exit code 2), never a silent replacement.

- Numbers: flags declared with ``number(parser, flag, int | float, lo=, hi=)`` are checked by
  ``check_numbers(args)``: floats must be finite (no NaN / inf anywhere), both kinds within their bounds.
- Sizes: ``check_product`` bounds products such as n_samples * seq_len (the tokens a run allocates).
- ``check_device`` (a torch device this machine has), ``check_model`` (a built-in name, an existing path
  or a hub name), ``check_text`` (a text source that exists; ``hf:`` needs ``datasets``),
  ``check_out`` (an export destination: never the model being read, ``--overwrite`` only of a
  blockscale checkpoint), ``check_run_dir`` (a directory we can write into).
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Optional

from ..errors import UsageError

# bounds on sizes: far above any real run, far below what makes an allocation fail with a raw error
MAX_SEQ_LEN = 1 << 20        # tokens per sequence / evaluation window
MAX_SAMPLES = 1 << 20        # calibration / training windows
MAX_BATCH = 1 << 16          # sequences per batch
MAX_TOKENS = 1 << 24         # tokens held at once: n_samples * seq_len, batch_size * seq_len
MAX_EVAL_TOKENS = 1 << 40    # --max-tokens / --max-eval-tokens (a cut of the text)
MAX_STEPS = 1 << 31
MAX_SEED = (1 << 63) - 1
MAX_THREADS = 1 << 12
LIMITS_KEY = "_number_limits"  # the argparse default holding a parser's declared bounds


def flag_name(dest: str) -> str:
    """The flag of an argparse ``dest``: n_samples -> --n-samples."""
    return "--" + dest.replace("_", "-")


def _fmt(v) -> str:
    return f"{v:,}" if isinstance(v, int) and abs(v) >= 10_000 else f"{v:g}" if isinstance(v, float) else str(v)


def check_int(value, flag: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` when an int in [lo, hi], else UsageError ``FLAG VALUE: must be >= LO`` (or ``<= HI``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{flag} {value!r}: must be an integer")
    if lo is not None and value < lo:
        raise UsageError(f"{flag} {value}: must be >= {_fmt(lo)}")
    if hi is not None and value > hi:
        raise UsageError(f"{flag} {value}: must be <= {_fmt(hi)}")
    return value


def check_float(value, flag: str, lo: Optional[float] = None, hi: Optional[float] = None, *,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` when a finite number within the bounds (``lo_open`` / ``hi_open``: strict), else
    UsageError ``FLAG VALUE: must be a finite number ...``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{flag} {value!r}: must be a number")
    low_bad = lo is not None and (value <= lo if lo_open else value < lo)
    high_bad = hi is not None and (value >= hi if hi_open else value > hi)
    if not math.isfinite(value) or low_bad or high_bad:
        if lo is not None and hi is not None:
            rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            rng = f" {'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            rng = f" {'<' if hi_open else '<='} {hi:g}"
        else:
            rng = ""
        raise UsageError(f"{flag} {value:g}: must be a finite number{rng}")
    return float(value)


def number(parser, flag: str, kind: type, *, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False,
           **kwargs):
    """``parser.add_argument(flag, type=kind, **kwargs)`` and record its bounds for ``check_numbers``
    (every float flag must be finite, bounds or not)."""
    action = parser.add_argument(flag, type=kind, **kwargs)
    limits = dict(parser.get_default(LIMITS_KEY) or {})
    limits[action.dest] = (flag, kind, lo, hi, lo_open, hi_open)
    parser.set_defaults(**{LIMITS_KEY: limits})
    return action


def check_numbers(args) -> None:
    """Check every value of the flags declared with ``number`` (None: the flag was not given)."""
    for dest, (flag, kind, lo, hi, lo_open, hi_open) in (getattr(args, LIMITS_KEY, None) or {}).items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is None:
                continue
            if kind is float:
                check_float(v, flag, lo, hi, lo_open=lo_open, hi_open=hi_open)
            else:
                check_int(v, flag, lo, hi)


def check_product(*pairs, what: str, limit: int = MAX_TOKENS) -> None:
    """UsageError when the product of the ``(flag, value)`` pairs exceeds ``limit``:
    ``--n-samples N x --seq-len L = P calibration tokens: at most LIMIT``."""
    total = math.prod(v for _, v in pairs)
    if total > limit:
        terms = " x ".join(f"{f} {_fmt(v)}" for f, v in pairs)
        raise UsageError(f"{terms} = {_fmt(total)} {what}: at most {_fmt(limit)}; use smaller values")


# ----------------------------------------------------------------------------- devices

def available_devices() -> list[str]:
    """The devices this machine has: cpu, cuda:0 .. cuda:N-1, mps."""
    import torch

    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def check_device(value: Optional[str], flag: str = "--device", allow_auto: bool = False) -> Optional[str]:
    """``value`` when it names a device this machine has (or None; "auto" with ``allow_auto``),
    else UsageError naming ``flag`` and the available devices."""
    import torch

    if value is None or (allow_auto and value == "auto"):
        return value
    avail = ", ".join((["auto"] if allow_auto else []) + available_devices())
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{flag} {value}: not a device name; available: {avail}") from None
    if dev.type == "cpu":
        return value
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {value}: CUDA is not available on this machine; available: {avail}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {value}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                             f"available: {avail}")
        return value
    if dev.type == "mps" and value in available_devices():
        return value
    raise UsageError(f"{flag} {value}: device type {dev.type!r} is not available here; available: {avail}")


# ----------------------------------------------------------------------------- models, text, directories

def check_model(value: str, flag: str = "MODEL") -> None:
    """The model argument names something ``load_model`` / ``open_model`` can open: a built-in name, an
    existing path (a .gguf file must exist) or a hub name of the form org/name."""
    from ..models.hf import BUILTIN_MODELS

    name = str(value)
    if name.lower() in BUILTIN_MODELS or name.lower() == "smollm2":
        return
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and not path.is_file():
        raise UsageError(f"{flag} {name!r}: GGUF file {path} does not exist")
    if path.exists() or ("/" in name and not name.startswith((".", "/", "~"))):
        return
    raise UsageError(f"{flag} {name!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}), not an existing path, "
                     "and not a hub name of the form org/name")


def check_text(value: Optional[str], flag: str) -> None:
    """A text source flag names an existing source (``data.text_sources.check_text_source``); an ``hf:`` source
    without the ``datasets`` package stays an ImportError (exit 1), naming the flag."""
    from ..data.text_sources import check_text_source

    if value is None:
        return
    try:
        check_text_source(value)
    except ImportError as exc:
        raise ImportError(f"{flag} {value}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {value}: {exc}") from None


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(directory: Path) -> bool:
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:  # root passes os.access everywhere: try it (a nameless temporary file where supported)
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def check_run_dir(value, flag: str = "--out") -> Path:
    """``value`` as a directory we can create or write into: UsageError when it (or its nearest existing
    ancestor) is not a directory or is not writable."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {value}: exists and is not a directory")
    anchor = _nearest_existing(path.absolute())
    if not anchor.is_dir():
        raise UsageError(f"{flag} {value}: {anchor} is not a directory")
    if not _writable(anchor):
        raise UsageError(f"{flag} {value}: {anchor} is not writable")
    return path


def check_out(value, *, overwrite: bool, sources=(), flag: str = "--out") -> Path:
    """An export destination: a directory we can write (``check_run_dir``) that is not, does not lie
    inside and does not contain a model being read (``sources``: local paths; others are ignored), and
    that is absent, empty, or (with --overwrite) a blockscale checkpoint holding nothing else."""
    from ..export.destination import check_destination

    out = check_run_dir(value, flag)
    real = out.resolve()
    for src in sources:
        if src is None or not Path(src).exists():
            continue
        s = Path(src).resolve()
        how = ("is" if real == s else "lies inside" if real.is_relative_to(s) else
               "contains" if s.is_relative_to(real) else None)
        if how:
            raise UsageError(f"{flag} {value} {how} the model being read ({src}): a checkpoint is never written "
                             "into or over its source; choose another directory")
    try:
        check_destination(out.absolute(), overwrite)
    except FileExistsError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    return out


__all__ = ["MAX_BATCH", "MAX_EVAL_TOKENS", "MAX_SAMPLES", "MAX_SEED", "MAX_SEQ_LEN", "MAX_STEPS", "MAX_THREADS",
           "MAX_TOKENS", "available_devices", "check_device", "check_float", "check_int", "check_model",
           "check_numbers", "check_out", "check_product", "check_run_dir", "check_text", "flag_name", "number"]
