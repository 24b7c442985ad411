"""Best-step selection (``LoopConfig.keep_best``): the trainable tensors of the evaluation with the lowest loss,
the start of the run (step 0: the model as handed in) included, put back into the model at the end, so a run
never returns a model that evaluates worse than the one it started from.

The snapshot is this rank's tensors (under FSDP its shards), kept in memory and written next to each checkpoint
when it changed (``best.pt`` by rank 0; FSDP: ``best.rank{R}.pt`` by every rank), so a resumed run keeps the
steps before the resume as candidates. Ties keep the earlier step.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import TrainingCheckpointError, load_weights_only, save_atomic

BEST_FORMAT = "blockscale.train.best/1"


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class BestStep:
    """The best evaluation so far of the tensors ``params`` (the loop's trainable tensors, in order)."""

    def __init__(self, params: list, path: Optional[Path]):
        self.params, self.path = params, path
        self.step: Optional[int] = None
        self.loss = math.inf
        self.tensors: Optional[list[torch.Tensor]] = None
        self.dirty = False

    def offer(self, step: int, loss: float) -> bool:
        """Record the evaluation ``loss`` of the model at ``step``; a copy of the tensors when it is the lowest yet
        (strictly: a tie keeps the earlier step). Returns whether it was."""
        if not loss < self.loss:
            return False
        self.step, self.loss = step, float(loss)
        self.tensors = [_local(p).detach().clone() for p in self.params]
        self.dirty = True
        return True

    @torch.no_grad()
    def restore(self) -> bool:
        """Put the best step's tensors back into the model (in place); returns whether anything changed hands."""
        if self.tensors is None:
            return False
        for p, t in zip(self.params, self.tensors):
            _local(p).copy_(t)
        return True

    def save(self, write: bool) -> None:
        """Write the snapshot if it changed since the last write (``write``: this rank writes a file)."""
        if not (self.dirty and self.path is not None and self.tensors is not None):
            return
        if write:
            save_atomic(self.path, {"format": BEST_FORMAT, "step": self.step, "loss": self.loss,
                                    "tensors": [t.cpu() for t in self.tensors]})
        self.dirty = False

    def load(self, upto_step: int) -> bool:
        """Read the snapshot written before a resume (at or before ``upto_step``); False when there is none.
        TrainingCheckpointError when it does not fit these tensors."""
        if self.path is None or not self.path.exists():
            return False
        obj = load_weights_only(self.path)
        ok = (isinstance(obj, dict) and obj.get("format") == BEST_FORMAT and isinstance(obj.get("step"), int)
              and isinstance(obj.get("loss"), float) and isinstance(obj.get("tensors"), list)
              and len(obj["tensors"]) == len(self.params))
        if ok:
            ok = all(torch.is_tensor(t) and t.shape == _local(p).shape and t.dtype == _local(p).dtype
                     for t, p in zip(obj["tensors"], self.params))
        if not ok:
            raise TrainingCheckpointError(f"{self.path} is not the best-step snapshot of this run's trainable tensors")
        if obj["step"] > upto_step:
            return False  # written after the checkpoint resumed from: that step runs again
        device = _local(self.params[0]).device if self.params else torch.device("cpu")
        self.step, self.loss = obj["step"], obj["loss"]
        self.tensors = [t.to(device) for t in obj["tensors"]]
        return True


__all__ = ["BEST_FORMAT", "BestStep"]
