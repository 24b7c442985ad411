"""Quantization-aware distillation of learnable NVFP4 block scales (and optionally the latent weights).

    teacher = load_fp_model(); student = copy.deepcopy(teacher)
    quantize_model(student, PTQConfig())                     # any PTQ method
    bs.lsq.enable(student, mode="dual", weights=teacher)     # trainable block amaxes
    tokens = calibration_batches(...)                        # [n, T] token windows
    result = bs.lsq.distill(student, teacher, tokens, DistillConfig(steps=200, out_dir="runs/d"))
    bs.lsq.freeze(student)                                   # ready to export

Loss (mean over tokens): ``T^2 * KL(softmax(t/T) || softmax(s/T)) + ce_weight * CE(s, next token)``.
Batches are a pure function of (seed, step, micro_step): ``batch_size`` random rows of ``tokens`` per
micro step and rank, each cut at a random offset to ``seq_len`` tokens. The student runs in eval mode
(no dropout), so a run resumed from ``out_dir/latest.pt`` (trainable tensors, optimizer, step)
repeats an uninterrupted one bit for bit (on CPU; on CUDA where the kernels are deterministic).
Under torchrun (an initialized process group, or WORLD_SIZE > 1) the student is wrapped in DDP,
each rank draws its own slice of the global batch, and only rank 0 writes files.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..train.data import derive_seed
from ..train.distributed import (DistInfo, all_reduce_mean, barrier, cleanup_distributed, no_sync,
                                 setup_distributed, wrap_ddp)
from ..train.checkpoint import CheckpointError, check_record, load_weights_only, save_atomic
from ..train.trainer import _Bar, _truncate_metrics, clip_gradients, plot_losses
from .enable import lsq_layers, scale_parameters, weight_parameters

DISTILL_TRAIN = ("scales", "all")
DISTILL_CKPT_NAME = "latest.pt"
DISTILL_METRICS_NAME = "metrics.jsonl"
DISTILL_PLOT_NAME = "losses.png"
DISTILL_CKPT_FORMAT = "blockscale.lsq.distill/1"
_BATCH_TAG = 11  # derive_seed part for the training batches
_EVAL_TAG = 12


@dataclass(frozen=True)
class DistillConfig:
    """train: "scales" (only the block amaxes train) | "all" (the latent FP32 weights too).
    batch_size: sequences per micro step and rank; grad_accum micro steps per optimizer step.
    max_grad_norm: global clip norm over the trainable tensors (0 disables). eval_every: every N steps
    evaluate ``eval_tokens`` (if given) and write the checkpoint (0: only the final checkpoint).
    out_dir: metrics.jsonl, latest.pt and losses.png (None writes nothing)."""

    train: str = "scales"
    steps: int = 100
    lr_scales: float = 1e-4
    lr_weights: float = 1e-5
    temperature: float = 1.0
    ce_weight: float = 0.0
    batch_size: int = 4
    grad_accum: int = 1
    seq_len: int = 256
    max_grad_norm: float = 1.0
    eval_every: int = 0
    seed: int = 0
    out_dir: Optional[str] = None
    log_every: int = 10

    def __post_init__(self):
        if self.train not in DISTILL_TRAIN:
            raise ValueError(f"DistillConfig.train={self.train!r}; allowed values: {', '.join(map(repr, DISTILL_TRAIN))}")
        ints = {"steps": 1, "batch_size": 1, "grad_accum": 1, "seq_len": 2, "log_every": 1, "eval_every": 0,
                "seed": 0}
        for name, lo in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"DistillConfig.{name}={v!r}; allowed values: integers >= {lo}")
        for name, positive in (("lr_scales", True), ("lr_weights", False), ("temperature", True),
                               ("ce_weight", False), ("max_grad_norm", False)):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v != float("inf")
            if not ok or (v <= 0 if positive else v < 0):
                raise ValueError(f"DistillConfig.{name}={v!r}; allowed values: finite numbers "
                                 f"{'> 0' if positive else '>= 0'}")
        if self.train == "all" and self.lr_weights <= 0:
            raise ValueError(f"DistillConfig.lr_weights={self.lr_weights!r}; allowed values: > 0 when train='all'")
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise ValueError(f"DistillConfig.out_dir={self.out_dir!r}; allowed values: None or a path")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = None if self.out_dir is None else str(self.out_dir)
        return d


# ----------------------------------------------------------------------------- loss

def _logits(out) -> torch.Tensor:
    """Logits from an HF output (``.logits``), a (logits, loss) tuple, or a tensor."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, x: torch.Tensor,
                 temperature: float = 1.0, ce_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, kl, ce) in FP32, means over tokens: kl = T^2 * KL(teacher_T || student_T) over all positions,
    ce = next-token cross entropy of the student on ``x`` [B, L]; loss = kl + ce_weight * ce."""
    s = student_logits.float()
    V = s.shape[-1]
    t_logp = F.log_softmax(teacher_logits.detach().float().to(s.device) / temperature, -1).reshape(-1, V)
    s_logp = F.log_softmax(s / temperature, -1).reshape(-1, V)
    kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="sum") / s_logp.shape[0] * temperature ** 2
    ce = F.cross_entropy(s[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1).to(s.device))
    return (kl + ce_weight * ce if ce_weight else kl), kl, ce


def _batch(tokens: torch.Tensor, cfg: DistillConfig, step: int, micro: int, info: DistInfo) -> torch.Tensor:
    """Rows of micro step ``micro`` of ``step`` for this rank: [batch_size, seq_len] (CPU, long)."""
    n, T = tokens.shape
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, _BATCH_TAG, step, micro))
    total = cfg.batch_size * info.world_size
    rows = torch.randint(0, n, (total,), generator=g)
    offs = torch.randint(0, T - cfg.seq_len + 1, (total,), generator=g)
    sl = slice(info.rank * cfg.batch_size, (info.rank + 1) * cfg.batch_size)
    rows, offs = rows[sl], offs[sl]
    cols = offs[:, None] + torch.arange(cfg.seq_len)[None, :]
    return tokens[rows[:, None], cols].long()


@torch.no_grad()
def eval_next_token_loss(model: nn.Module, tokens: torch.Tensor, batch_size: int = 4,
                         seq_len: Optional[int] = None, info: DistInfo = DistInfo(), progress: bool = False) -> float:
    """Mean next-token cross entropy of ``model`` on the windows ``tokens`` [n, T] (first ``seq_len``
    tokens of each; rows split over ranks, token-weighted mean over ranks); ``progress``: its own bar
    ("evaluation", removed when done)."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    x_all = tokens[:, :seq_len] if seq_len else tokens
    rows = x_all[info.rank::info.world_size]
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    starts = range(0, rows.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="evaluation", unit="batch", leave=False, dynamic_ncols=True)
    for i in starts:
        x = rows[i:i + batch_size].long().to(device)
        lg = _logits(model(x)).float()
        total += F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").double()
        count += x[:, 1:].numel()
    model.train(was)
    if info.enabled:
        both = torch.stack([total, count])
        dist.all_reduce(both)
        total, count = both[0], both[1]
    return float(total / count.clamp(min=1))


