"""A command under torchrun (``torchrun --nproc_per_node N -m blockscale.cli quantize ...``).

``ranked(prog, command)`` wraps a command: alone (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) it is the command
itself. Under torchrun every rank joins the job (``train.distributed.setup_distributed``: gloo, or nccl for a
CUDA ``--device``, plain ``cuda`` meaning the rank's own GPU ``cuda:LOCAL_RANK``) and runs the command; the
ranks other than 0 run with their stdout and stderr sent to the null device (no progress bars, warnings or
report lines) and exit 0 when the command returns.

Errors (``ptq.distributed``), each one line ``<prog>: error: ...`` and a non-zero exit on every rank:

- Raised together at a synchronisation point (``synced``: every rank learns there that some rank failed):
  rank 0 prints the first failure (its own message, or ``rank R: <message>`` of the lowest failing rank);
  a failing rank whose own message differs prints ``rank R: <message>`` too. Then every rank waits until
  rank 0 has printed (``after_report``) before it exits, so torchrun, which ends the job when the first
  rank exits, cannot swallow rank 0's line.
- Raised before this process entered any synchronisation point (flags, files, loading the model, reading
  the calibration text: any of it may fail on one rank alone, e.g. a file missing on one node): the rank
  joins the other ranks' next synchronisation point from here with its error (``agree``; for ``quantize``
  that is the preflight of ``quantize_model``, before any calibration), so it is then one raised together.
  A command that returns without entering any joins one with its success.
- Raised by this rank alone later: it prints ``rank R: <message>`` at once (rank 0 without the prefix) and
  leaves the group; a rank waiting for it in a collective then fails with ``RanksLost`` (gloo sees the
  closed connection) or is ended by torchrun.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from ..errors import UsageError
from ..ptq.distributed import after_report, agree, printed_by_rank0, raised_together, sync_points
from ..train.distributed import cleanup_distributed, env_world, setup_distributed
from .checks import check_device
from .reporting import describe


def is_main_rank() -> bool:
    """Rank 0 of a torchrun job, or the only process."""
    return env_world()[0] == 0


def rank_device(device: str) -> str:
    """Under torchrun plain "cuda" means this rank's GPU (cuda:LOCAL_RANK)."""
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def _outcome(exc: BaseException, entered: bool) -> BaseException:
    """The error to report for ``exc``: when this process entered no synchronisation point yet, the one
    raised where it joins the other ranks' next (``agree``), else ``exc``."""
    if entered or raised_together(exc):
        return exc
    try:
        agree(exc)
    except Exception as agreed:  # noqa: BLE001: always raises (this rank failed)
        return agreed if raised_together(agreed) else exc
    return exc


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
        debug = bool(getattr(args, "debug", False))
        start = sync_points()
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
            code = command(args)
            if sync_points() == start:  # the others may be waiting at their first synchronisation point
                agree(None)
            return code
        except Exception as exc:  # noqa: BLE001: every rank's error is reported here (rank 0's with --debug above)
            exc = _outcome(exc, sync_points() > start)
            if debug and not quiet:
                raise exc
            code, msg = describe(exc)
            if not quiet:
                print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
            elif not printed_by_rank0(exc):
                os.write(saved, f"{prog}: error: rank {rank}: {msg}\n".encode())
            if raised_together(exc) and not debug:
                try:
                    after_report()
                except Exception:  # noqa: BLE001: a rank already gone: nothing to wait for
                    pass
            return code
        finally:
            cleanup_distributed(info)
            if saved is not None:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)

    return run


__all__ = ["is_main_rank", "rank_device", "ranked"]
