"""Choosing the PTQ start of scale learning by the held-out next-token loss (``learn-scales --method auto``).

Which PTQ method gives the best start differs by model (docs/results/recovery-models.md: AWQ + GPTQ with
Hessian-aware scales on SmolLM2, stories260K and a small MoE in W4A16; GPTQ with 4/6-aware scales on
Qwen2.5-0.5B, where the Hessian-aware scales are worse than plain RTN; GPTQ with Hessian-aware scales on
stories260K in W4A4, the Hessian-aware RTN on the MoE in W4A4). ``choose_start`` quantizes a copy of the model with
each candidate, measures every candidate's next-token cross entropy on held-out windows of the *training*
text (the windows that later choose the step; never the evaluation text) and keeps the lowest. The next-token
loss, not the distillation loss: on Qwen2.5-0.5B the KL to the full-precision model ranks the starts wrongly
(docs/results/recovery-models-reading.md, ninth stop), the next-token loss in the order of the perplexity.

    choice = lsq.choose_start(lm.model, lm.tokenizer, PTQConfig(n_samples=32), calib_text, held_out_windows)
    choice.student  # lsq.QuantizedStudent of the winner; choice.scores: {label: held-out loss}
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..ptq import AWQOptions, GPTQOptions, PTQConfig, PTQReport
from .distill import eval_next_token_loss
from .recover import QuantizedStudent, quantize_student


@dataclass(frozen=True)
class StartCandidate:
    """One PTQ start: ``label`` (what reports call it), ``method`` / ``scale_rule`` / ``options`` (the
    ``PTQConfig`` fields it sets; ``options`` None: the method's defaults)."""

    label: str
    method: str
    scale_rule: str
    options: Any = None

    def config(self, base: PTQConfig) -> PTQConfig:
        """``base`` (activations, calibration windows, rotation, exclusions) with this candidate's method."""
        return dataclasses.replace(base, method=self.method, scale_rule=self.scale_rule, options=self.options)


# cheapest first (a tie keeps the earlier one); between them the best PTQ start of every model measured
START_CANDIDATES = (
    StartCandidate("RTN hessian", "rtn", "hessian"),
    StartCandidate("GPTQ hessian", "gptq", "hessian"),
    StartCandidate("GPTQ 4/6-aware", "gptq", "4over6", GPTQOptions(four_over_six="aware")),
    StartCandidate("AWQ + GPTQ hessian", "awq", "hessian", AWQOptions(quantizer="gptq")),
)


@dataclass
class StartChoice:
    """``choose_start``'s result: ``student`` (the winner's ``QuantizedStudent``), its ``label``, and for every
    candidate in order its held-out next-token loss (``scores``) and PTQ seconds (``seconds``)."""

    student: QuantizedStudent
    label: str
    scores: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The record reports keep: the chosen label and every candidate in order (a list: JSON writers may
        sort a dict's keys)."""
        return {"chosen": self.label, "criterion": "held-out next-token loss",
                "candidates": [{"label": k, "loss": v, "ptq_seconds": self.seconds[k]} for k, v in self.scores.items()]}


def check_candidates(candidates) -> tuple[StartCandidate, ...]:
    """``candidates`` as a tuple; ValueError for an empty list, a non-candidate or a repeated label."""
    candidates = tuple(candidates)
    if not candidates:
        raise ValueError("choose_start: candidates is empty; give at least one StartCandidate")
    labels = set()
    for c in candidates:
        if not isinstance(c, StartCandidate):
            raise ValueError(f"choose_start: candidates holds a {type(c).__name__}; expected StartCandidate")
        if c.label in labels:
            raise ValueError(f"choose_start: the label {c.label!r} appears twice in candidates")
        labels.add(c.label)
    return candidates


def choose_start(model: nn.Module, tokenizer, base: PTQConfig, calib: str, heldout: torch.Tensor,
                 calib_bos: bool = False, candidates=START_CANDIDATES, *, batch_size: int = 4,
                 progress: bool = True, run: Optional[Callable[[Callable[[], PTQReport]], PTQReport]] = None,
                 log: Optional[Callable[[str], None]] = None) -> StartChoice:
    """Quantize a copy of the full-precision ``model`` with each candidate (``base`` with the candidate's method,
    scale rule and options; ``quantize_student``, so each copy carries its latent weights), score it by the
    mean next-token cross entropy on ``heldout`` (integer windows [n, T]), and return the lowest (ties: the
    earlier candidate; a non-finite loss never wins, ValueError when none is finite). Only the best copy so far is kept in memory. ``log``: called with one line per
    candidate (e.g. ``print``); ``run``: as in ``quantize_student``."""
    candidates = check_candidates(candidates)
    if not isinstance(heldout, torch.Tensor) or heldout.dim() != 2 or heldout.shape[0] < 1 or heldout.shape[1] < 2:
        raise ValueError("choose_start: heldout must be an integer tensor [n >= 1, T >= 2] of token windows; got "
                         f"{getattr(heldout, 'shape', type(heldout).__name__)}")
    configs = [c.config(base) for c in candidates]  # (every config validated before any PTQ runs)
    best, scores, seconds = None, {}, {}
    for cand, cfg in zip(candidates, configs):
        t = time.time()
        qs = quantize_student(model, tokenizer, cfg, calib, calib_bos, progress=progress, run=run)
        seconds[cand.label] = time.time() - t
        qs.model.eval()
        loss = eval_next_token_loss(qs.model, heldout, batch_size=batch_size)
        scores[cand.label] = loss
        if log is not None:
            log(f"start {cand.label}: held-out next-token loss {loss:.6f} (PTQ {seconds[cand.label]:.0f} s)")
        if math.isfinite(loss) and (best is None or loss < scores[best[0]]):
            best = (cand.label, qs)
        del qs
    if best is None:
        raise ValueError("choose_start: no candidate gave a finite held-out loss (" +
                         ", ".join(f"{k}: {v}" for k, v in scores.items()) + ")")
    return StartChoice(best[1], best[0], scores, seconds)


__all__ = ["START_CANDIDATES", "StartCandidate", "StartChoice", "check_candidates", "choose_start"]
