"""Where the project's shared evaluation data lives (one setting for every reader)."""
from __future__ import annotations

import os
from pathlib import Path


def data_root() -> Path:
    """``$BLOCKSCALE_DATA`` if set, else ``<repo>/../shared/data`` (the folder may be absent)."""
    env = os.environ.get("BLOCKSCALE_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"
