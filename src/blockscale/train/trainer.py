"""Pretraining of decoder LMs on the one training loop (``loop.run_training``, as a ``PretrainTask``):
AdamW, warmup + cosine LR, clipping, accumulation, DDP, JSONL metrics, atomic checkpoints, exact resume.

    result = train(model, load_data("tinystories"), TrainConfig(steps=200, out_dir="runs/x"))
    result = train(model, data, cfg, resume=True)        # continue from runs/x/ckpt.pt

A model is any ``nn.Module`` with ``forward(idx, targets) -> (logits, loss)`` (loss: mean over
tokens). ``data`` is anything with ``TokenData.get_batch``'s signature.

Exact resume: batches are a pure function of (seed, step, micro_step, rank) (see ``token_data.py``) and
the global torch RNG is reseeded from (seed, step, rank) at the start of every step (dropout etc.),
so a run restored from the checkpoint after step k (model, optimizer, step) repeats an
uninterrupted run bit for bit (on CPU; on CUDA only where the kernels are deterministic).
"""
from __future__ import annotations

import math
import re
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from ..eval.next_token import next_token_loss
from .checkpoint import CheckpointContents
from .token_data import derive_seed
from .device import autocast_context, resolve_device  # noqa: F401  (blockscale.train.trainer.autocast_context)
from .distributed import DistInfo, env_world
from .fsdp import check_cpu_offload, checkpoint_blocks
from .expert_parallel import comm_record
from .gradients import clip_gradients, grad_norm  # noqa: F401
from .loop import LoopConfig, StepReport, TrainResult, run_training
from .metrics import plot_losses, read_metrics  # noqa: F401

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
    fsdp: shard the model with FSDP2 per decoder block instead of DDP (under torchrun, >= 2 processes;
    ``train.fsdp``; the model is built on the meta device and each rank fills only its own shards);
    fsdp_param_dtype: "fp32" (no casts) or "bf16" (parameters all-gathered in bf16; gradients reduced in
    FP32); fsdp_cpu_offload: FSDP2's CPU offload policy (needs fsdp and a GPU device);
    activation_checkpointing: each decoder block's activations recomputed in backward instead of kept.
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
    fsdp: bool = False
    fsdp_param_dtype: str = "fp32"
    fsdp_cpu_offload: bool = False
    activation_checkpointing: bool = False

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
    if not isinstance(values.get("fsdp", False), bool):
        raise error(f"{label('fsdp', values['fsdp'])}: expected True or False")
    if values.get("fsdp_param_dtype", "fp32") not in ("fp32", "bf16"):
        raise error(f"{label('fsdp_param_dtype', values['fsdp_param_dtype'])}: expected 'fp32' or 'bf16'")
    for name in ("fsdp_cpu_offload", "activation_checkpointing"):
        if not isinstance(values.get(name, False), bool):
            raise error(f"{label(name, values[name])}: expected True or False")
    if values.get("fsdp_cpu_offload", False) and not values.get("fsdp", False):
        raise error(f"{label('fsdp_cpu_offload', True)}: FSDP2's CPU offload policy needs {label('fsdp', True)}")
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


def _val_batches(data, cfg: TrainConfig, info: DistInfo) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [data.get_batch("val", cfg.batch_size, cfg.seq_len, step=j, rank=info.rank, world_size=info.world_size,
                           seed=VAL_SEED) for j in range(cfg.eval_batches)]


def evaluate(model: nn.Module, data, cfg: TrainConfig, info: DistInfo = DistInfo(),
             device: Union[str, torch.device] = "cpu", amp: Callable = nullcontext, progress: bool = False) -> float:
    """Mean loss over ``cfg.eval_batches`` fixed val batches (rows split over ranks, mean over ranks): the
    model's own loss, ``eval.next_token_loss`` weighting "batches"; ``progress``: its own bar
    ("validation", removed when done)."""
    loss, _ = next_token_loss(model, _val_batches(data, cfg, info), weighting="batches", device=device, amp=amp,
                              world_size=info.world_size, progress="validation" if progress else None)
    return loss


