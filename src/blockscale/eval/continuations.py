"""Scoring continuations of a text: the one log-likelihood routine of the zero-shot suite.

    scores = continuation_scores(model, tokenizer, [("Once upon a", " time"), ...], batch_size=8)
    scores[0].logprob      # sum of log p(token | earlier tokens) over the continuation's tokens
    scores[0].greedy       # every continuation token is the model's argmax choice at its position
    scores[0].next_token   # the argmax token after the continuation (where greedy decoding would go on)

Tokens as lm-evaluation-harness cuts a (context, continuation) pair: whitespace ending the context moves to
the continuation, the context is encoded alone and the continuation's tokens are those of context +
continuation encoded whole, after the context's (so a tokenizer that merges across the boundary is read the
way it encodes the whole text). With ``bos`` (and a tokenizer with a BOS token) BOS opens every sequence.
A sequence longer than ``max_len`` (default: the model's ``max_position_embeddings``) loses context tokens
from its left (BOS kept).

Batches: requests sorted by length (longest first), right-padded; a causal model's positions never see the
padding after them, and every activation format blockscale quantizes scales per token or per block (or with a
calibrated static scale), so a request's scores do not depend on its batch. The model runs in eval mode under
``torch.no_grad`` (its training flag restored), log-probabilities in FP32, sums in FP64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..data.tokenizer import Tokenizer
from ..errors import DataError
from .next_token import model_device, output_logits


@dataclass(frozen=True)
class ContinuationScore:
    """logprob: summed log-probability of the continuation's tokens; greedy: each was the argmax;
    tokens: the continuation's token ids; next_token: the argmax token after the last one."""

    logprob: float
    greedy: bool
    tokens: tuple[int, ...]
    next_token: int


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a pair, cut as lm-evaluation-harness cuts it (module docstring)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    ctx = list(tokenizer.encode(context))
    whole = list(tokenizer.encode(context + continuation))
    cont = whole[len(ctx):]
    if not cont:
        raise DataError(f"the continuation {continuation!r} encodes to no token after its context")
    return ctx, cont


def model_max_len(model) -> Optional[int]:
    """The model's ``config.max_position_embeddings`` (None when it has none)."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def _sequences(tokenizer, pairs, bos: bool, max_len: Optional[int]) -> list[tuple[list[int], int]]:
    """(token ids, index of the first continuation token) per pair, BOS first and cut to ``max_len``."""
    prefix = [tokenizer.bos_id] if bos and tokenizer.bos_id is not None else []
    out = []
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        if max_len is not None:
            room = max_len - len(prefix) - len(cont)
            if room < 0:
                raise DataError(f"the continuation {continuation!r} ({len(cont)} tokens) does not fit the model's "
                                f"{max_len} positions")
            ctx = ctx[len(ctx) - room:] if len(ctx) > room else ctx
        if not prefix and not ctx:
            raise DataError(f"nothing precedes the continuation {continuation!r}: an empty context needs a BOS token")
        out.append((prefix + ctx + cont, len(prefix) + len(ctx)))
    return out


def _score_rows(logits: torch.Tensor, batch: list[tuple[list[int], int]]) -> list[ContinuationScore]:
    out = []
    for row, (ids, start) in zip(logits, batch):
        # positions start-1 .. len-1: the continuation's tokens, then the one after them
        lp = torch.log_softmax(row[start - 1:len(ids)].float(), dim=-1)
        target = torch.tensor(ids[start:], dtype=torch.long, device=lp.device)
        picked = lp[:-1].gather(1, target[:, None])[:, 0]
        argmax = lp.argmax(dim=-1)
        out.append(ContinuationScore(float(picked.double().sum()), bool(torch.equal(argmax[:-1], target)),
                                     tuple(ids[start:]), int(argmax[-1])))
    return out


@torch.no_grad()
def continuation_scores(model, tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], *, bos: bool = False,
                        batch_size: int = 8, max_len: Optional[int] = None) -> list[ContinuationScore]:
    """A ``ContinuationScore`` per (context, continuation) pair, in order (see the module docstring)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    seqs = _sequences(tokenizer, pairs, bos, model_max_len(model) if max_len is None else max_len)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    device = model_device(model)
    was_training = getattr(model, "training", False)
    model.eval()
    scores: list[Optional[ContinuationScore]] = [None] * len(seqs)
    try:
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            batch = [seqs[i] for i in idx]
            width = len(batch[0][0])
            x = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (ids, _) in enumerate(batch):
                x[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logits = output_logits(model(x.to(device)))
            for i, s in zip(idx, _score_rows(logits, batch)):
                scores[i] = s
    finally:
        if was_training:
            model.train()
    return scores


__all__ = ["ContinuationScore", "continuation_scores", "encode_pair", "model_max_len"]
