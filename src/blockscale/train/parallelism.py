"""How the training loop spreads one run over the processes of a job: a ``Parallelism`` chosen once per
run by ``select_parallelism`` and then called by the loop wherever the ways differ.

    strategy = select_parallelism(loop, info, task.contents)  # DataParallelism | FullyShardedParallelism
    strategy.adapt(model)                                      #   | ExpertParallelism
    model.to(device)
    setup = strategy.prepare(model, task, task.trainable(model), loop, device, ckpt, resume, force)
    ... steps: task.loss(setup.train_model, ...); backward; strategy.clip(model, setup.params, max_norm)
    strategy.save(ckpt, model, setup.optimizer, step, elapsed)   # collective; then a barrier
    strategy.finish(model, setup.optimizer, ckpt, step, elapsed, trained)

- ``DataParallelism``: DDP under torchrun (gradients averaged in backward), ``ckpt.pt`` written by rank 0;
  also the single-process case, where DDP and every collective of ``train.distributed`` are no-ops (a
  class of its own would repeat the same code path).
- ``FullyShardedParallelism`` (``LoopConfig.fsdp``): FSDP2 (``train.fsdp``), sharded DCP checkpoints
  ``NAME.dcp`` written by every rank, the model unsharded and ``ckpt.pt`` gathered on rank 0 at the end.
- ``ExpertParallelism`` (``LoopConfig.expert_parallel``): the MoE experts sharded over the ranks, DDP for
  the rest (``train.expert_parallel``); checkpoints hold the full model, gathered from every rank.

What is the same for all (the loss / metrics mean over ranks, barriers, joining and leaving the process
group) stays in ``train.distributed`` and the loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..errors import UsageError
from .checkpoint import CheckpointContents, check_record, restore_optimizer
from .distributed import DistInfo, wrap_ddp
from .expert_parallel import ExpertParallelRun
from . import fsdp as fsdp2
from .gradients import clip_gradients


@dataclass(frozen=True)
class RunCheckpoint:
    """Where and what a run checkpoints: ``path`` (out_dir/ckpt_name; None: the run writes no files), the
    task's checkpoint ``contents`` and ``config``, and the run ``record`` (None: not saved)."""

    path: Optional[Path]
    contents: CheckpointContents
    config: dict
    record: Optional[dict] = None

    @property
    def extra(self) -> dict:
        """The record as keyword arguments of ``contents.save`` (none without a record)."""
        return {"record": self.record} if self.record is not None else {}


@dataclass
class ParallelSetup:
    """What ``Parallelism.prepare`` hands the loop. ``train_model``: what the loss runs on (the DDP wrapper
    or the model); ``optimizer``: over ``params`` (the trainable tensors, sharded ones under FSDP), its
    state restored on resume; ``state``: the checkpoint resumed from (None: a fresh start); ``note``:
    ``check_record``'s note about it."""

    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list
    state: Optional[dict]
    note: Optional[str]


def _record_note(state: Optional[dict], ckpt: RunCheckpoint, path, force: bool) -> Optional[str]:
    return check_record(state.get("record"), ckpt.record, path, force) if state is not None else None


class Parallelism:
    """How one run uses the processes of its job (see the module docstring); ``info``: this process's place."""

    def __init__(self, info: DistInfo):
        self.info = info

    def adapt(self, model: nn.Module) -> None:
        """Change ``model`` itself before it moves to its device (default: nothing)."""

    def prepare(self, model: nn.Module, task, params: list, loop, device: torch.device, ckpt: RunCheckpoint,
                resume: bool, force: bool) -> ParallelSetup:
        """Wrap or shard ``model`` (on ``device``), make the task's optimizer and, with ``resume`` and a
        checkpoint on disk, restore both (``force``: accept another run record)."""
        raise NotImplementedError

    def shown_path(self, path: Optional[Path]) -> Optional[Path]:
        """The checkpoint a run's messages name for ``path`` (default: ``path`` itself)."""
        return path

    def clip(self, model: nn.Module, params: list, max_norm: float) -> torch.Tensor:
        """After the last micro step's backward: the gradients made final, their global L2 norm clipped to
        ``max_norm`` (0: no clipping); returns the norm before clipping, the same on every rank."""
        raise NotImplementedError

    def save(self, ckpt: RunCheckpoint, model: nn.Module, optimizer, step: int, elapsed: Callable[[], float]) -> None:
        """Write the checkpoint of ``step`` (collective: every rank calls it); ``elapsed()``: the run's
        seconds so far."""
        raise NotImplementedError

    def finish(self, model: nn.Module, optimizer, ckpt: RunCheckpoint, step: int, elapsed: Callable[[], float],
               trained: bool) -> None:
        """End of the run (collective; default: nothing): ``trained``: steps ran in this call."""


