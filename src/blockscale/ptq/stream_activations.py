"""The calibration activations of a streaming PTQ run (``ptq.streaming``) on disk: one
``hidden-LLLLL-BBBBB.safetensors`` file per (layer entered, batch), in the work directory or the
``offload_activations`` directory."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .capture import LayerInput
from .stream_state import load_tensors, save_tensors


def hidden_files(directory: Path, i: int, n: int) -> list[Path]:
    """The files of the ``n`` batches' hidden states entering layer ``i``."""
    return [directory / f"hidden-{i:05d}-{b:05d}.safetensors" for b in range(n)]


def save_hidden(directory: Path, i: int, hidden: list) -> None:
    """Write the hidden states entering layer ``i``, one file per batch."""
    for f, h in zip(hidden_files(directory, i, len(hidden)), hidden):
        save_tensors(f, {"hidden": h})


class OffloadedInputs(Sequence):
    """Calibration inputs whose hidden states are read from disk one batch at a time; ``meta``: each
    batch's (args, kwargs) of the layer call."""

    def __init__(self, files: list[Path], meta: list):
        self.files, self.meta = files, meta

    def __len__(self):
        return len(self.files)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[j] for j in range(*b.indices(len(self)))]
        args, kwargs = self.meta[b]
        return LayerInput(load_tensors(self.files[b])["hidden"], args, kwargs)


__all__ = ["OffloadedInputs", "hidden_files", "save_hidden"]
