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
one bit for bit (on CPU; on CUDA where the kernels are deterministic). How the run uses the ranks is
one ``train.parallelism.Parallelism`` chosen from the config: under torchrun the model is wrapped in DDP
and only rank 0 writes files; with ``LoopConfig.fsdp`` it is sharded with FSDP2 instead (``train.fsdp``:
units, mixed precision, sharded DCP checkpoints ``NAME.dcp`` that resume exactly, the model unsharded
again at the end and the final ``ckpt_name`` gathered on rank 0); with ``LoopConfig.expert_parallel`` the
MoE experts are sharded over the ranks (``train.expert_parallel``).
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

from ..errors import BlockscaleError
from ..file_errors import write_text_atomic
from .best_step import BestStep
from .checkpoint import CheckpointContents
from .device import autocast_context
from .distributed import DistInfo, all_reduce_mean, barrier, cleanup_distributed, join_distributed, no_sync
from .fsdp import local_state_bytes
from .metrics import append_metrics, plot_run, truncate_metrics
from .parallelism import RunCheckpoint, select_parallelism
from .progress import ProgressBar


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
    mixed-precision policy's parameter dtype ("fp32" | "bf16"; gradients are reduced in FP32);
    fsdp_cpu_offload: FSDP2's CPU offload policy (an accelerator run); fsdp_keep_sharded: the model stays
    sharded at the end (a trainable-only task whose caller gathers it: ``fsdp.unshard_blockwise``).
    expert_parallel: a ``nn.moe_parallel.CommConfig``: shard the MoE experts over the ranks (with DDP for
    the rest; ``train.expert_parallel``), None: no expert parallelism.
    keep_best: (needs ``eval``) also evaluate before the first step, and at the end put back the trainable
    tensors of the evaluation with the lowest loss, the start included (``train.best_step``); checkpoints
    still hold the last step (a resumed run continues from there)."""

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
    fsdp_cpu_offload: bool = False
    fsdp_keep_sharded: bool = False
    expert_parallel: Optional[object] = None
    keep_best: bool = False

    def __post_init__(self):
        if self.keep_best and not self.eval:
            raise ValueError("LoopConfig.keep_best needs eval=True (the evaluations choose the step)")


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
    the optimizer's tensors at the end; ``best_step`` / ``best_val_loss``: with ``keep_best``, the step whose
    tensors the model holds at the end (``start_step`` when no evaluation beat the start) and its loss."""

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
    best_step: Optional[int] = None
    best_val_loss: Optional[float] = None

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
    run = _Run(model, task, loop, info, device, resume, record)
    run.start(resume, force)
    run.train()
    return run.result()