def steps_per_scale_step(model: nn.Module, lr: float, max_samples: int = 1 << 20) -> tuple[float, float]:
    """(median block amax, lr-limited steps to move it by one E4M3 step): Adam changes an amax by about
    ``lr`` per step whatever the gradient's size, and a stored E4M3 scale moves when its amax changes
    by 1/15 to 1/8 of itself (3 mantissa bits); so about ``median / (16 lr)`` steps before a typical block's scale can
    change (the learning rate that suits a model scales with its weights' magnitude)."""
    params = scale_parameters(model)
    if not params:
        raise ValueError("model has no LSQ amax parameters: run blockscale.lsq.enable(model, ...) first")
    flat = torch.cat([p.detach().flatten() for p in params])
    if flat.numel() > max_samples:
        flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:max_samples]]
    med = float(flat.float().median())
    return med, 0.0625 * med / lr


# ----------------------------------------------------------------------------- checkpoints

def _save(path: Path, trainable: dict, optimizer, step: int, cfg: DistillConfig, **extra) -> Path:
    obj = {"format": DISTILL_CKPT_FORMAT, "step": int(step),
           "trainable": {n: p.detach().cpu().clone() for n, p in trainable.items()},
           "optimizer": optimizer.state_dict(), "config": cfg.to_dict(), **extra}
    return save_atomic(path, obj)


def load_distill_checkpoint(path) -> dict:
    """Read a distill checkpoint with ``torch.load(weights_only=True)`` (CPU tensors); CheckpointError
    when corrupt or not a distill checkpoint, FileNotFoundError when absent."""
    path = Path(path)
    obj = load_weights_only(path)
    if not isinstance(obj, dict) or obj.get("format") != DISTILL_CKPT_FORMAT or \
            any(k not in obj for k in ("step", "trainable", "optimizer")):
        raise CheckpointError(f"{path} is not a {DISTILL_CKPT_FORMAT} checkpoint")
    return obj


