"""A command under torchrun (``torchrun --nproc_per_node N -m blockscale.cli quantize ...``).

``ranked(prog, command)`` wraps a command: alone (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) it is the command
itself. Under torchrun every rank joins the job (``train.distributed.setup_distributed``: gloo, or nccl for a
CUDA ``--device``, plain ``cuda`` meaning the rank's own GPU ``cuda:LOCAL_RANK``) and runs the command; the
ranks other than 0 run with their stdout and stderr sent to the null device (no progress bars, warnings or
report lines) and exit 0 when the command returns. Errors: rank 0 prints its one line as every command does;
another rank prints nothing for an error every rank raised together (``ptq.distributed.printed_by_rank0``:
rank 0 prints it) and one line ``<prog>: error: rank R: <message>`` for a failure of its own; either way
its exit code is the error's. (torchrun then ends the other ranks and prints its own summary of the failed
job.)
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from ..errors import UsageError
from ..ptq.distributed import printed_by_rank0
from ..train.distributed import cleanup_distributed, env_world, setup_distributed
from .checks import check_device
from .reporting import describe


def is_main_rank() -> bool:
    """Rank 0 of a torchrun job, or the only process."""
    return env_world()[0] == 0


def ranked(prog: str, command: Callable, alone: tuple[str, ...] = ()) -> Callable:
    """``command(args)`` (its ``args.device`` read) as described in the module docstring. ``alone``: flags
    (``--streaming``) that run in one process only: given under torchrun, a UsageError naming the flag."""

    @functools.wraps(command)
    def run(args) -> int:
        rank, world, local = env_world()
        if world <= 1:
            return command(args)
        for flag in alone:
            if getattr(args, flag.lstrip("-").replace("-", "_"), None):
                raise UsageError(f"{flag} runs in one process, not under torchrun (WORLD_SIZE={world}): run it "
                                 "without torchrun, or leave out the flag for data-parallel calibration")
        device = check_device(args.device)
        if device == "cuda":
            args.device = f"cuda:{local}"
        info = setup_distributed(str(args.device or "cpu"))
        quiet = rank != 0
        saved = None
        if quiet:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.close(null)
        try:
            return command(args)
        except Exception as exc:  # noqa: BLE001: rank 0's error goes to run_reported, the others' here
            if not quiet:
                raise
            code, msg = describe(exc)
            if not printed_by_rank0(exc):
                os.write(saved, f"{prog}: error: rank {rank}: {msg}\n".encode())
            return code
        finally:
            cleanup_distributed(info)
            if saved is not None:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)

    return run


__all__ = ["is_main_rank", "ranked"]
