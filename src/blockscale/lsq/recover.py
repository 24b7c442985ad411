"""Scale learning after PTQ as library calls (what ``blockscale learn-scales`` runs under its flags):
``quantize_student`` (a PTQ-quantized copy of a model and the latent weights its LSQ layers start from, so
that step 0 is the PTQ model bit for bit) and ``recover`` (make the student's block scales trainable, measure,
distill from the teacher, measure again, freeze).

    qs = lsq.quantize_student(lm.model, lm.tokenizer, PTQConfig(), calib_text)
    result = lsq.recover(qs.model, lm.model, tokens, lsq.RecoveryConfig(lsq.recovery_distill_config(50)),
                         weights=qs.weights, evaluate=lsq.perplexity_evaluator(lm.tokenizer, eval_text, 256))
    export_checkpoint(qs.model, out, tokenizer=lm.tokenizer.hf)
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch import nn

from ..ptq import PTQConfig, PTQReport
from ..ptq.pipeline import calibrate_and_quantize, evaluate_ppl, record_dict
from ..train.distributed import env_world
from ..train.fsdp import is_sharded, unshard_blockwise
from .distill import DistillConfig, distill
from .enable import enable, exact_latent_weights, freeze
from .latent_weight import check_weight_units
from .recovery import RECOVERY_ENABLE

FUSED_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # 3-D parameters of fused MoE experts modules


@dataclass
class QuantizedStudent:
    """``quantize_student``'s result: ``model`` (the quantized copy), ``weights`` ({name: FP32 latent weight},
    for ``enable(weights=)``), ``dequantized`` (the names whose latent weight is the dequantized one: the
    method's codes are not a rounding of one weight, e.g. GPTQ) and the PTQ ``report``."""

    model: nn.Module
    weights: dict
    dequantized: list
    report: PTQReport


def fused_expert_weights(model: nn.Module) -> dict:
    """{``NAME.gate_up_proj`` / ``NAME.down_proj``: weight} of the fused experts modules of a full-precision
    ``model`` (the keys ``enable`` / ``exact_latent_weights`` read for ``NVFP4Experts`` NAME)."""
    out = {}
    for name, m in model.named_modules():
        for key in FUSED_EXPERT_WEIGHTS:
            w = getattr(m, key, None)
            if isinstance(w, torch.Tensor) and w.dim() == 3:
                out[f"{name}.{key}"] = w.detach()
    return out


def quantize_student(model: nn.Module, tokenizer, config: PTQConfig, calib: str, calib_bos: bool = False, *,
                     progress: bool = True,
                     run: Optional[Callable[[Callable[[], PTQReport]], PTQReport]] = None) -> QuantizedStudent:
    """Quantize a deep copy of the full-precision ``model`` with ``config`` (calibrating on ``calib`` when the
    method needs it; ``ptq.pipeline.calibrate_and_quantize``) and pick its latent weights: the full-precision
    weights PTQ rounded (after AWQ / SmoothQuant folding; fused experts: ``model``'s) where they reproduce the
    codes, else the dequantized ones (``exact_latent_weights``), so ``enable(init="stored", weights=...)``
    starts at the PTQ model either way. ``run``: calls the PTQ thunk and returns its report (the command line
    folds its warnings there); default: calls it."""
    student = copy.deepcopy(model)
    latent = {}

    def ptq() -> PTQReport:
        return calibrate_and_quantize(student, tokenizer, config, calib, calib_bos, progress=progress,
                                      latent_weights=latent)

    report = ptq() if run is None else run(ptq)
    for key, w in fused_expert_weights(model).items():  # the full-precision experts (RTN: exact)
        latent.setdefault(key, w)
    weights, dequantized = exact_latent_weights(student, latent)
    return QuantizedStudent(student, weights, dequantized, report)


@dataclass(frozen=True)
class RecoveryConfig:
    """One scale-learning run: ``distill`` (steps, learning rates, batches, schedule, ``out_dir``) and how the
    block scales become trainable (``enable``'s ``mode`` / ``param`` / ``dual_form`` / ``learn_input_scales`` /
    ``weight_units``; defaults: the recovery pipeline's ``RECOVERY_ENABLE``). holdout: the last ``holdout``
    training windows are held out of training and choose the step (``DistillConfig.keep_best``: the distillation
    loss on them, ``eval_loss="distill"``, evaluated at
    the start, every ``distill.eval_every`` steps and at the end; the student keeps the best, the start
    included); 0: no selection, the last step."""

    distill: DistillConfig = field(default_factory=DistillConfig)
    mode: str = RECOVERY_ENABLE["mode"]
    param: str = RECOVERY_ENABLE["param"]
    dual_form: str = RECOVERY_ENABLE["dual_form"]
    learn_input_scales: bool = False
    weight_units: str = RECOVERY_ENABLE["weight_units"]
    holdout: int = 0

    def __post_init__(self):
        check_weight_units(self.weight_units)
        h = self.holdout
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"RecoveryConfig.holdout={h!r}; allowed values: integers >= 0")


