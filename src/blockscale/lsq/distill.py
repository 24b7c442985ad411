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
each rank draws its own slice of the global batch, and only rank 0 writes files. With ``fsdp=True``
student and teacher are sharded with FSDP2 instead (``train.fsdp``; docs/lsq.md "FSDP2"): the LSQ
learners (latent weight + block amaxes) each in an FP32 unit of their own, then the decoder blocks and
the root; sharded checkpoints ``latest.dcp``; both models are plain, full modules again at the end.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..eval.next_token import model_device, next_token_loss, output_logits
from ..train import CheckpointContents, DistInfo, LoopConfig, StepReport, derive_seed, run_training
from ..train.distributed import all_reduce_mean, cleanup_distributed, env_world, join_distributed
from ..train.fsdp import check_fsdp_options, is_sharded, require_distributed, shard_model, unshard_model
from .quantizer import ignore_fsdp_view_warning
from .enable import learner_modules, lsq_layers, scale_parameters, weight_parameters
from .parameterisation import PRE_PARAMETER_NAMES

DISTILL_TRAIN = ("scales", "all")
EVAL_LOSSES = ("next_token", "distill")
LR_SCHEDULES = ("constant", "cosine", "linear")
DISTILL_CKPT_NAME = "latest.pt"
DISTILL_METRICS_NAME = "metrics.jsonl"
DISTILL_PLOT_NAME = "losses.png"
DISTILL_CKPT_FORMAT = "blockscale.lsq.distill/1"
_BATCH_TAG = 11  # derive_seed part for the training batches
_EVAL_TAG = 12
LR_RETRY_FACTOR = 3.0  # a retry's learning rates: the previous attempt's / 3 (docs/results/recovery-models.md)


