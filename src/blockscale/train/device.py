"""Where a run computes: the device a name means (under torchrun too) and the forward pass's autocast."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch


def resolve_device(name: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """"auto" -> cuda if available else cpu; under torchrun plain "cuda" means cuda:LOCAL_RANK.
    ValueError for a name torch does not know or a CUDA device this machine lacks."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={name!r}: not a device name ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank if world_size > 1 else torch.cuda.current_device())
    return dev


def autocast_context(mode: str, device: torch.device) -> Callable:
    """A zero-argument factory of the forward-pass autocast context for ``mode`` on ``device``."""
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "none"
    if mode == "none":
        return nullcontext
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("autocast='bf16' but this GPU does not support bf16")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"autocast='bf16' is supported on cuda and cpu, not {device.type}")
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


__all__ = ["autocast_context", "resolve_device"]