def split_holdout(tokens: torch.Tensor, holdout: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(training windows, held-out windows or None): the last ``holdout`` rows of ``tokens`` [n, T] held out;
    ValueError when fewer than one training window would remain."""
    if not holdout:
        return tokens, None
    if tokens.shape[0] <= holdout:
        raise ValueError(f"holdout={holdout}: the training text gives {tokens.shape[0]} windows; hold out fewer "
                         "(at least one must remain to train on)")
    return tokens[:-holdout], tokens[-holdout:]


@dataclass
class RecoveryResult:
    """``recover``'s result: ``distill`` (``lsq.distill``'s summary), ``evaluations`` ({"before" / "after": what
    ``evaluate`` returned}, empty without it) and ``main_rank`` (False on the other ranks of a torchrun job,
    which neither evaluate nor freeze)."""

    distill: dict
    evaluations: dict
    main_rank: bool = True


class ScaleSetupError(ValueError):
    """``recover``: ``lsq.enable`` refused the student (nothing trained); the message is enable's, the cause its
    ValueError."""


def is_main_rank() -> bool:
    """Whether this process is rank 0 of its torchrun job (or not in one): the one that evaluates and writes."""
    return env_world()[0] == 0


def perplexity_evaluator(tokenizer, source: str, ctx: int, bos: str = "none", max_tokens: Optional[int] = None,
                         batch_size: int = 4) -> Callable[[nn.Module, str], dict]:
    """An ``evaluate`` for ``recover``: the perplexity record (``ptq.pipeline.evaluate_ppl`` as a dict: ``ppl``,
    ``tokens_evaluated``, ``source``, ...) of the model on ``source`` in ``ctx``-token windows."""
    def evaluate(model: nn.Module, tag: str) -> dict:
        return record_dict(evaluate_ppl(model, tokenizer, source, ctx, bos, max_tokens, batch_size))

    return evaluate


def recover(student: nn.Module, teacher: nn.Module, tokens: Union[torch.Tensor, Callable[[], torch.Tensor]],
            config: RecoveryConfig = RecoveryConfig(), *, weights: Union[nn.Module, dict, None] = None,
            evaluate: Optional[Callable[[nn.Module, str], object]] = None,
            on_enabled: Optional[Callable[[nn.Module], None]] = None, resume: bool = False,
            record: Optional[dict] = None, force: bool = False, progress: bool = True,
            enabled: bool = False) -> RecoveryResult:
    """Learn the block scales of the PTQ-quantized ``student`` (in place) by distillation from ``teacher``.

    In order: ``enable(student, init="stored", weights=weights, ...)`` with ``config``'s options (its
    ValueError becomes a ``ScaleSetupError``; a ``weights`` dict is emptied once enable has copied it, e.g.
    ``QuantizedStudent.weights``: its tensors are not held through training), ``on_enabled(student)``, the
    training windows (``tokens``: an integer tensor [n, T], or a function drawing them, called here; the last
    ``config.holdout`` of them held out to choose the step: draw them apart from the others,
    ``calibration_batches(..., holdout=...)``, so that no held-out token is trained on), ``evaluate(student, "before")``,
    ``lsq.distill`` (``resume`` / ``record`` / ``force`` / ``progress`` as there), ``evaluate(student,
    "after")`` and ``freeze(student)``. Under torchrun only rank 0 evaluates and freezes (``main_rank``).
    A run that diverges raises ``train.TrainingDivergedError``.
    ``enabled``: the student's scales are trainable already (``lsq.sharded_student``: enabled and sharded
    layer by layer; ``weights`` unused). A student sharded with FSDP2 is evaluated "before" by every rank
    together and gathered at the end block by block, each block frozen on rank 0 as it arrives
    (``train.fsdp.unshard_blockwise``): no rank ever holds the whole FP32 student."""
    if not enabled:
        try:
            enable(student, mode=config.mode, init="stored", weights=weights, param=config.param,
                   dual_form=config.dual_form, learn_input_scales=config.learn_input_scales,
                   weight_units=config.weight_units)
        except ValueError as err:
            raise ScaleSetupError(str(err)) from err
        if isinstance(weights, dict):  # enable cloned them into the LSQ layers: handed over, not held through training
            weights.clear()            # (one more FP32 copy of every quantized weight: 1.4 GB on a 0.5B model)
    if on_enabled is not None:
        on_enabled(student)
    if callable(tokens):
        tokens = tokens()
    tokens, held = split_holdout(tokens, config.holdout)
    dcfg = (config.distill if held is None
            else dataclasses.replace(config.distill, keep_best=True, eval_loss="distill"))
    main_rank = is_main_rank()
    sharded = is_sharded(student)
    evaluations = {}
    if evaluate is not None and (main_rank or sharded):  # (sharded: a forward needs every rank)
        before = evaluate(student, "before")
        if main_rank:
            evaluations["before"] = before
    summary = distill(student, teacher, tokens, dcfg, eval_tokens=held, resume=resume, progress=progress,
                      record=record, force=force)
    if sharded:  # each block gathered, frozen on rank 0 (its latent weights become codes), dropped elsewhere
        unshard_blockwise(student, on_block=freeze if main_rank else None, keep=main_rank)
    if not main_rank:
        return RecoveryResult(summary, evaluations, main_rank=False)
    if evaluate is not None:
        evaluations["after"] = evaluate(student, "after")
    freeze(student)
    return RecoveryResult(summary, evaluations)


__all__ = ["split_holdout", "FUSED_EXPERT_WEIGHTS", "QuantizedStudent", "RecoveryConfig", "RecoveryResult", "ScaleSetupError",
           "fused_expert_weights", "is_main_rank", "perplexity_evaluator", "quantize_student", "recover"]
