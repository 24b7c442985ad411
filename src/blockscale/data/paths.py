"""Paths: where the project's shared evaluation data lives (one setting for every reader), and whether
a file of an untrusted model directory resolves inside it."""
from __future__ import annotations

import os
from pathlib import Path


def data_root() -> Path:
    """``$BLOCKSCALE_DATA`` if set, else ``<repo>/../shared/data`` (the folder may be absent)."""
    env = os.environ.get("BLOCKSCALE_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3].parent / "shared" / "data"


def _within(root_real: str, p: str) -> bool:
    return p == root_real or p.startswith(root_real.rstrip(os.sep) + os.sep)


def allowed_roots(directory) -> list[str]:
    """Where the files of model directory ``directory`` may resolve (after symlinks): the directory
    itself and, for a Hugging Face hub cache snapshot (``models--ORG--NAME/snapshots/REV``, whose files
    are symlinks into the repository's ``blobs``), that repository's ``blobs`` directory."""
    roots = [os.path.realpath(directory)]
    snap = Path(os.path.abspath(directory))
    blobs = snap.parent.parent / "blobs"
    if snap.parent.name == "snapshots" and snap.parent.parent.name.startswith("models--") and blobs.is_dir():
        roots.append(os.path.realpath(blobs))
    return roots


def resolves_inside(directory, path) -> bool:
    """Whether ``path`` resolves (after symlinks) inside ``directory`` (see ``allowed_roots``)."""
    target = os.path.realpath(path)
    return any(_within(r, target) for r in allowed_roots(directory))