@dataclass(frozen=True)
class DistillConfig:
    """train: "scales" (only the block amaxes train) | "all" (the latent FP32 weights too).
    batch_size: sequences per micro step and rank; grad_accum micro steps per optimizer step.
    max_grad_norm: global clip norm over the trainable tensors (0 disables). eval_every: every N steps
    evaluate ``eval_tokens`` (if given) and write the checkpoint (0: only the final checkpoint).
    ckpt_every: write ``latest.pt`` every N steps whatever ``eval_every`` says (0: only at the end; None:
    every ``eval_every`` steps); the checkpoint of step N replaces that of an earlier step.
    out_dir: metrics.jsonl, latest.pt and losses.png (None writes nothing).
    fsdp: shard student and teacher with FSDP2 instead of DDP (torchrun, >= 2 processes); fsdp_param_dtype:
    "fp32" | "bf16" for everything but the LSQ learners (always FP32); gradients reduced in FP32.
    lr_schedule: "constant" (the write-up's), "cosine" or "linear" decay from each group's lr (after
    ``warmup_steps`` linear warm-up steps: lr * (step + 1) / warmup_steps) to ``min_lr_ratio`` * lr at
    ``schedule_steps`` (None: ``steps``; set it to run a longer schedule in segments, e.g. evaluating at
    50 / 100 of a 200-step one); ``lr_factor(step)`` gives the factor. lr_pre_factor: dual mode ("pair"
    form) only, the pre amaxes' (the codes' grid) lr is lr_scales * lr_pre_factor (0 freezes them);
    freeze_pre_steps: the pre amaxes stay frozen for the first N steps.
    keep_best: best-step selection (needs ``eval_tokens``: a held-out split of the training text, never the
    evaluation text): the student is also evaluated before the first step, and at the end holds the trainable
    tensors of the evaluation with the lowest loss (every ``eval_every`` steps and the last; the start included,
    so learning never returns a student worse on that split than it started; ``train.best_step``).
    eval_loss: what an evaluation measures on ``eval_tokens``: "next_token" (the student's next-token cross
    entropy) or "distill" (the training objective, ``distill_loss`` against the teacher: what best-step
    selection should minimise; ``recover`` with a holdout uses it).
    lr_retries: with ``keep_best``, when a run's best step is its start (learning never beat the start on the
    held-out windows), put the start back and run again from it with every learning rate divided by
    ``LR_RETRY_FACTOR`` (a fresh optimizer and schedule, the same batches; in ``out_dir/retry-K``), at most
    this many times; 0: never (docs/lsq.md "When learning does not beat the start")."""

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
    fsdp: bool = False
    fsdp_param_dtype: str = "fp32"
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    schedule_steps: Optional[int] = None
    lr_pre_factor: float = 1.0
    freeze_pre_steps: int = 0
    ckpt_every: Optional[int] = None
    keep_best: bool = False
    eval_loss: str = "next_token"
    lr_retries: int = 0

    def __post_init__(self):
        check_fsdp_options(self.fsdp, self.fsdp_param_dtype, "DistillConfig")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"DistillConfig.lr_schedule={self.lr_schedule!r}; allowed values: "
                             f"{', '.join(map(repr, LR_SCHEDULES))}")
        for name in ("warmup_steps", "freeze_pre_steps", "lr_retries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DistillConfig.{name}={v!r}; allowed values: integers >= 0")
        v = self.ckpt_every
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"DistillConfig.ckpt_every={v!r}; allowed values: None or an integer >= 0")
        v = self.schedule_steps
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"DistillConfig.schedule_steps={v!r}; allowed values: None or an integer >= 1")
        for name, hi in (("min_lr_ratio", 1.0), ("lr_pre_factor", None)):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v != float("inf") and v >= 0
            if not ok or (hi is not None and v > hi):
                raise ValueError(f"DistillConfig.{name}={v!r}; allowed values: finite numbers >= 0"
                                 + (f" and <= {hi:g}" if hi is not None else ""))
        if self.warmup_steps and self.warmup_steps >= (self.schedule_steps or self.steps):
            raise ValueError(f"DistillConfig.warmup_steps={self.warmup_steps}; allowed values: fewer than the schedule's "
                             f"{self.schedule_steps or self.steps} steps")
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
        if self.eval_loss not in EVAL_LOSSES:
            raise ValueError(f"DistillConfig.eval_loss={self.eval_loss!r}; allowed values: "
                             f"{', '.join(map(repr, EVAL_LOSSES))}")
        if not isinstance(self.keep_best, bool):
            raise ValueError(f"DistillConfig.keep_best={self.keep_best!r}; allowed values: True, False")
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise ValueError(f"DistillConfig.out_dir={self.out_dir!r}; allowed values: None or a path")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = None if self.out_dir is None else str(self.out_dir)
        for f in _SCHEDULE_FIELDS:  # only when set: the config of a constant-lr run reads as before
            if d[f.name] == f.default:
                del d[f.name]
        if d["ckpt_every"] is None:
            del d["ckpt_every"]
        return d

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints (0: only the final one): ``ckpt_every``, else ``eval_every``."""
        return self.eval_every if self.ckpt_every is None else self.ckpt_every

    def lr_factor(self, step: int) -> float:
        """The schedule's factor on each group's lr at 0-based optimizer ``step``: 1 for "constant"; else
        (step + 1) / warmup_steps during warm-up, then from 1 at ``warmup_steps`` to ``min_lr_ratio`` at
        ``schedule_steps`` (or ``steps``) by a half cosine or a straight line, and ``min_lr_ratio`` after."""
        if self.lr_schedule == "constant":
            return 1.0
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        total = self.schedule_steps or self.steps
        t = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * t)) if self.lr_schedule == "cosine" else 1.0 - t
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


_SCHEDULE_FIELDS = tuple(f for f in dataclasses.fields(DistillConfig)
                         if f.name in ("lr_schedule", "warmup_steps", "min_lr_ratio", "schedule_steps", "lr_pre_factor",
                                       "freeze_pre_steps", "keep_best", "eval_loss", "lr_retries"))


# ----------------------------------------------------------------------------- loss

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


def eval_next_token_loss(model: nn.Module, tokens: torch.Tensor, batch_size: int = 4,
                         seq_len: Optional[int] = None, info: DistInfo = DistInfo(), progress: bool = False) -> float:
    """Mean next-token cross entropy of ``model`` on the windows ``tokens`` [n, T] (first ``seq_len``
    tokens of each; rows split over ranks, token-weighted mean over ranks): ``eval.next_token_loss``
    on (window, window[1:]) batches; ``progress``: its own bar ("evaluation", removed when done)."""
    rows = (tokens[:, :seq_len] if seq_len else tokens)[info.rank::info.world_size]
    batches = [(x, x[:, 1:]) for x in (rows[i:i + batch_size] for i in range(0, rows.shape[0], batch_size))]
    return next_token_loss(model, batches, device=model_device(model), world_size=info.world_size,
                           progress="evaluation" if progress else None)[0]


def window_loss(student: nn.Module, teacher: nn.Module, x: torch.Tensor, device, cfg: DistillConfig):
    """``distill_loss`` (loss, kl, ce) of ``student`` (on ``device``) against the frozen ``teacher`` on the token
    windows ``x`` [B, L]: the one forward pair of a training micro step and of a held-out evaluation."""
    with torch.no_grad():
        t_logits = output_logits(teacher(x.to(model_device(teacher))))
    if is_sharded(teacher):  # FSDP2 keeps a root's parameters gathered after its forward (for the
        teacher.reshard()    # backward, which a frozen teacher never runs): free them now
    xs = x.to(device)
    return distill_loss(output_logits(student(xs)), t_logits, xs, cfg.temperature, cfg.ce_weight)


@torch.no_grad()
def eval_distill_loss(student: nn.Module, teacher: nn.Module, tokens: torch.Tensor, cfg: DistillConfig,
                      info: DistInfo = DistInfo()) -> float:
    """The distillation loss (``distill_loss`` with ``cfg``'s temperature and ce_weight) of ``student`` against
    ``teacher`` on the windows ``tokens`` [n, T] (whole windows, ``cfg.batch_size`` at a time; rows split over
    ranks, the mean over all rows)."""
    rows = tokens[info.rank::info.world_size]
    device = model_device(student)
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(0, rows.shape[0], cfg.batch_size):
        x = rows[i:i + cfg.batch_size].long()
        loss = window_loss(student, teacher, x, device, cfg)[0]
        total += torch.tensor([float(loss) * x.shape[0], x.shape[0]], dtype=torch.float64)
    total = all_reduce_mean(total, info)
    return float(total[0] / total[1])


# ----------------------------------------------------------------------------- the task on the one loop

DISTILL_CONTENTS = CheckpointContents(DISTILL_CKPT_FORMAT, trainable_only=True)


def load_distill_checkpoint(path) -> dict:
    """Read a distill checkpoint with ``torch.load(weights_only=True)`` (CPU tensors); TrainingCheckpointError
    when corrupt or not a distill checkpoint, FileNotFoundError when absent."""
    return DISTILL_CONTENTS.read(Path(path))


class DistillTask:
    """LSQ distillation as a ``train.loop.TrainingTask``: the parameter selection is the block amaxes
    (train="scales") or also the latent LSQ weights ("all"), each group at its own constant LR (AdamW, no
    weight decay), everything else and the teacher frozen; the loss is ``distill_loss`` against the
    teacher's logits on ``_batch`` windows of ``tokens``; evaluation is ``eval_next_token_loss`` on
    ``eval_tokens``; checkpoints hold only the trainable tensors."""

    contents = DISTILL_CONTENTS

    def __init__(self, teacher: nn.Module, tokens: torch.Tensor, cfg: DistillConfig,
                 eval_tokens: Optional[torch.Tensor] = None):
        self.teacher, self.tokens, self.cfg, self.eval_tokens = teacher, tokens, cfg, eval_tokens
        self.config = cfg.to_dict()
        self.groups: list[dict] = []

    def trainable(self, student: nn.Module) -> list[nn.Parameter]:
        self.teacher.eval()
        for p in list(self.teacher.parameters()) + list(student.parameters()):
            p.requires_grad_(False)
        scales = scale_parameters(student)
        weights = weight_parameters(student) if self.cfg.train == "all" else []
        for p in scales + weights:
            p.requires_grad_(True)
        cfg = self.cfg
        pre_ids = set()
        if cfg.lr_pre_factor != 1.0 or cfg.freeze_pre_steps:
            pre_ids = {id(p) for n, p in student.named_parameters() if n.rpartition(".")[2] in PRE_PARAMETER_NAMES}
        pre = [p for p in scales if id(p) in pre_ids]
        if pre and cfg.lr_pre_factor == 0.0:  # frozen for good: no gradients, no optimizer state
            for p in pre:
                p.requires_grad_(False)
            scales, pre = [p for p in scales if id(p) not in pre_ids], []
        self.groups = [{"params": [p for p in scales if id(p) not in pre_ids], "lr": cfg.lr_scales, "name": "scales",
                        "base_lr": cfg.lr_scales}]
        if pre:
            self.groups.append({"params": pre, "lr": cfg.lr_scales * cfg.lr_pre_factor, "name": "pre scales",
                                "base_lr": cfg.lr_scales * cfg.lr_pre_factor})
        if weights:
            self.groups.append({"params": weights, "lr": cfg.lr_weights, "name": "weights", "base_lr": cfg.lr_weights})
        return [p for p in student.parameters() if p.requires_grad]

    def make_optimizer(self, student: nn.Module) -> torch.optim.Optimizer:
        self.optimizer = torch.optim.AdamW(self.groups, lr=self.cfg.lr_scales, weight_decay=0.0)
        return self.optimizer

    def fsdp_units(self, student: nn.Module) -> list[nn.Module]:
        """FSDP units of their own, FP32 whatever fsdp_param_dtype says: every LSQ learner (its latent weight
        and block amaxes; a bf16 amax would move its E4M3 scales)."""
        ignore_fsdp_view_warning()
        return learner_modules(student)

    def lr(self, step: int) -> None:
        """Each group's lr times ``cfg.lr_factor(step)`` (the pre scales' 0 while frozen), set on the optimizer
        here (the loop's one-lr-for-all does not fit groups with their own lrs); returns None."""
        f = self.cfg.lr_factor(step)
        for group in self.optimizer.param_groups:
            frozen = group.get("name") == "pre scales" and step < self.cfg.freeze_pre_steps
            group["lr"] = 0.0 if frozen else group["base_lr"] * f
        self.current_lr = self.cfg.lr_scales * f
        return None

    def step_seed(self, step: int, rank: int) -> None:  # eval mode, no dropout: nothing random
        return None

    def begin(self, start_step: int, info: DistInfo) -> None:
        return None

    def loss(self, student, step: int, micro: int, info: DistInfo, device) -> tuple[torch.Tensor, torch.Tensor]:
        x = _batch(self.tokens, self.cfg, step, micro, info)
        loss, kl, ce = window_loss(student, self.teacher, x, device, self.cfg)
        return loss, torch.stack([loss.detach(), kl.detach(), ce.detach()])

    def evaluate(self, student, info: DistInfo, device, amp: Callable, progress: bool) -> float:
        if self.cfg.eval_loss == "distill":
            return eval_distill_loss(student, self.teacher, self.eval_tokens, self.cfg, info)
        return eval_next_token_loss(student, self.eval_tokens, self.cfg.batch_size, None, info, progress=progress)

    def metrics_row(self, r: StepReport) -> dict:
        loss, kl, ce = r.stats
        lr = getattr(self, "current_lr", self.cfg.lr_scales)
        row = {"step": r.step, "loss": loss, "kl": kl, "ce": ce, "lr": lr, "grad_norm": r.grad_norm,
               "seconds": r.elapsed_s, "train_loss": loss}
        if any(g["name"] == "weights" for g in self.groups):
            row["lr_weights"] = self.cfg.lr_weights * lr / self.cfg.lr_scales
        if r.val_loss is not None:
            row["eval_loss"] = row["val_loss"] = r.val_loss
        return row

    def log_line(self, r: StepReport, progress: bool) -> Optional[str]:
        if r.val_loss is None:
            return None
        what = "held-out distillation" if self.cfg.eval_loss == "distill" else "eval next-token"
        return f"step {r.step}/{r.steps}  loss {r.stats[0]:.4f}  {what} loss {r.val_loss:.4f}"


# ----------------------------------------------------------------------------- training

def distill(student: nn.Module, teacher: nn.Module, tokens: torch.Tensor, cfg: DistillConfig = DistillConfig(), *,
            eval_tokens: Optional[torch.Tensor] = None, resume: bool = False, progress: bool = True,
            record: Optional[dict] = None, force: bool = False) -> dict:
    """Distill ``teacher`` into the LSQ-enabled ``student`` (in place) for ``cfg.steps`` AdamW steps.

    Only the block amaxes (train="scales"), or also the latent LSQ weights (train="all"), get
    requires_grad=True; every other student parameter and the whole teacher are frozen (the teacher in
    eval mode). resume: continue from ``out_dir/latest.pt`` when it exists (``cfg.steps`` is the
    total). record: plain data defining the run beyond ``cfg`` (the command line records the model,
    teacher, LSQ mode, ...), saved in the checkpoint; resuming from one that records another raises
    TrainingCheckpointError naming the difference unless ``force`` (one without a record: a note). Returns
    {"steps", "final_loss", "first_loss", "trainable_params", "optimizer_state_bytes",
    "seconds_per_step", "metrics_path", "best_step", "best_eval_loss", "eval_losses"} (losses of the steps run
    by this call; None if none ran; best_*: with ``cfg.keep_best``, the step the student holds and its loss).
    With ``cfg.lr_retries`` and ``cfg.keep_best``, a run whose best step is its start is run again from the
    start at smaller learning rates (``retry_config``); the result then describes the last attempt and
    "attempts" lists every attempt's learning rates, steps, best step, held-out losses and seconds per step.
    The loop is ``train.loop.run_training`` with a ``DistillTask``.
    """
    if not isinstance(cfg, DistillConfig):
        raise TypeError(f"cfg must be a DistillConfig, not {type(cfg).__name__}")
    if not lsq_layers(student):
        raise ValueError("student has no LSQLinear layers or LSQExperts: run blockscale.lsq.enable(student, ...) first")
    if not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"tokens must be an integer tensor [n, T], got "
                         f"{tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__}")
    if tokens.shape[0] < 1 or tokens.shape[1] < cfg.seq_len:
        raise ValueError(f"tokens {tuple(tokens.shape)}: need n >= 1 windows of T >= seq_len={cfg.seq_len} tokens")
    if resume and cfg.out_dir is None:
        raise ValueError("resume=True needs cfg.out_dir")
    if cfg.keep_best and eval_tokens is None:
        raise ValueError("DistillConfig.keep_best needs eval_tokens (held-out windows of the training text that "
                         "choose the step)")
    attempts = []
    attempt = cfg
    while True:
        summary = _attempt(student, teacher, tokens, attempt, eval_tokens, resume, progress, record, force)
        attempts.append({"lr_scales": attempt.lr_scales, "lr_weights": attempt.lr_weights if cfg.train == "all" else None,
                         "out_dir": attempt.out_dir, **{k: summary[k] for k in _ATTEMPT_KEYS}})
        k = len(attempts)
        if not cfg.keep_best or summary["best_step"] != 0 or k > cfg.lr_retries:
            break
        attempt = retry_config(cfg, k)
        if env_world()[0] == 0:
            lrs = f"--lr-scales {attempt.lr_scales:g}" + (f", --lr-weights {attempt.lr_weights:g}" if cfg.train == "all"
                                                          else "")
            print(f"learning did not beat the start on the held-out windows (best step 0, loss "
                  f"{summary['best_eval_loss']:.4f}): the start put back, again at a {LR_RETRY_FACTOR:g}x smaller "
                  f"learning rate ({lrs}; retry {k} of {cfg.lr_retries})", flush=True)
    return {**summary, "attempts": attempts} if cfg.lr_retries else summary


