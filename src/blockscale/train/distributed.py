"""torchrun support: process group set-up from the environment, DDP wrapping, rank-0 helpers.

Single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``): every function here is a no-op, so the
trainer runs the same code either way.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NoReturn, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import UsageError


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job. ``owns_group``: setup_distributed created the process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment variables (0, 1, 0 when absent)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def setup_distributed(device: str = "cpu") -> DistInfo:
    """Join the torchrun job if WORLD_SIZE > 1: nccl for a CUDA ``device`` (and select
    cuda:LOCAL_RANK), gloo otherwise. Reuses a process group the caller already initialized."""
    rank, world, local = env_world()
    if world <= 1:
        return DistInfo()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    owns = False
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:  # (torch's own error names one variable, as an internal error)
            raise UsageError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                             " not: launch the job with torchrun (torchrun --nproc_per_node N -m blockscale.cli ...),"
                             " or unset WORLD_SIZE for one process")
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        owns = True
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, owns_group=owns)


def join_distributed(device) -> DistInfo:
    """This process's place in a process group the caller already initialized, else ``setup_distributed``
    (joins a torchrun job when WORLD_SIZE > 1, else a no-op)."""
    if dist.is_available() and dist.is_initialized():
        return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=env_world()[2])
    return setup_distributed(str(device))


def wrap_ddp(model: nn.Module, info: DistInfo, device: torch.device, ignore: Sequence[str] = ()) -> nn.Module:
    """DDP(model) when distributed (gradients are averaged over ranks in backward), else model.
    ``ignore``: names of parameters and buffers DDP neither broadcasts nor syncs."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def no_sync(model: nn.Module, sync: bool):
    """Context for one micro-step: skip DDP's gradient all-reduce unless ``sync`` (the last micro-step)."""
    return model.no_sync() if (not sync and hasattr(model, "no_sync")) else nullcontext()


def all_reduce_mean(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Mean of a tensor over ranks (a copy; the input is untouched). Identity when not distributed."""
    if not info.enabled:
        return x
    y = x.detach().clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y / info.world_size


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup_distributed(info: DistInfo) -> None:
    """Destroy the process group if setup_distributed created it (see ``exit_process`` for how a rank ends)."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with exit status ``code``. A rank of a multi-process job (``WORLD_SIZE`` > 1) ends
    without interpreter finalisation, after flushing its output: the process group outlives
    ``destroy_process_group`` while FSDP2's state still references it, and a gloo worker thread that drops
    the last reference to a collective's tensors once finalisation has begun needs the GIL, cannot have it,
    and aborts the process ("terminate called without an active exception", SIGABRT; a known torch issue,
    pytorch/pytorch#190489). It happened in about 1 run in 8 of a 2-rank ``learn-scales --fsdp``, always
    after the run's files were written. Single-process runs exit normally."""
    if env_world()[1] <= 1:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)
