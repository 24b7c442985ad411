"""torchrun support: process group set-up from the environment, DDP wrapping, rank-0 helpers.

Single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``): every function here is a no-op, so the
trainer runs the same code either way.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


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
    """Destroy the process group if setup_distributed created it."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()