_ATTEMPT_KEYS = ("steps", "best_step", "best_eval_loss", "eval_losses", "seconds_per_step", "final_loss")


def retry_config(cfg: DistillConfig, k: int) -> DistillConfig:
    """The config of retry ``k`` (1-based) of ``cfg``: every learning rate divided by ``LR_RETRY_FACTOR ** k``,
    its files in ``out_dir/retry-k``."""
    f = LR_RETRY_FACTOR ** k
    return dataclasses.replace(cfg, lr_scales=cfg.lr_scales / f, lr_weights=cfg.lr_weights / f,
                               out_dir=None if cfg.out_dir is None else str(Path(cfg.out_dir) / f"retry-{k}"))


def _attempt(student, teacher, tokens, cfg, eval_tokens, resume, progress, record, force) -> dict:
    """One ``run_training`` of ``cfg`` (``distill`` without retries)."""
    loop = LoopConfig(steps=cfg.steps, grad_accum=cfg.grad_accum, grad_clip=cfg.max_grad_norm,
                      log_interval=cfg.log_every, eval=eval_tokens is not None and (cfg.eval_every > 0 or cfg.keep_best),
                      keep_best=cfg.keep_best,
                      eval_interval=cfg.eval_every, ckpt_interval=cfg.checkpoint_interval,
                      out_dir=None if cfg.out_dir is None else str(cfg.out_dir), ckpt_name=DISTILL_CKPT_NAME,
                      metrics_name=DISTILL_METRICS_NAME, plot_name=DISTILL_PLOT_NAME, plot_label="distill",
                      plot_title="LSQ distillation loss", progress=progress, batch_tokens=cfg.batch_size * cfg.seq_len,
                      train_mode=False)
    task = DistillTask(teacher, tokens, cfg, eval_tokens)
    if not cfg.fsdp:
        res = run_training(student, task, loop, model_device(student), resume=resume, record=record, force=force)
    else:
        res = _distill_fsdp(student, teacher, task, loop, cfg, eval_tokens, resume, record, force)
    for p in student.parameters():  # the last step's gradients: one more copy of every trained tensor, kept
        p.grad = None               # through the caller's evaluation or export (1.5 GB on a 0.5B model)
    return {"steps": res.step, "final_loss": res.final_train_loss,
            "first_loss": res.train_losses[0] if res.train_losses else None,
            "trainable_params": res.trainable_params, "optimizer_state_bytes": res.optimizer_state_bytes,
            "seconds_per_step": sum(res.step_seconds) / len(res.step_seconds) if res.step_seconds else None,
            "metrics_path": str(res.metrics_path) if res.metrics_path is not None else None,
            "best_step": res.best_step, "best_eval_loss": res.best_val_loss,
            "eval_losses": [[s, v] for s, v in res.val_losses]}