class DataParallelism(Parallelism):
    """DDP over the ranks (none in one process); rank 0 writes ``contents.save`` checkpoints."""

    def _model_state(self, state: dict, path) -> dict:
        return state

    def _optimizer_state(self, state: dict, model: nn.Module, optimizer, path) -> dict:
        return state

    def _ddp_ignored(self) -> list[str]:
        return []

    def _full_state(self, model: nn.Module, optimizer) -> tuple[object, object]:
        return model, optimizer

    def prepare(self, model, task, params, loop, device, ckpt, resume, force) -> ParallelSetup:
        contents = ckpt.contents
        state = contents.read(ckpt.path) if resume and ckpt.path.exists() else None
        note = _record_note(state, ckpt, ckpt.path, force)
        if state is not None:  # before DDP wraps the model (DDP broadcasts rank 0's weights)
            contents.restore_model(model, self._model_state(state, ckpt.path), ckpt.path)
        ignore = contents.ddp_ignored(model) + self._ddp_ignored()
        ddp_model = wrap_ddp(model, self.info, device, ignore=ignore if self.info.enabled else ())
        optimizer = task.make_optimizer(model)
        if state is not None:
            restore_optimizer(optimizer, self._optimizer_state(state, model, optimizer, ckpt.path), ckpt.path)
        return ParallelSetup(ddp_model, optimizer, params, state, note)

    def clip(self, model, params, max_norm) -> torch.Tensor:
        return clip_gradients(params, max_norm)

    def save(self, ckpt, model, optimizer, step, elapsed) -> None:
        saved_model, saved_opt = self._full_state(model, optimizer)
        if self.info.is_main:
            ckpt.contents.save(ckpt.path, saved_model, saved_opt, step, ckpt.config, world_size=self.info.world_size,
                               elapsed_s=elapsed(), **ckpt.extra)


class ExpertParallelism(DataParallelism):
    """The MoE experts sharded over the ranks, DDP for the rest (``train.expert_parallel``); its
    checkpoints hold the full model (every rank sends its experts, rank 0 writes)."""

    def __init__(self, experts: ExpertParallelRun):
        super().__init__(experts.info)
        self.experts = experts

    def adapt(self, model) -> None:
        self.experts.apply(model)

    def _model_state(self, state, path) -> dict:
        return self.experts.local_model_state(state, path)

    def _optimizer_state(self, state, model, optimizer, path) -> dict:
        return self.experts.local_optimizer_state(state, model, optimizer, path)

    def _ddp_ignored(self) -> list[str]:
        return self.experts.ddp_ignored()

    def _full_state(self, model, optimizer) -> tuple[object, object]:
        return self.experts.gathered(model, optimizer)

    def clip(self, model, params, max_norm) -> torch.Tensor:
        self.experts.finish_grads(model)  # experts' gradients / W (DDP averaged the others)
        return self.experts.clip(model, params, max_norm)


class FullyShardedParallelism(Parallelism):
    """FSDP2 (``train.fsdp``): every rank writes its shards of ``NAME.dcp``; at the end the model is
    unsharded and the final ``ckpt.pt`` gathered on rank 0."""

    def prepare(self, model, task, params, loop, device, ckpt, resume, force) -> ParallelSetup:
        self.keep_sharded = loop.fsdp_keep_sharded
        state, optimizer, params, dcp_path = fsdp2.prepare_fsdp(model, task, loop, self.info, ckpt.path, resume,
                                                                device)
        return ParallelSetup(model, optimizer, params, state, _record_note(state, ckpt, dcp_path, force))

    def shown_path(self, path) -> Optional[Path]:
        return fsdp2.dcp_dir(path) if path is not None else None

    def clip(self, model, params, max_norm) -> torch.Tensor:
        return fsdp2.clip_sharded(params, max_norm)

    def save(self, ckpt, model, optimizer, step, elapsed) -> None:
        meta = fsdp2.run_meta(ckpt.contents, step, ckpt.config, self.info, elapsed(), ckpt.record)
        fsdp2.save_sharded(fsdp2.dcp_dir(ckpt.path), model, optimizer, meta, self.info, ckpt.contents.trainable_only)

    def finish(self, model, optimizer, ckpt, step, elapsed, trained) -> None:
        fields = {"step": step, "config": ckpt.config, "world_size": self.info.world_size, "elapsed_s": elapsed(),
                  **ckpt.extra}
        fsdp2.finish_fsdp(model, optimizer, ckpt.contents, ckpt.path if trained else None, self.info, fields,
                          keep_sharded=getattr(self, "keep_sharded", False))


def select_parallelism(loop, info: DistInfo, contents: CheckpointContents) -> Parallelism:
    """The strategy of a ``LoopConfig``: ``expert_parallel`` set -> ExpertParallelism (UsageError with
    ``fsdp`` or a ``trainable_only`` task), else ``fsdp`` -> FullyShardedParallelism, else DataParallelism
    (one process included). Nothing is checked against the job here: FSDP in one process is refused by
    ``prepare``."""
    if loop.expert_parallel is not None:
        strategy = ExpertParallelism(ExpertParallelRun(loop.expert_parallel, info))
        if loop.fsdp or contents.trainable_only:
            raise UsageError("expert parallelism runs with DDP and whole-model checkpoints: it cannot be combined "
                             "with FSDP or a frozen-base task")
        return strategy
    return FullyShardedParallelism(info) if loop.fsdp else DataParallelism(info)


__all__ = ["DataParallelism", "ExpertParallelism", "FullyShardedParallelism", "ParallelSetup", "Parallelism",
           "RunCheckpoint", "select_parallelism"]
