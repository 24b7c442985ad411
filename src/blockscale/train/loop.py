"""The one training loop: pretraining (``trainer.train``) and LSQ distillation (``lsq.distill``) are two
``TrainingTask``s run by ``run_training``; they differ by their loss, which parameters train (and their
optimizer), their evaluation and what their checkpoints hold, not by a loop of their own.

    result = run_training(model, task, LoopConfig(steps=100, out_dir="runs/x"), device, resume=True)

One optimizer step ``step`` (0-based): the task's LR (if it schedules one) on every param group; the
global torch RNG reseeded from ``task.step_seed(step, rank)`` (if it gives one); ``grad_accum`` micro
steps of ``loss, stats = task.loss(...)``, ``(loss / grad_accum).backward()`` (DDP syncs on the last
one); the global gradient norm of the trainable tensors clipped to ``grad_clip``; ``optimizer.step()``.
A non-finite loss or gradient norm stops the run before ``optimizer.step()``, and a non-finite trained
tensor before a checkpoint is written, with ``TrainingDivergedError`` naming the step: the last good
checkpoint stays as it was.
Logged rows (every ``log_interval`` steps, at evaluations and at the end) carry the mean of ``stats``
over micro steps and ranks. Checkpoints (every ``ckpt_interval`` steps and at the end) hold step,
optimizer, the task's config and run record, and what ``task.contents`` says; resume restores them, so
with batches a pure function of (seed, step, micro step, rank) a resumed run repeats an uninterrupted
one bit for bit (on CPU; on CUDA where the kernels are deterministic). Under torchrun the model is
wrapped in DDP and only rank 0 writes files; with ``LoopConfig.fsdp`` it is sharded with FSDP2 instead
(``train.fsdp``: units, mixed precision, sharded DCP checkpoints ``NAME.dcp`` that resume exactly, the
model unsharded again at the end and the final ``ckpt_name`` gathered on rank 0).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
import torch.nn as nn

from ..errors import BlockscaleError, UsageError
from ..file_errors import write_text_atomic
from .checkpoint import CheckpointContents, check_record, restore_optimizer
from .device import autocast_context
from .distributed import DistInfo, all_reduce_mean, barrier, cleanup_distributed, join_distributed, no_sync, wrap_ddp
from . import fsdp as fsdp2
from .expert_parallel import ExpertParallelRun
from .metrics import append_metrics, plot_run, truncate_metrics
from .progress import ProgressBar
from .gradients import clip_gradients


class TrainingDivergedError(BlockscaleError, RuntimeError):
    """A step's loss or gradient norm, or a trained tensor at a checkpoint, is not finite: the run stops
    there. ``step``: the 1-based step that diverged; ``checkpoint``: the last good checkpoint (None: none
    was written), left as it was."""

    def __init__(self, message: str, step: int, checkpoint: Optional[Path]):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


def _diverged(what: str, step: int, ckpt_path: Optional[Path], good_step: Optional[int]) -> TrainingDivergedError:
    kept = (f"the last good checkpoint, {ckpt_path} (step {good_step}), is kept" if good_step is not None
            else "no checkpoint was written" if ckpt_path is None else f"no good checkpoint was written to {ckpt_path}")
    return TrainingDivergedError(f"training diverged at step {step}: {what}; {kept}. A smaller learning rate (or a "
                                 "smaller gradient clip) may help", step, ckpt_path if good_step is not None else None)


def _all_finite(params, info: DistInfo) -> bool:
    """Whether every trained tensor is finite on every rank (FSDP: each rank checks its shards)."""
    local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in params)
    return float(all_reduce_mean(torch.tensor([0.0 if local else 1.0]), info)[0]) == 0.0


@dataclass(frozen=True)
class LoopConfig:
    """The loop's own settings (each workflow maps its config onto them).

    eval: evaluate at all: every ``eval_interval`` steps (0: none on the way) and after the last step.
    ckpt_interval: a checkpoint every N steps (0: only at the end); out_dir None writes nothing.
    config_json: also write out_dir/config.json (the task's config and the world size). plot_name: the
    loss plot in out_dir (None: none), its legend label (None: the folder's name) and title.
    batch_tokens: tokens per micro step and rank (the "tokens" of a metrics row). train_mode: the model's
    mode while training (False: eval mode, no dropout); its own mode comes back at the end.
    fsdp: shard with FSDP2 (needs torchrun, >= 2 processes) instead of DDP; fsdp_param_dtype: its
    mixed-precision policy's parameter dtype ("fp32" | "bf16"; gradients are reduced in FP32).
    expert_parallel: a ``nn.moe_parallel.CommConfig``: shard the MoE experts over the ranks (with DDP for
    the rest; ``train.expert_parallel``), None: no expert parallelism."""

    steps: int
    grad_accum: int = 1
    grad_clip: float = 1.0
    log_interval: int = 10
    eval: bool = False
    eval_interval: int = 0
    ckpt_interval: int = 0
    out_dir: Optional[str] = None
    ckpt_name: str = "ckpt.pt"
    metrics_name: str = "metrics.jsonl"
    config_json: bool = False
    plot_name: Optional[str] = None
    plot_label: Optional[str] = None
    plot_title: Optional[str] = None
    autocast: str = "none"
    progress: bool = True
    batch_tokens: int = 0
    train_mode: bool = True
    fsdp: bool = False
    fsdp_param_dtype: str = "fp32"
    expert_parallel: Optional[object] = None


@dataclass(frozen=True)
class StepReport:
    """A logged step, for the task to turn into a metrics row and a log line. ``stats``: the mean over
    micro steps and ranks of what ``task.loss`` returned (``stats[0]``: the loss); ``lr``: the scheduled
    LR (None: the task keeps its groups' LRs); elapsed_s / tokens_per_s rounded to 4 / 1 decimals."""

    step: int
    steps: int
    lr: Optional[float]
    stats: list[float]
    grad_norm: float
    val_loss: Optional[float]
    tokens: int
    elapsed_s: float
    tokens_per_s: float


class TrainingTask(Protocol):
    """What the loop trains. ``contents``: what its checkpoints hold; ``config``: its config as plain data
    (checkpoints, config.json, the "config changed since" note on resume)."""

    contents: CheckpointContents
    config: dict

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        """Select the parameters that train (set requires_grad) and return them, in model order."""

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over the trainable parameters (its groups and LRs)."""

    def lr(self, step: int) -> Optional[float]:
        """The LR of every param group at 0-based ``step``; None keeps the groups' own LRs."""

    def step_seed(self, step: int, rank: int) -> Optional[int]:
        """The global torch RNG seed of ``step`` on ``rank`` (dropout ...), or None (no reseeding)."""

    def begin(self, start_step: int, info: DistInfo) -> None:
        """Called once before the first step (after a resume): warnings about the run."""

    def loss(self, model: nn.Module, step: int, micro: int, info: DistInfo,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimize, 1-D tensor of numbers to log: [0] the loss) of one micro step."""

    def evaluate(self, model: nn.Module, info: DistInfo, device: torch.device, amp: Callable, progress: bool) -> float:
        """The evaluation loss (the same on every rank)."""

    def metrics_row(self, report: StepReport) -> dict:
        """The metrics.jsonl row of a logged step."""

    def log_line(self, report: StepReport, progress: bool) -> Optional[str]:
        """What rank 0 prints for a logged step (None: nothing)."""


@dataclass
class TrainResult:
    """What a run did. ``train_losses[i]`` is the loss of step ``start_step + i + 1`` (1-based);
    ``step_seconds[i]`` its wall time; ``trainable_params``: numbers trained; ``optimizer_state_bytes``:
    the optimizer's tensors at the end."""

    step: int
    start_step: int
    final_train_loss: Optional[float]
    final_val_loss: Optional[float]
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0
    elapsed_s: float = 0.0
    metrics_path: Optional[Path] = None
    checkpoint_path: Optional[Path] = None
    plot_path: Optional[Path] = None
    step_seconds: list[float] = field(default_factory=list)
    trainable_params: int = 0
    optimizer_state_bytes: int = 0

    @property
    def already_finished(self) -> bool:
        """A resumed run whose checkpoint was at (or past) ``steps``: nothing was trained."""
        return self.start_step >= self.step and not self.train_losses


def run_training(model: nn.Module, task: TrainingTask, loop: LoopConfig, device: torch.device, *,
                 resume: bool = False, record: Optional[dict] = None, force: bool = False) -> TrainResult:
    """Train ``model`` in place on ``device`` for ``loop.steps`` optimizer steps (see the module docstring).

    resume: continue from ``out_dir/ckpt_name`` if it exists (else start from scratch; ``steps`` is the
    total). record: plain data defining the run beyond its config, saved in the checkpoint; resuming from
    one that records another raises TrainingCheckpointError naming the difference unless ``force``.
    Joins a torchrun job (or an initialized process group) and leaves it if it created it."""
    info = join_distributed(device)
    try:
        return _run(model, task, loop, info, device, resume, record, force)
    finally:
        cleanup_distributed(info)


def _resume_note(state, task, loop, info, ckpt_path, start_step) -> str:
    old = {k: v for k, v in state["config"].items() if task.config.get(k) != v}
    if state.get("world_size", info.world_size) != info.world_size:
        old["world_size"] = state["world_size"]
    return ((f"already finished at step {start_step} (steps {loop.steps}): nothing to train"
             if start_step >= loop.steps else f"resuming from {ckpt_path} at step {start_step}")
            + (f"; config changed since (checkpoint values): {old}" if old else ""))


def _run(model, task, loop, info, device, resume, record, force) -> TrainResult:
    out = Path(loop.out_dir) if loop.out_dir else None
    if resume and out is None:
        raise ValueError("resume=True needs cfg.out_dir")
    ckpt_path = out / loop.ckpt_name if out else None
    metrics_path = out / loop.metrics_name if out else None
    main, contents = info.is_main, task.contents

    ep = ExpertParallelRun(loop.expert_parallel, info) if loop.expert_parallel is not None else None
    if ep is not None:
        if loop.fsdp or contents.trainable_only:
            raise UsageError("expert parallelism runs with DDP and whole-model checkpoints: it cannot be combined "
                             "with FSDP or a frozen-base task")
        ep.apply(model)  # before .to(device): the new expert shards move with the model
    model.to(device)
    params = task.trainable(model)
    if loop.fsdp:
        state, optimizer, params, dcp_path = fsdp2.prepare_fsdp(model, task, loop, info, ckpt_path, resume)
        note = check_record(state.get("record"), record, dcp_path, force) if state is not None else None
        ddp_model = model
    else:
        dcp_path = None
        state = contents.read(ckpt_path) if resume and ckpt_path.exists() else None
        note = check_record(state.get("record"), record, ckpt_path, force) if state is not None else None
        if state is not None:  # before DDP wraps the model (DDP broadcasts rank 0's weights)
            contents.restore_model(model, ep.local_model_state(state, ckpt_path) if ep is not None else state,
                                   ckpt_path)
        ignore = contents.ddp_ignored(model) + (ep.ddp_ignored() if ep is not None else [])
        ddp_model = wrap_ddp(model, info, device, ignore=ignore if info.enabled else ())
        optimizer = task.make_optimizer(model)
    start_step, elapsed0 = 0, 0.0
    if state is not None:
        if not loop.fsdp:
            restore_optimizer(optimizer, ep.local_optimizer_state(state, model, optimizer, ckpt_path)
                              if ep is not None else state, ckpt_path)
        start_step, elapsed0 = int(state["step"]), float(state.get("elapsed_s", 0.0))
        contents.restore_rng(state, device)
    if main and out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if state is not None:
            truncate_metrics(metrics_path, start_step)
        elif metrics_path.exists():
            metrics_path.unlink()
        if loop.config_json:
            write_text_atomic(out / "config.json", json.dumps({**task.config, "world_size": info.world_size}, indent=1))
    barrier(info)

    bar = ProgressBar(loop.progress and main, loop.steps, start_step)
    if main and state is not None:
        bar.log(_resume_note(state, task, loop, info, dcp_path if loop.fsdp else ckpt_path, start_step))
        if note:
            bar.log(note)
    elif resume and main:
        bar.log(f"no checkpoint in {out}; starting from scratch")
    task.begin(start_step, info)

    amp = autocast_context(loop.autocast, device)
    tokens_per_step = loop.batch_tokens * loop.grad_accum * info.world_size
    losses: list[float] = []
    step_seconds: list[float] = []
    val_hist: list[tuple[int, float]] = []
    t0 = last_t = time.perf_counter()
    last_step = start_step
    good_step = start_step if state is not None else None  # the step of the checkpoint on disk, if ours
    shown_ckpt = fsdp2.dcp_dir(ckpt_path) if loop.fsdp and ckpt_path is not None else ckpt_path
    train_loss = val_loss = None
    was_training = model.training
    model.train(loop.train_mode)
    try:
        for step in range(start_step, loop.steps):
            ts = time.perf_counter()
            lr = task.lr(step)
            if lr is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            seed = task.step_seed(step, info.rank)
            if seed is not None:
                torch.manual_seed(seed)
            optimizer.zero_grad(set_to_none=True)
            sums = None
            for micro in range(loop.grad_accum):
                with no_sync(ddp_model, sync=micro == loop.grad_accum - 1):
                    with amp():
                        loss, stats = task.loss(ddp_model, step, micro, info, device)
                    (loss.float() / loop.grad_accum).backward()
                sums = stats.detach() if sums is None else sums + stats.detach()
            if ep is not None:
                ep.finish_grads(model)  # experts' gradients / W (DDP averaged the others)
            norm = fsdp2.clip_sharded(params, loop.grad_clip) if loop.fsdp else \
                ep.clip(model, params, loop.grad_clip) if ep is not None else clip_gradients(params, loop.grad_clip)
            means = all_reduce_mean(sums / loop.grad_accum, info).tolist()  # the same on every rank
            if not (math.isfinite(means[0]) and math.isfinite(float(norm))):
                what = (f"the loss is {means[0]}" if not math.isfinite(means[0])
                        else f"the gradient norm is {float(norm)}")
                raise _diverged(what, step + 1, shown_ckpt, good_step)
            optimizer.step()
            step_seconds.append(time.perf_counter() - ts)
            train_loss = means[0]
            losses.append(train_loss)

            done = step + 1
            last = done == loop.steps
            val_loss = None
            if loop.eval and (last or (loop.eval_interval and done % loop.eval_interval == 0)):
                val_loss = task.evaluate(model, info, device, amp, loop.progress and main)
                val_hist.append((done, val_loss))
            if done % loop.log_interval == 0 or val_loss is not None or last:
                now = time.perf_counter()
                report = StepReport(step=done, steps=loop.steps, lr=lr, stats=means, grad_norm=float(norm),
                                    val_loss=val_loss, tokens=done * tokens_per_step,
                                    elapsed_s=round(elapsed0 + now - t0, 4),
                                    tokens_per_s=round((done - last_step) * tokens_per_step / max(now - last_t, 1e-9),
                                                       1))
                last_t, last_step = now, done
                if main and metrics_path is not None:
                    append_metrics(metrics_path, task.metrics_row(report))
                line = task.log_line(report, loop.progress) if main else None
                if line:
                    bar.log(line)
            if out is not None and (last or (loop.ckpt_interval and done % loop.ckpt_interval == 0)):
                if not _all_finite(params, info):
                    raise _diverged("a trained tensor is not finite after the update", done, shown_ckpt, good_step)
                if loop.fsdp:  # every rank writes its shards
                    fsdp2.save_sharded(fsdp2.dcp_dir(ckpt_path), model, optimizer, fsdp2.run_meta(
                        contents, done, task.config, info, elapsed0 + time.perf_counter() - t0, record), info,
                        contents.trainable_only)
                elif main or ep is not None:  # expert parallel: every rank sends its experts to the full state
                    saved_model, saved_opt = ep.gathered(model, optimizer) if ep is not None else (model, optimizer)
                    if main:
                        contents.save(ckpt_path, saved_model, saved_opt, done, task.config,
                                      world_size=info.world_size, elapsed_s=elapsed0 + time.perf_counter() - t0,
                                      **({"record": record} if record is not None else {}))
                barrier(info)
                good_step = done
            bar.update(**{"loss": f"{train_loss:.4f}", **({"lr": f"{lr:.2e}"} if lr is not None else {})})
    finally:
        bar.close()
        model.train(was_training)

    if start_step >= loop.steps and loop.eval:  # nothing left to train: just report
        val_loss = task.evaluate(model, info, device, amp, loop.progress and main)
        val_hist.append((loop.steps, val_loss))
    state_bytes = fsdp2.local_state_bytes(optimizer)
    if loop.fsdp:  # back to the plain model; the final checkpoint gathered on rank 0 (as without --fsdp)
        fsdp2.finish_fsdp(model, optimizer, contents, ckpt_path if out is not None and losses else None, info,
                          {"step": max(loop.steps, start_step), "config": task.config, "world_size": info.world_size,
                           "elapsed_s": elapsed0 + time.perf_counter() - t0,
                           **({"record": record} if record is not None else {})})
    plot_path = None
    if main and out is not None and loop.plot_name:
        plot_path = plot_run(out / loop.plot_name, metrics_path, loop.plot_label or out.name or "run", loop.plot_title)
    steps = max(loop.steps, start_step)
    return TrainResult(step=steps, start_step=start_step, final_train_loss=train_loss,
                       final_val_loss=val_hist[-1][1] if val_hist else None, train_losses=losses,
                       val_losses=val_hist, tokens=steps * tokens_per_step,
                       elapsed_s=elapsed0 + time.perf_counter() - t0, metrics_path=metrics_path,
                       checkpoint_path=ckpt_path if ckpt_path is not None and ckpt_path.exists() else None,
                       plot_path=plot_path, step_seconds=step_seconds,
                       trainable_params=sum(p.numel() for p in params), optimizer_state_bytes=state_bytes)


__all__ = ["LoopConfig", "StepReport", "TrainResult", "TrainingDivergedError", "TrainingTask", "run_training"]