class _Run:
    """One ``run_training`` call inside its process group: set-up (``start``), the steps (``train``) and
    the end (``result``); the ``Parallelism`` of ``loop`` is chosen once, in ``start``."""

    def __init__(self, model, task, loop, info, device, resume, record):
        self.model, self.task, self.loop, self.info, self.device = model, task, loop, info, device
        self.out = Path(loop.out_dir) if loop.out_dir else None
        if resume and self.out is None:
            raise ValueError("resume=True needs cfg.out_dir")
        self.ckpt = RunCheckpoint(self.out / loop.ckpt_name if self.out else None, task.contents, task.config, record)
        self.metrics_path = self.out / loop.metrics_name if self.out else None
        self.main = info.is_main
        self.losses: list[float] = []
        self.step_seconds: list[float] = []
        self.val_hist: list[tuple[int, float]] = []
        self.train_loss = self.val_loss = None

    def start(self, resume: bool, force: bool) -> None:
        """Choose the parallelism, place the model, resume, prepare out_dir and announce the run."""
        model, task, loop, info = self.model, self.task, self.loop, self.info
        self.strategy = select_parallelism(loop, info, task.contents)
        self.strategy.adapt(model)  # before .to(device): e.g. the new expert shards move with the model
        if not any(p.device.type == "meta" for p in model.parameters()):
            model.to(self.device)
        elif not loop.fsdp:
            raise ValueError("the model is on the meta device: only fsdp=True gives it values (each rank fills its "
                             "own shards from model.initial_values()); build it on a real device otherwise")
        setup = self.strategy.prepare(model, task, task.trainable(model), loop, self.device, self.ckpt, resume, force)
        self.train_model, self.optimizer, self.params, state = (setup.train_model, setup.optimizer, setup.params,
                                                                setup.state)
        self.start_step, self.elapsed0 = 0, 0.0
        if state is not None:
            self.start_step, self.elapsed0 = int(state["step"]), float(state.get("elapsed_s", 0.0))
            task.contents.restore_rng(state, self.device)
        self._prepare_out_dir(state is not None)
        barrier(info)
        self.shown_ckpt = self.strategy.shown_path(self.ckpt.path)
        self.bar = ProgressBar(loop.progress and self.main, loop.steps, self.start_step)
        if self.main and state is not None:
            self.bar.log(_resume_note(state, task, loop, info, self.shown_ckpt, self.start_step))
            if setup.note:
                self.bar.log(setup.note)
        elif resume and self.main:
            self.bar.log(f"no checkpoint in {self.out}; starting from scratch")
        task.begin(self.start_step, info)
        self.amp = autocast_context(loop.autocast, self.device)
        self.tokens_per_step = loop.batch_tokens * loop.grad_accum * info.world_size
        self.good_step = self.start_step if state is not None else None  # the step of the checkpoint on disk, if ours
        self.best = None
        if loop.keep_best:
            self._start_best(state is not None)

    def _start_best(self, resumed: bool) -> None:
        """keep_best: the snapshot written before a resume, else an evaluation of the model as it starts."""
        name = f"best.rank{self.info.rank}.pt" if self.loop.fsdp else "best.pt"
        self.best = BestStep(self.params, self.out / name if self.out is not None else None)
        if resumed and self.best.load(self.start_step):
            return
        if not resumed and self.best.path is not None and self.best.path.exists() and (self.main or self.loop.fsdp):
            self.best.path.unlink()  # ours, from an earlier run in this out_dir
        loss = self.task.evaluate(self.model, self.info, self.device, self.amp, self.loop.progress and self.main)
        self.best.offer(self.start_step, loss)
        self.val_hist.append((self.start_step, loss))
        if self.main:
            self.bar.log(f"step {self.start_step} (the start): eval loss {loss:.4f}")

    def _prepare_out_dir(self, resumed: bool) -> None:
        """Rank 0: out_dir made, the metrics file cut back to the resumed step (or removed), config.json."""
        if not (self.main and self.out is not None):
            return
        self.out.mkdir(parents=True, exist_ok=True)
        if resumed:
            truncate_metrics(self.metrics_path, self.start_step)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        if self.loop.config_json:
            write_text_atomic(self.out / "config.json",
                              json.dumps({**self.task.config, "world_size": self.info.world_size}, indent=1))

    def _elapsed(self) -> float:
        return self.elapsed0 + time.perf_counter() - self.t0

    def train(self) -> None:
        """The optimizer steps from ``start_step`` to ``loop.steps``: log rows, evaluations, checkpoints."""
        loop, model = self.loop, self.model
        self.t0 = self.last_t = time.perf_counter()
        self.last_step = self.start_step
        was_training = model.training
        model.train(loop.train_mode)
        try:
            for step in range(self.start_step, loop.steps):
                ts = time.perf_counter()
                lr, means, norm = self._step(step)
                self.step_seconds.append(time.perf_counter() - ts)
                self.train_loss = means[0]
                self.losses.append(self.train_loss)
                done = step + 1
                self._report(done, lr, means, norm)
                if self.out is not None and (done == loop.steps or
                                             (loop.ckpt_interval and done % loop.ckpt_interval == 0)):
                    self._checkpoint(done)
                self.bar.update(**{"loss": f"{self.train_loss:.4f}", **({"lr": f"{lr:.2e}"} if lr is not None else {})})
        finally:
            self.bar.close()
            model.train(was_training)

    def _step(self, step: int) -> tuple[Optional[float], list[float], torch.Tensor]:
        """One optimizer step (0-based ``step``): (its LR or None, the stats' mean over micro steps and
        ranks, the gradient norm before clipping); TrainingDivergedError before the update when not finite."""
        task, loop, optimizer, info = self.task, self.loop, self.optimizer, self.info
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
            with no_sync(self.train_model, sync=micro == loop.grad_accum - 1):
                with self.amp():
                    loss, stats = task.loss(self.train_model, step, micro, info, self.device)
                (loss.float() / loop.grad_accum).backward()
            sums = stats.detach() if sums is None else sums + stats.detach()
        norm = self.strategy.clip(self.model, self.params, loop.grad_clip)
        means = all_reduce_mean(sums / loop.grad_accum, info).tolist()  # the same on every rank
        if not (math.isfinite(means[0]) and math.isfinite(float(norm))):
            what = (f"the loss is {means[0]}" if not math.isfinite(means[0])
                    else f"the gradient norm is {float(norm)}")
            raise _diverged(what, step + 1, self.shown_ckpt, self.good_step)
        optimizer.step()
        return lr, means, norm

    def _report(self, done: int, lr: Optional[float], means: list[float], norm: torch.Tensor) -> None:
        """After step ``done`` (1-based): the evaluation, metrics row and log line it is due."""
        loop, main = self.loop, self.main
        last = done == loop.steps
        self.val_loss = None
        if loop.eval and (last or (loop.eval_interval and done % loop.eval_interval == 0)):
            self.val_loss = self.task.evaluate(self.model, self.info, self.device, self.amp, loop.progress and main)
            self.val_hist.append((done, self.val_loss))
            if self.best is not None:
                self.best.offer(done, self.val_loss)
        if not (done % loop.log_interval == 0 or self.val_loss is not None or last):
            return
        now = time.perf_counter()
        report = StepReport(step=done, steps=loop.steps, lr=lr, stats=means, grad_norm=float(norm),
                            val_loss=self.val_loss, tokens=done * self.tokens_per_step,
                            elapsed_s=round(self.elapsed0 + now - self.t0, 4),
                            tokens_per_s=round((done - self.last_step) * self.tokens_per_step
                                               / max(now - self.last_t, 1e-9), 1))
        self.last_t, self.last_step = now, done
        if main and self.metrics_path is not None:
            append_metrics(self.metrics_path, self.task.metrics_row(report))
        line = self.task.log_line(report, loop.progress) if main else None
        if line:
            self.bar.log(line)

    def _checkpoint(self, done: int) -> None:
        """The checkpoint of step ``done`` (collective), refused when a trained tensor is not finite."""
        if not _all_finite(self.params, self.info):
            raise _diverged("a trained tensor is not finite after the update", done, self.shown_ckpt, self.good_step)
        self.strategy.save(self.ckpt, self.model, self.optimizer, done, self._elapsed)
        if self.best is not None:
            self.best.save(self.main or self.loop.fsdp)
        barrier(self.info)
        self.good_step = done

    def result(self) -> TrainResult:
        """End of the run (the parallelism's own end, the plot) and what it did."""
        loop, main, out = self.loop, self.main, self.out
        if self.start_step >= loop.steps and loop.eval:  # nothing left to train: just report
            self.val_loss = self.task.evaluate(self.model, self.info, self.device, self.amp, loop.progress and main)
            self.val_hist.append((loop.steps, self.val_loss))
        state_bytes = local_state_bytes(self.optimizer)
        steps = max(loop.steps, self.start_step)
        if self.best is not None and self.best.step != steps and self.best.restore() and main:
            self.bar.log(f"kept step {self.best.step} (eval loss {self.best.loss:.4f}): the lowest evaluation loss; "
                         f"step {steps}'s was {self.val_hist[-1][1]:.4f}")
        self.strategy.finish(self.model, self.optimizer, self.ckpt, steps, self._elapsed, trained=bool(self.losses))
        plot_path = None
        if main and out is not None and loop.plot_name:
            plot_path = plot_run(out / loop.plot_name, self.metrics_path, loop.plot_label or out.name or "run",
                                 loop.plot_title)
        ckpt_path = self.ckpt.path
        return TrainResult(step=steps, start_step=self.start_step, final_train_loss=self.train_loss,
                           final_val_loss=self.val_hist[-1][1] if self.val_hist else None, train_losses=self.losses,
                           val_losses=self.val_hist, tokens=steps * self.tokens_per_step,
                           elapsed_s=self._elapsed(), metrics_path=self.metrics_path,
                           checkpoint_path=ckpt_path if ckpt_path is not None and ckpt_path.exists() else None,
                           plot_path=plot_path, step_seconds=self.step_seconds,
                           trainable_params=sum(p.numel() for p in self.params), optimizer_state_bytes=state_bytes,
                           best_step=self.best.step if self.best is not None else None,
                           best_val_loss=self.best.loss if self.best is not None else None)


__all__ = ["LoopConfig", "StepReport", "TrainResult", "TrainingDivergedError", "TrainingTask", "run_training"]