def _distill_fsdp(student, teacher, task, loop, cfg, eval_tokens, resume, record, force):
    """run_training with ``loop.fsdp``, the frozen teacher sharded too (per block, then the root) and
    unsharded again at the end; joins (and leaves) the torchrun job around both. A student or teacher
    handed in sharded already (built shard by shard: ``lsq.sharded_student``, ``train.fsdp_source``) stays
    sharded: the caller gathers the student block by block (``train.fsdp.unshard_blockwise``)."""
    info = join_distributed(model_device(student))
    try:
        require_distributed(info)
        if eval_tokens is not None and eval_tokens.shape[0] % info.world_size:
            raise ValueError(f"eval_tokens has {eval_tokens.shape[0]} rows: with fsdp every rank evaluates the same "
                             f"number of windows (a multiple of the world size {info.world_size})")
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        given_sharded = is_sharded(teacher)  # (built sharded: it stays so, never gathered whole)
        shard_model(teacher, cfg.fsdp_param_dtype)
        try:
            return run_training(student, task, dataclasses.replace(loop, fsdp=True,
                                                                   fsdp_param_dtype=cfg.fsdp_param_dtype,
                                                                   fsdp_keep_sharded=is_sharded(student)),
                                model_device(student), resume=resume, record=record, force=force)
        finally:
            if not given_sharded:
                unshard_model(teacher)
    finally:
        cleanup_distributed(info)


__all__ = ["DISTILL_TRAIN", "EVAL_LOSSES", "eval_distill_loss", "DistillConfig", "DistillTask", "distill", "distill_loss", "eval_next_token_loss",
           "load_distill_checkpoint", "LR_RETRY_FACTOR"]
