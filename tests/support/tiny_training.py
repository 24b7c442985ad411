"""A tiny LM and data for the trainer's tests (tests/train/, tests/cli/): ``TinyLM`` with the trainer's contract
(forward(idx, targets) -> (logits, loss)), ``tiny_model`` seeded, ``synthetic_data`` a learnable stream over 64
symbols, ``small_cfg`` a few-step CPU TrainConfig."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from blockscale.train import TokenData, TrainConfig


class TinyLM(nn.Module):
    """A few-thousand-parameter LM with the trainer's contract: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, vocab: int = 64, dim: int = 16, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        h = h + self.drop(self.mlp(self.norm(h)))
        logits = self.head(h)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def tiny_model(seed: int = 0, dropout: float = 0.0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(dropout=dropout)


def synthetic_data() -> TokenData:
    """A learnable stream over 64 symbols: a noisy repeating pattern, fixed by its seed."""
    g = torch.Generator().manual_seed(0)
    base = torch.arange(8000) % 17 * 3 % 64
    noise = torch.randint(0, 64, (8000,), generator=g)
    keep = torch.rand(8000, generator=g) < 0.8
    return TokenData.from_tokens(torch.where(keep, base, noise), vocab_size=64)


def small_cfg(tmp_path=None, **kw) -> TrainConfig:
    base = dict(steps=6, batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_interval=3,
                eval_batches=2, log_interval=1, progress=False, device="cpu", autocast="none", seed=7,
                out_dir=str(tmp_path) if tmp_path is not None else None)
    base.update(kw)
    return TrainConfig(**base)
