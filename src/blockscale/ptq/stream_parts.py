"""The layers' part files of a streaming PTQ run (``ptq.streaming``) as the tensor source of
``export_checkpoint``: each exported tensor read back from the part file that holds it when its output
shard is written, every part tensor written exactly once."""
from __future__ import annotations

from pathlib import Path

import torch

from ..file_errors import reading


class PartFiles:
    """The tensors of ``parts`` (layer i's part file at index i), indexed by name; call it as
    ``export_checkpoint``'s ``tensor_source``, then ``check_all_written()``."""

    def __init__(self, parts: list[Path]):
        from safetensors import safe_open

        self.where: dict[str, Path] = {}
        self.used: set[str] = set()
        for part in parts:
            with reading(part, "streaming work file"), safe_open(str(part), framework="pt", device="cpu") as f:
                self.where.update({k: part for k in f.keys()})

    def __call__(self, name: str, placeholder: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` from its part file (opened per tensor: nothing stays mapped); ``placeholder``, the
        model's tensor, when no part file holds it and it is real."""
        from safetensors import safe_open

        part = self.where.get(name)
        if part is None:
            if placeholder.device.type == "meta":
                raise RuntimeError(f"streaming export: no part file holds {name}")
            return placeholder
        with reading(part, "streaming work file"), safe_open(str(part), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        if t.shape != placeholder.shape or t.dtype != placeholder.dtype:
            raise RuntimeError(f"streaming export: {name} is {t.dtype} {tuple(t.shape)} in its part file but "
                               f"{placeholder.dtype} {tuple(placeholder.shape)} in the model")
        self.used.add(name)
        return t

    def check_all_written(self) -> None:
        """RuntimeError when a part tensor was never asked for."""
        left = set(self.where) - self.used
        if left:
            raise RuntimeError(f"streaming export: {len(left)} part tensor(s) were not written "
                               f"(e.g. {sorted(left)[0]})")


__all__ = ["PartFiles"]