# ----------------------------------------------------------------------------- training

def _dist_info(device: torch.device) -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local)
    return setup_distributed(str(device))  # joins a torchrun job (WORLD_SIZE > 1), else a no-op


def distill(student: nn.Module, teacher: nn.Module, tokens: torch.Tensor, cfg: DistillConfig = DistillConfig(), *,
            eval_tokens: Optional[torch.Tensor] = None, resume: bool = False, progress: bool = True,
            record: Optional[dict] = None, force: bool = False) -> dict:
    """Distill ``teacher`` into the LSQ-enabled ``student`` (in place) for ``cfg.steps`` AdamW steps.

    Only the block amaxes (train="scales"), or also the latent LSQ weights (train="all"), get
    requires_grad=True; every other student parameter and the whole teacher are frozen (the teacher in
    eval mode). resume: continue from ``out_dir/latest.pt`` when it exists (``cfg.steps`` is the
    total). record: plain data defining the run beyond ``cfg`` (the command line records the model,
    teacher, LSQ mode, ...), saved in the checkpoint; resuming from one that records another raises
    CheckpointError naming the difference unless ``force`` (one without a record: a note). Returns
    {"steps", "final_loss", "first_loss", "trainable_params", "optimizer_state_bytes",
    "seconds_per_step", "metrics_path"} (losses of the steps run by this call; None if none ran).
    """
    if not isinstance(cfg, DistillConfig):
        raise TypeError(f"cfg must be a DistillConfig, not {type(cfg).__name__}")
    if not lsq_layers(student):
        raise ValueError("student has no LSQLinear layers: run blockscale.lsq.enable(student, ...) first")
    if not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"tokens must be an integer tensor [n, T], got "
                         f"{tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__}")
    if tokens.shape[0] < 1 or tokens.shape[1] < cfg.seq_len:
        raise ValueError(f"tokens {tuple(tokens.shape)}: need n >= 1 windows of T >= seq_len={cfg.seq_len} tokens")
    out = Path(cfg.out_dir) if cfg.out_dir is not None else None
    if resume and out is None:
        raise ValueError("resume=True needs cfg.out_dir")

    device = next(student.parameters()).device
    info = _dist_info(device)
    try:
        return _distill(student, teacher, tokens, cfg, eval_tokens, resume, progress, info, device, out, record,
                        force)
    finally:
        cleanup_distributed(info)


