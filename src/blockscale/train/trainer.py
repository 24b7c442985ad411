"""Pretraining loop for decoder LMs: AdamW, warmup + cosine LR, clipping, accumulation, DDP,
JSONL metrics, atomic checkpoints and exact resume.

    result = train(model, load_data("tinystories"), TrainConfig(steps=200, out_dir="runs/x"))
    result = train(model, data, cfg, resume=True)        # continue from runs/x/ckpt.pt

A model is any ``nn.Module`` with ``forward(idx, targets) -> (logits, loss)`` (loss: mean over
tokens). ``data`` is anything with ``TokenData.get_batch``'s signature.

Exact resume: batches are a pure function of (seed, step, micro_step, rank) (see ``data.py``) and
the global torch RNG is reseeded from (seed, step, rank) at the start of every step (dropout etc.),
so a run restored from the checkpoint after step k (model, optimizer, step) repeats an
uninterrupted run bit for bit (on CPU; on CUDA only where the kernels are deterministic).
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from .checkpoint import (CKPT_FORMAT, CheckpointError, _load_into, check_record, load_checkpoint,  # noqa: F401
                         load_weights_only, save_atomic, save_checkpoint)
from .data import derive_seed
from .distributed import (DistInfo, all_reduce_mean, barrier, cleanup_distributed, env_world, no_sync,
                          setup_distributed, wrap_ddp)

CKPT_NAME = "ckpt.pt"
METRICS_NAME = "metrics.jsonl"
VAL_SEED = 0  # val batches do not depend on cfg.seed, so runs with different seeds compare on one set
_RNG_TAG = 3  # derive_seed part for the per-step torch RNG (1, 2 are the data splits)


@dataclass
class TrainConfig:
    """Hyperparameters. Batch per optimizer step = batch_size * grad_accum * world_size sequences.

    warmup_steps: LR rises linearly to ``lr``, then follows a cosine to ``min_lr`` at ``steps``.
    grad_clip: max global grad norm (0 disables). eval_interval / ckpt_interval: every N steps
    (0: only at the end). eval_batches: fixed val batches per evaluation (0: no evaluation).
    autocast: "auto" (bf16 on CUDA with bf16 support, else none) | "bf16" (also on CPU: opt-in,
    slow there) | "none". device: "auto" | "cpu" | "cuda" | "cuda:N". out_dir: None writes nothing.
    progress: a step bar (and one per evaluation). plot: also write out_dir/loss.png (needs matplotlib;
    skipped without it). A warmup of at least ``steps`` warns once (the LR never reaches ``lr``).
    Every value is checked (``check_train_values``): finite floats (lr > 0, 0 <= min_lr <= lr, betas in
    [0, 1)), integers in range, batch_size * seq_len bounded; anything else is a ValueError naming the field.
    """

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_batches: int = 20
    seed: int = 1337
    out_dir: Optional[str] = None
    ckpt_interval: int = 0
    autocast: str = "auto"
    device: str = "auto"
    log_interval: int = 10
    progress: bool = True
    plot: bool = True

    def __post_init__(self):
        if self.out_dir is not None:
            self.out_dir = str(self.out_dir)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"TrainConfig.betas={self.betas!r}: expected two numbers in [0, 1)")
        check_train_values({f.name: getattr(self, f.name) for f in fields(self)})
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        self.lr, self.min_lr = float(self.lr), float(self.min_lr)

    def to_dict(self) -> dict:
        """Plain primitives only (what checkpoints and config.json store)."""
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class TrainResult:
    """What ``train`` did. ``train_losses[i]`` is the loss of step ``start_step + i + 1`` (1-based)."""

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

    @property
    def already_finished(self) -> bool:
        """A resumed run whose checkpoint was at (or past) ``steps``: nothing was trained."""
        return self.start_step >= self.step and not self.train_losses


# bounds of TrainConfig's numbers: integers name -> (lowest, highest); floats name -> (lowest, lowest excluded)
_INT_LIMITS = {"steps": (1, 1 << 31), "batch_size": (1, 1 << 16), "seq_len": (1, 1 << 20), "grad_accum": (1, 1 << 16),
               "log_interval": (1, 1 << 31), "warmup_steps": (0, 1 << 31), "eval_interval": (0, 1 << 31),
               "eval_batches": (0, 1 << 20), "ckpt_interval": (0, 1 << 31), "seed": (0, (1 << 63) - 1)}
_FLOAT_LIMITS = {"lr": (0.0, True), "min_lr": (0.0, False), "weight_decay": (0.0, False), "grad_clip": (0.0, False)}
MAX_BATCH_TOKENS = 1 << 24  # batch_size * seq_len tokens per micro step (logits: x vocabulary)
DEVICE_NAMES = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def _config_label(name: str, value) -> str:
    return f"TrainConfig.{name}={value!r}"


def check_train_values(values: dict, label: Callable[[str, object], str] = _config_label,
                       error: type = ValueError) -> None:
    """Raise ``error`` naming the first bad TrainConfig value: integers within ``_INT_LIMITS``, finite
    floats within ``_FLOAT_LIMITS`` (lr > 0, 0 <= min_lr <= lr), betas two numbers in [0, 1),
    batch_size * seq_len <= MAX_BATCH_TOKENS, a known autocast mode and device name. ``label(name, value)``
    names a value in the message ("TrainConfig.lr=nan"; the command line passes "--lr nan")."""
    for name, (lo, hi) in _INT_LIMITS.items():
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise error(f"{label(name, v)}: expected an integer")
        if not lo <= v <= hi:
            raise error(f"{label(name, v)}: expected an integer in [{lo}, {hi:,}]")
    for name, (lo, strict) in _FLOAT_LIMITS.items():
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                (v <= lo if strict else v < lo):
            raise error(f"{label(name, v)}: expected a finite number {'>' if strict else '>='} {lo:g}")
    if values["min_lr"] > values["lr"]:
        raise error(f"{label('min_lr', values['min_lr'])}: expected at most {label('lr', values['lr'])} (the "
                    "cosine decays from lr to min_lr)")
    betas = values["betas"]
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas):
        raise error(f"{label('betas', tuple(betas))}: expected two finite numbers in [0, 1)")
    tokens = values["batch_size"] * values["seq_len"]
    if tokens > MAX_BATCH_TOKENS:
        raise error(f"{label('batch_size', values['batch_size'])} x {label('seq_len', values['seq_len'])} = "
                    f"{tokens:,} tokens per micro step: at most {MAX_BATCH_TOKENS:,}")
    if values["autocast"] not in ("auto", "bf16", "none"):
        raise error(f"{label('autocast', values['autocast'])}: expected 'auto', 'bf16' or 'none'")
    device = values["device"]
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?", device):
        raise error(f"{label('device', device)}: expected {DEVICE_NAMES}")


def get_lr(step: int, cfg: TrainConfig) -> float:
    """LR of 0-based ``step``: lr*(step+1)/warmup_steps during warmup, then a cosine from lr (at
    step == warmup_steps) to min_lr (at step == steps; min_lr after)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * t))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on parameters with >= 2 dims (matrices, embeddings), none on gains/biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas)


