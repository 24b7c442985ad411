"""Perplexity of a causal language model over a token stream, in non-overlapping windows.

Convention (one rule for both modes): the stream is cut into windows of at most ``ctx_len``
tokens, the model sees each window alone, and every token of a window is scored except the
first, which has no context. Without ``bos_id`` the windows are ctx_len consecutive stream
tokens, so one token per window boundary serves only as context. With ``bos_id`` each window is
BOS followed by the next ctx_len - 1 stream tokens, so every stream token is scored (the first of
each window given only BOS). The last, shorter window is included.

    loss = sum over scored tokens of -log p(token | earlier tokens of its window) / tokens_evaluated
    ppl  = exp(loss)

With stories260K on tinystories_val_head.txt (the whole file encoded as one stream by tok512, so a
single dummy-prefix space, then one BOS in front; ctx 512) this gives loss 1.6190, ppl 5.048; with
``bos_id`` per window instead (no BOS in the stream), ppl 5.322: the README's 5.05 and 5.32.
Scoring the window-boundary tokens too (windows overlapping by one) would give 1.6191 / 5.049, the
same to the README's precision; encoding each line separately (a dummy prefix per line) would not
(ppl 5.44).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .next_token import model_device, next_token_loss


@dataclass(frozen=True)
class PerplexityResult:
    """tokens_evaluated: how many tokens were scored; loss: mean nats per token; ppl: exp(loss)."""

    tokens_evaluated: int
    loss: float
    ppl: float


def _windows(tokens: torch.Tensor, ctx_len: int, bos_id: Optional[int]) -> list[torch.Tensor]:
    if bos_id is None:
        wins = list(tokens.split(ctx_len))
        return [w for w in wins if w.numel() > 1]  # a 1-token tail has nothing to score
    bos = tokens.new_tensor([bos_id])
    return [torch.cat((bos, w)) for w in tokens.split(ctx_len - 1)]


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, ctx_len: int, bos_id: Optional[int] = None, batch_size: int = 8,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of ``model`` on the 1-D long tensor ``tokens`` (see the module docstring for the windows).

    ``model(idx [B, T])`` must return logits [B, T, V] or an object with ``.logits``. The model
    runs in its own dtype and device, in eval mode (its training flag is restored afterwards);
    log-probabilities are taken in fp32 and summed in fp64 (``next_token_loss``, weighting "tokens").
    """
    if tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be a 1-D integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    if ctx_len < 2:
        raise ValueError(f"ctx_len={ctx_len}: need at least 2 tokens per window (one context, one scored)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    wins = _windows(tokens.long(), ctx_len, bos_id)
    if not wins:
        raise ValueError(f"nothing to score: {tokens.numel()} tokens")
    # full-length windows go in batches; the shorter last window (if any) runs alone
    full = [w for w in wins if w.numel() == wins[0].numel()]
    batches = [torch.stack(full[i:i + batch_size]) for i in range(0, len(full), batch_size)]
    batches += [w[None] for w in wins[len(full):]]
    loss, count = next_token_loss(model, [(b[:, :-1], b[:, 1:]) for b in batches],
                                  device=model_device(model, tokens.device),
                                  progress="perplexity" if progress else None, leave=True)
    return PerplexityResult(tokens_evaluated=count, loss=loss, ppl=math.exp(loss))
