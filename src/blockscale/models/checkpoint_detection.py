"""What kind of model directory this is: the one detector of quantized checkpoints.

Every checkpoint format registers a detector here (``blockscale.export.registry.register`` does it for
each ``CheckpointFormat``): ``detects(quantization_config, has_file) -> bool``, a pure function of
config.json's ``quantization_config`` object (None when absent or not an object) and of which files the
directory holds. ``models.hf`` asks it before opening a directory through transformers (an NVFP4
checkpoint opens with ``blockscale.load`` instead), and ``export.load`` asks it which format a
checkpoint is. It lives here, below the workflows, so ``models`` never imports ``export``; importing
``blockscale`` imports ``blockscale.export``, which registers the built-in formats.

    detected_format(qc, has_file)  -> the first registered format claiming it, or None
    directory_format(d)            -> the same for a directory, read defensively (never raises)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from ..data.paths import resolves_inside

Detector = Callable[[Optional[dict], Callable[[str], bool]], bool]
CONFIG_FILE = "config.json"

_DETECTORS: dict[str, Detector] = {}


def register_detector(name: str, detects: Detector) -> None:
    """Let format ``name`` claim directories (checked in registration order)."""
    _DETECTORS[name] = detects


def unregister_detector(name: str) -> None:
    _DETECTORS.pop(name, None)


def detected_format(quantization_config: Optional[dict], has_file: Callable[[str], bool]) -> Optional[str]:
    """The name of the first registered format whose detector claims a directory with this
    ``quantization_config`` (None unless a JSON object) and these files, else None."""
    qc = quantization_config if isinstance(quantization_config, dict) else None
    for name, detects in _DETECTORS.items():
        if detects(qc, has_file):
            return name
    return None


def quantization_config(d: Path) -> Optional[dict]:
    """config.json's ``quantization_config`` object of directory ``d``, or None when there is none, the
    file is not valid JSON, not an object, or (untrusted directories) a symlink resolving outside ``d``."""
    cfg = Path(d) / CONFIG_FILE
    try:
        if not resolves_inside(d, cfg) or not cfg.is_file():
            return None
        obj = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    qc = obj.get("quantization_config") if isinstance(obj, dict) else None
    return qc if isinstance(qc, dict) else None


def file_inside(d: Path) -> Callable[[str], bool]:
    """``has_file`` for directory ``d``: ``name`` is a regular file resolving inside ``d``."""
    def has_file(name: str) -> bool:
        f = Path(d) / name
        try:
            return f.is_file() and resolves_inside(d, f)
        except (OSError, ValueError):
            return False
    return has_file


def directory_format(d: Path) -> Optional[str]:
    """The quantized-checkpoint format directory ``d`` holds (``detected_format``), or None; never
    raises on a hostile config.json and never follows a symlink out of ``d``."""
    return detected_format(quantization_config(d), file_inside(d))


__all__ = ["Detector", "detected_format", "directory_format", "file_inside", "quantization_config",
           "register_detector", "unregister_detector"]
