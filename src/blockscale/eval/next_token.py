"""The one next-token loss evaluation: a causal LM scored on batches of (inputs, targets).

    loss = next_token_loss(model, [(x, y), ...])                       # token-weighted (default)
    loss = next_token_loss(model, batches, weighting="batches")        # mean of the model's own batch losses

Every batch is a pair of long tensors: ``inputs`` [B, T] and ``targets`` [B, T'] with T' <= T, the
token after each of the first T' positions. Two weightings:

  "tokens":  sum over batches of -log p(target | its prefix) / tokens scored, with log-probabilities
             from ``model(inputs)``'s logits (or ``.logits``, or the first of a tuple) in FP32, per-batch
             sums accumulated in FP64; perplexity and the LSQ evaluation use it.
  "batches": the mean over batches of the model's own loss ``model(inputs, targets) -> (logits, loss)``
             (FP32 sum of the batch means / batches): pretraining's validation loss, which uses the
             model's loss convention (ignored targets, ...); equal to "tokens" up to rounding for
             equal-size batches.

The model runs in eval mode under ``torch.no_grad`` (its training flag is restored) and ``amp()``, on
its own device. Distributed (``world_size`` > 1, an initialized process group): each rank scores its
own batches and the result is reduced over ranks: token-weighted (sums and counts added) for "tokens",
the mean of the ranks' means for "batches".
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

WEIGHTINGS = ("tokens", "batches")


def output_logits(out) -> torch.Tensor:
    """Logits from a model's output: an HF output (``.logits``), a (logits, loss) tuple, or a tensor."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def model_device(model, default: torch.device | str = "cpu") -> torch.device:
    """The device of the model's first parameter (``default`` for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device(default)


def _bar(batches, progress: Optional[str], leave: bool):
    if not progress:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc=progress, unit="batch", leave=leave, dynamic_ncols=True)


def _sum_over_ranks(x: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        x = x.detach().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


@torch.no_grad()
def next_token_loss(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, weighting: str = "tokens",
                    device: Optional[torch.device] = None, amp: Callable = nullcontext, world_size: int = 1,
                    progress: Optional[str] = None, leave: bool = False) -> tuple[float, int]:
    """(mean loss, tokens scored) of ``model`` on ``batches`` (see the module docstring); ``device``:
    where inputs go (default: the model's); ``progress``: a bar with that description (``leave``: kept
    when done). "batches" counts the target tokens too (all of them, ignored ones included)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r}; allowed values: {', '.join(map(repr, WEIGHTINGS))}")
    device = model_device(model) if device is None else device
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    tokens_total = torch.zeros((), dtype=torch.float64, device=device)
    loss_total = torch.zeros((), dtype=torch.float64 if weighting == "tokens" else torch.float32, device=device)
    n_batches = 0
    try:
        for x, y in _bar(batches, progress, leave):
            x, y = x.long().to(device), y.long().to(device)
            with amp():
                if weighting == "batches":
                    _, loss = model(x, y)
                    loss_total += loss.float()
                else:
                    lg = output_logits(model(x)).float()
                    lg = lg[:, :y.shape[1]]
                    loss_total += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1),
                                                  reduction="sum").double()
            tokens_total += y.numel()
            n_batches += 1
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    if weighting == "batches":
        mean = _sum_over_ranks(loss_total / n_batches, world_size) / world_size if world_size > 1 \
            else loss_total / n_batches
        return mean.item(), int(_sum_over_ranks(tokens_total, world_size))
    both = _sum_over_ranks(torch.stack([loss_total, tokens_total]), world_size)
    return float(both[0] / both[1].clamp(min=1)), int(both[1])


__all__ = ["WEIGHTINGS", "model_device", "next_token_loss", "output_logits"]