def _distill(student, teacher, tokens, cfg, eval_tokens, resume, progress, info, device, out, record=None,
             force=False) -> dict:
    main = info.is_main
    # freeze everything, then open the trainable tensors
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    for p in student.parameters():
        p.requires_grad_(False)
    scales = scale_parameters(student)
    weights = weight_parameters(student) if cfg.train == "all" else []
    for p in scales + weights:
        p.requires_grad_(True)
    trainable = {n: p for n, p in student.named_parameters() if p.requires_grad}
    n_trainable = sum(p.numel() for p in trainable.values())
    groups = [{"params": scales, "lr": cfg.lr_scales, "name": "scales"}]
    if weights:
        groups.append({"params": weights, "lr": cfg.lr_weights, "name": "weights"})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr_scales, weight_decay=0.0)

    ckpt_path = out / DISTILL_CKPT_NAME if out else None
    metrics_path = out / DISTILL_METRICS_NAME if out else None
    start_step, elapsed0 = 0, 0.0
    state = load_distill_checkpoint(ckpt_path) if resume and ckpt_path.exists() else None
    note = check_record(state.get("record"), record, ckpt_path, force) if state is not None else None
    if state is not None:
        saved = state["trainable"]
        if set(saved) != set(trainable):
            raise CheckpointError(f"checkpoint {ckpt_path} trains other tensors than this run (train="
                                  f"{cfg.train!r}): {sorted(set(saved) ^ set(trainable))[:4]} ...")
        with torch.no_grad():
            for n, p in trainable.items():
                if saved[n].shape != p.shape:
                    raise CheckpointError(f"checkpoint {ckpt_path}: {n} has shape {tuple(saved[n].shape)}, "
                                          f"the model {tuple(p.shape)}")
                p.copy_(saved[n])
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {ckpt_path} does not fit this optimizer: {exc}") from exc
        start_step, elapsed0 = int(state["step"]), float(state.get("elapsed_s", 0.0))
    if main and out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if state is not None:
            _truncate_metrics(metrics_path, start_step)
        elif metrics_path.exists():
            metrics_path.unlink()
    barrier(info)

    was_training = student.training
    student.eval()  # no dropout: deterministic batches -> exact resume
    if info.enabled:  # DDP syncs only the trainable tensors (the packed FP4 / FP8 buffers gloo cannot broadcast)
        from torch.nn.parallel import DistributedDataParallel as DDP

        frozen = [n for n, p in student.named_parameters() if not p.requires_grad]
        DDP._set_params_and_buffers_to_ignore_for_model(student, frozen + [n for n, _ in student.named_buffers()])
    ddp = wrap_ddp(student, info, device)
    t_device = next(teacher.parameters()).device
    bar = _Bar(progress and main, cfg.steps, start_step)
    if state is not None and main and progress:
        bar.log(f"resuming from {ckpt_path} at step {start_step}")
    if note and main:
        bar.log(note)
    first_loss = final_loss = None
    step_times: list[float] = []
    t0 = time.perf_counter()
    params = list(trainable.values())
    try:
        for step in range(start_step, cfg.steps):
            ts = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            sums = torch.zeros(3, device=device)
            for micro in range(cfg.grad_accum):
                x = _batch(tokens, cfg, step, micro, info)
                with torch.no_grad():
                    t_logits = _logits(teacher(x.to(t_device)))
                xs = x.to(device)
                with no_sync(ddp, sync=micro == cfg.grad_accum - 1):
                    loss, kl, ce = distill_loss(_logits(ddp(xs)), t_logits, xs, cfg.temperature, cfg.ce_weight)
                    (loss / cfg.grad_accum).backward()
                sums += torch.stack([loss.detach(), kl.detach(), ce.detach()])
            norm = clip_gradients(params, cfg.max_grad_norm)
            optimizer.step()
            loss_v, kl_v, ce_v = (all_reduce_mean(sums / cfg.grad_accum, info)).tolist()
            step_times.append(time.perf_counter() - ts)
            first_loss = loss_v if first_loss is None else first_loss
            final_loss = loss_v

            done = step + 1
            last = done == cfg.steps
            periodic = cfg.eval_every > 0 and done % cfg.eval_every == 0
            eval_loss = None
            if eval_tokens is not None and cfg.eval_every > 0 and (periodic or last):
                eval_loss = eval_next_token_loss(ddp, eval_tokens, cfg.batch_size, None, info,
                                                 progress=progress and main)
                student.eval()
            if done % cfg.log_every == 0 or last or eval_loss is not None:
                row = {"step": done, "loss": loss_v, "kl": kl_v, "ce": ce_v, "lr": cfg.lr_scales,
                       "grad_norm": float(norm), "seconds": round(elapsed0 + time.perf_counter() - t0, 4),
                       "train_loss": loss_v}
                if weights:
                    row["lr_weights"] = cfg.lr_weights
                if eval_loss is not None:
                    row["eval_loss"] = row["val_loss"] = eval_loss
                if main and metrics_path is not None:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                if main and eval_loss is not None:
                    bar.log(f"step {done}/{cfg.steps}  loss {loss_v:.4f}  eval next-token loss {eval_loss:.4f}")
            if out is not None and (last or periodic):
                if main:
                    _save(ckpt_path, trainable, optimizer, done, cfg, world_size=info.world_size,
                          elapsed_s=elapsed0 + time.perf_counter() - t0,
                          **({"record": record} if record is not None else {}))
                barrier(info)
            bar.update(loss=f"{loss_v:.4f}")
    finally:
        bar.close()
        student.train(was_training)

    if main and metrics_path is not None and metrics_path.exists():
        try:
            plot_losses({"distill": metrics_path}, out / DISTILL_PLOT_NAME, title="LSQ distillation loss")
        except ImportError:  # matplotlib missing: metrics are still there
            pass
    state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                      for v in s.values() if torch.is_tensor(v))
    return {"steps": max(cfg.steps, start_step), "final_loss": final_loss, "first_loss": first_loss,
            "trainable_params": n_trainable, "optimizer_state_bytes": state_bytes,
            "seconds_per_step": sum(step_times) / len(step_times) if step_times else None,
            "metrics_path": str(metrics_path) if metrics_path is not None else None}


__all__ = ["DISTILL_TRAIN", "DistillConfig", "distill", "distill_loss", "eval_next_token_loss",
           "load_distill_checkpoint", "steps_per_scale_step"]