def grad_norm(parameters) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32)."""
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0: no clipping); returns the
    norm before clipping."""
    parameters = list(parameters)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return grad_norm(parameters)


# ----------------------------------------------------------------------------- metrics

def read_metrics(path: Union[str, Path]) -> list[dict]:
    """The JSON objects of a metrics file, skipping a torn last line."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines with step <= ``step`` (lines logged after the checkpoint we resume from)."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)


def plot_losses(metrics_paths: dict, out_png: Union[str, Path], title: Optional[str] = None,
                x: str = "step") -> Path:
    """Plot train (solid) and val (dashed, markers) loss of one or more runs in one PNG.

    metrics_paths: {label: metrics.jsonl path}; x: "step" or "tokens". Uses the Agg canvas directly
    (no pyplot, no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if x not in ("step", "tokens"):
        raise ValueError(f"x={x!r}: expected 'step' or 'tokens'")
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, path) in enumerate(metrics_paths.items()):
        rows = read_metrics(path)
        color = f"C{i % 10}"
        tr = [(r[x], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        va = [(r[x], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if tr:
            ax.plot(*zip(*tr), color=color, alpha=0.8, label=f"{label} train")
        if va:
            ax.plot(*zip(*va), color=color, linestyle="--", marker="o", markersize=3, label=f"{label} val")
    ax.set_xlabel(x)
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


# ----------------------------------------------------------------------------- training

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


@torch.no_grad()
def evaluate(model: nn.Module, data, cfg: TrainConfig, info: DistInfo = DistInfo(),
             device: Union[str, torch.device] = "cpu", amp: Callable = nullcontext, progress: bool = False) -> float:
    """Mean loss over ``cfg.eval_batches`` fixed val batches (rows split over ranks, mean over ranks);
    ``progress``: its own bar ("validation", removed when done)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    batches = range(cfg.eval_batches)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="validation", unit="batch", leave=False, dynamic_ncols=True)
    for j in batches:
        x, y = data.get_batch("val", cfg.batch_size, cfg.seq_len, step=j, rank=info.rank,
                              world_size=info.world_size, seed=VAL_SEED)
        with amp():
            _, loss = model(x.to(device), y.to(device))
        total += loss.float()
    model.train(was_training)
    return all_reduce_mean(total / cfg.eval_batches, info).item()


class _Bar:
    """tqdm when available and wanted, else a silent stand-in; ``log`` prints above the bar."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.tqdm = None
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.tqdm = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, **postfix):
        if self.tqdm is not None:
            self.tqdm.set_postfix(postfix, refresh=False)
            self.tqdm.update(1)

    def log(self, msg: str):
        if self.tqdm is not None:
            self.tqdm.write(msg)
        else:
            print(msg, flush=True)

    def close(self):
        if self.tqdm is not None:
            self.tqdm.close()


def train(model: nn.Module, data, cfg: TrainConfig,
          optimizer_factory: Optional[Callable[[nn.Module, TrainConfig], torch.optim.Optimizer]] = None,
          resume: bool = False, *, record: Optional[dict] = None, force: bool = False) -> TrainResult:
    """Train ``model`` in place for ``cfg.steps`` optimizer steps; returns a TrainResult.

    optimizer_factory(model, cfg) -> optimizer (default ``make_optimizer``); the LR of every param
    group is set to get_lr(step) each step. resume: continue from ``out_dir/ckpt.pt`` if it exists
    (else start from scratch). Under torchrun (WORLD_SIZE > 1) joins the job, wraps the model in
    DDP, and only rank 0 writes files. Writes (if out_dir): metrics.jsonl, config.json, ckpt.pt.
    record: plain data defining the run beyond ``cfg`` (the command line records {"recipe": recipe dict or
    None, "model": model config}), saved in the checkpoint; on resume a checkpoint recording another one
    raises CheckpointError naming the difference unless ``force`` (one without a record: a note).
    Side effect: reseeds the global torch RNG at every step (see the module docstring).
    """
    _, world, local = env_world()
    device = resolve_device(cfg.device, local, world)
    info = setup_distributed(str(device))
    try:
        return _train(model, data, cfg, optimizer_factory, resume, info, device, record, force)
    finally:
        cleanup_distributed(info)


def _train(model, data, cfg, optimizer_factory, resume, info, device, record=None, force=False) -> TrainResult:
    out = Path(cfg.out_dir) if cfg.out_dir else None
    if resume and out is None:
        raise ValueError("resume=True needs cfg.out_dir")
    ckpt_path = out / CKPT_NAME if out else None
    metrics_path = out / METRICS_NAME if out else None
    main = info.is_main
    bar = None

    model.to(device)
    state = load_checkpoint(ckpt_path) if resume and ckpt_path.exists() else None
    note = check_record(state.get("record"), record, ckpt_path, force) if state is not None else None
    if state is not None:  # before DDP wraps the model (DDP broadcasts rank 0's weights)
        _load_into(model, state["model"], "model", ckpt_path)
    ddp_model = wrap_ddp(model, info, device)
    optimizer = (optimizer_factory or make_optimizer)(model, cfg)
    start_step, elapsed0 = 0, 0.0
    if state is not None:
        _load_into(optimizer, state["optimizer"], "optimizer", ckpt_path)
        start_step, elapsed0 = int(state["step"]), float(state.get("elapsed_s", 0.0))
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if main and out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if state is not None:
            _truncate_metrics(metrics_path, start_step)
        elif metrics_path.exists():
            metrics_path.unlink()
        (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": info.world_size}, indent=1))
    barrier(info)

    bar = _Bar(cfg.progress and main, cfg.steps, start_step)
    if state is not None:
        old = {k: v for k, v in state["config"].items() if cfg.to_dict().get(k) != v}
        if state.get("world_size", info.world_size) != info.world_size:
            old["world_size"] = state["world_size"]
        if main:
            bar.log((f"already finished at step {start_step} (steps {cfg.steps}): nothing to train"
                     if start_step >= cfg.steps else f"resuming from {ckpt_path} at step {start_step}")
                    + (f"; config changed since (checkpoint values): {old}" if old else ""))
            if note:
                bar.log(note)
    elif resume and main:
        bar.log(f"no checkpoint in {out}; starting from scratch")
    if main and cfg.warmup_steps >= cfg.steps > start_step:
        warnings.warn(f"warmup_steps {cfg.warmup_steps} >= steps {cfg.steps}: the learning rate never reaches its "
                      f"peak {cfg.lr:g} (lower --warmup-steps, e.g. to {max(1, cfg.steps // 10)})", RuntimeWarning,
                      stacklevel=3)

    amp = autocast_context(cfg.autocast, device)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * info.world_size
    losses: list[float] = []
    val_hist: list[tuple[int, float]] = []
    t0 = last_t = time.perf_counter()
    last_step = start_step
    train_loss = val_loss = None
    model.train()
    try:
        for step in range(start_step, cfg.steps):
            lr = get_lr(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            torch.manual_seed(derive_seed(cfg.seed, _RNG_TAG, step, info.rank))
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = data.get_batch("train", cfg.batch_size, cfg.seq_len, step, rank=info.rank,
                                      world_size=info.world_size, seed=cfg.seed, micro_step=micro)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with no_sync(ddp_model, sync=micro == cfg.grad_accum - 1):
                    with amp():
                        _, loss = ddp_model(x, y)
                    (loss.float() / cfg.grad_accum).backward()
                loss_sum += loss.detach().float()
            norm = clip_gradients(model.parameters(), cfg.grad_clip)
            optimizer.step()
            train_loss = all_reduce_mean(loss_sum / cfg.grad_accum, info).item()
            losses.append(train_loss)

            done = step + 1
            last = done == cfg.steps
            val_loss = None
            if cfg.eval_batches and (last or (cfg.eval_interval and done % cfg.eval_interval == 0)):
                val_loss = evaluate(model, data, cfg, info, device, amp, progress=cfg.progress and main)
                val_hist.append((done, val_loss))
            if done % cfg.log_interval == 0 or val_loss is not None or last:
                now = time.perf_counter()
                row = {"step": done, "lr": lr, "train_loss": train_loss, "val_loss": val_loss,
                       "grad_norm": float(norm), "tokens": done * tokens_per_step,
                       "elapsed_s": round(elapsed0 + now - t0, 4),
                       "tokens_per_s": round((done - last_step) * tokens_per_step / max(now - last_t, 1e-9), 1)}
                if val_loss is None:
                    del row["val_loss"]
                last_t, last_step = now, done
                if main and metrics_path is not None:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                if main and (val_loss is not None or not cfg.progress):
                    bar.log(f"step {done}/{cfg.steps}  lr {lr:.3e}  train {train_loss:.4f}"
                            + (f"  val {val_loss:.4f}" if val_loss is not None else "")
                            + f"  {row['tokens_per_s']:.0f} tok/s")
            if out is not None and (last or (cfg.ckpt_interval and done % cfg.ckpt_interval == 0)):
                if main:
                    save_checkpoint(ckpt_path, model, optimizer, done, cfg, world_size=info.world_size,
                                    elapsed_s=elapsed0 + time.perf_counter() - t0,
                                    **({"record": record} if record is not None else {}))
                barrier(info)
            bar.update(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}")
    finally:
        bar.close()

    if start_step >= cfg.steps and cfg.eval_batches:  # nothing left to train: just report
        val_loss = evaluate(model, data, cfg, info, device, amp, progress=cfg.progress and main)
        val_hist.append((cfg.steps, val_loss))
    plot_path = _plot(out / "loss.png", metrics_path) if main and out is not None and cfg.plot else None
    return TrainResult(step=max(cfg.steps, start_step), start_step=start_step, final_train_loss=train_loss,
                       final_val_loss=val_hist[-1][1] if val_hist else None, train_losses=losses,
                       val_losses=val_hist, tokens=max(cfg.steps, start_step) * tokens_per_step,
                       elapsed_s=elapsed0 + time.perf_counter() - t0, metrics_path=metrics_path,
                       checkpoint_path=ckpt_path if ckpt_path is not None and ckpt_path.exists() else None,
                       plot_path=plot_path)


def _plot(png: Path, metrics_path: Path) -> Optional[Path]:
    """out_dir/loss.png of the run's metrics; None without matplotlib or metrics."""
    if not metrics_path.exists():
        return None
    try:
        return Path(plot_losses({png.parent.name or "run": metrics_path}, png))
    except ImportError:
        return None