class PretrainTask:
    """Pretraining as a ``loop.TrainingTask``: every parameter with requires_grad trains with
    ``optimizer_factory(model, cfg)`` (default ``make_optimizer``) at ``get_lr(step)``; the loss is the
    model's own ``model(x, y) -> (logits, loss)`` on ``data.get_batch`` windows; the global RNG is
    reseeded every step; checkpoints hold the whole model and the RNG."""

    contents = CheckpointContents()

    def __init__(self, data, cfg: TrainConfig, optimizer_factory: Optional[Callable] = None):
        self.data, self.cfg, self.optimizer_factory = data, cfg, optimizer_factory or make_optimizer
        self.config = cfg.to_dict()

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.optimizer_factory(model, self.cfg)

    def lr(self, step: int) -> float:
        return get_lr(step, self.cfg)

    def step_seed(self, step: int, rank: int) -> int:
        return derive_seed(self.cfg.seed, _RNG_TAG, step, rank)

    def begin(self, start_step: int, info: DistInfo) -> None:
        cfg = self.cfg
        if info.is_main and cfg.warmup_steps >= cfg.steps > start_step:
            warnings.warn(f"warmup_steps {cfg.warmup_steps} >= steps {cfg.steps}: the learning rate never reaches its "
                          f"peak {cfg.lr:g} (lower --warmup-steps, e.g. to {max(1, cfg.steps // 10)})",
                          RuntimeWarning, stacklevel=5)

    def loss(self, model, step: int, micro: int, info: DistInfo, device) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, y = self.data.get_batch("train", cfg.batch_size, cfg.seq_len, step, rank=info.rank,
                                   world_size=info.world_size, seed=cfg.seed, micro_step=micro)
        _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        return loss, loss.detach().float().reshape(1)

    def evaluate(self, model, info: DistInfo, device, amp: Callable, progress: bool) -> float:
        return evaluate(model, self.data, self.cfg, info, device, amp, progress=progress)

    def metrics_row(self, r: StepReport) -> dict:
        row = {"step": r.step, "lr": r.lr, "train_loss": r.stats[0], "val_loss": r.val_loss, "grad_norm": r.grad_norm,
               "tokens": r.tokens, "elapsed_s": r.elapsed_s, "tokens_per_s": r.tokens_per_s}
        if r.val_loss is None:
            del row["val_loss"]
        return row

    def log_line(self, r: StepReport, progress: bool) -> Optional[str]:
        if r.val_loss is None and progress:
            return None
        return (f"step {r.step}/{r.steps}  lr {r.lr:.3e}  train {r.stats[0]:.4f}"
                + (f"  val {r.val_loss:.4f}" if r.val_loss is not None else "") + f"  {r.tokens_per_s:.0f} tok/s")


def train(model: nn.Module, data, cfg: TrainConfig,
          optimizer_factory: Optional[Callable[[nn.Module, TrainConfig], torch.optim.Optimizer]] = None,
          resume: bool = False, *, record: Optional[dict] = None, force: bool = False,
          expert_parallel=None) -> TrainResult:
    """Train ``model`` in place for ``cfg.steps`` optimizer steps; returns a TrainResult.

    optimizer_factory(model, cfg) -> optimizer (default ``make_optimizer``); the LR of every param
    group is set to get_lr(step) each step. resume: continue from ``out_dir/ckpt.pt`` if it exists
    (else start from scratch). Under torchrun (WORLD_SIZE > 1) joins the job, wraps the model in
    DDP, and only rank 0 writes files. Writes (if out_dir): metrics.jsonl, config.json, ckpt.pt.
    record: plain data defining the run beyond ``cfg`` (the command line records {"recipe": recipe dict or
    None, "model": model config}), saved in the checkpoint; on resume a checkpoint recording another one
    raises TrainingCheckpointError naming the difference unless ``force`` (one without a record: a note).
    Side effect: reseeds the global torch RNG at every step (see the module docstring). The loop is
    ``loop.run_training`` with a ``PretrainTask``.
    expert_parallel: a ``nn.moe_parallel.CommConfig``: shard the MoE experts over the torchrun ranks
    (DDP for the rest, load-balancing loss over the global batch, full-model checkpoints; see
    ``train.expert_parallel``); recorded in the run record as "expert_parallel".
    """
    _, world, local = env_world()
    device = resolve_device(cfg.device, local, world)
    check_cpu_offload(cfg.fsdp_cpu_offload, device, "fsdp_cpu_offload")
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    loop = LoopConfig(steps=cfg.steps, grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip,
                      log_interval=cfg.log_interval, eval=cfg.eval_batches > 0, eval_interval=cfg.eval_interval,
                      ckpt_interval=cfg.ckpt_interval, out_dir=cfg.out_dir, ckpt_name=CKPT_NAME,
                      metrics_name=METRICS_NAME, config_json=True, plot_name="loss.png" if cfg.plot else None,
                      autocast=cfg.autocast, progress=cfg.progress, batch_tokens=cfg.batch_size * cfg.seq_len,
                      fsdp=cfg.fsdp, fsdp_param_dtype=cfg.fsdp_param_dtype, fsdp_cpu_offload=cfg.fsdp_cpu_offload,
                      expert_parallel=expert_parallel)
    if expert_parallel is not None:
        record = {**(record or {}), "expert_parallel": comm_record(expert_parallel)}
    return run_training(model, PretrainTask(data, cfg, optimizer_factory), loop, device, resume=resume,
                        record=record, force=force)
