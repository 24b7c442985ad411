"""Token streams for LM pretraining and a stateless, rank-aware batch sampler.

    data = load_data("tinystories")                       # bytes -> vocab 256
    x, y = data.get_batch("train", batch_size=8, seq_len=64, step=0)

Sampler contract (what makes resume exact and DDP equal to one big batch): the global batch of
optimizer step ``step`` is a list of rows; row ``g`` is the window of ``seq_len + 1`` tokens that
starts at ``perm(g)``, perm a pseudo-random permutation of the valid starts ``[0, len - seq_len)``
keyed by (seed, split, step), so rows of one step never share a start. Rank ``rank`` of
``world_size`` at micro-step ``micro_step`` takes rows ``(micro_step*world_size + rank)*batch_size
+ i``, ``i < batch_size``. Hence a batch depends only on (seed, split, step, micro_step, rank,
world_size, batch_size) -- no sampler state to checkpoint --, ranks take disjoint rows, and any
split of a step into micro-steps x ranks x rows covers rows ``0 .. total-1``: exactly the windows
one process draws with one batch of ``batch_size*world_size*grad_accum`` rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from ..data.paths import data_root
from ..data.tokenizer import ByteTokenizer  # noqa: F401  (re-exported: blockscale.train.ByteTokenizer)

#: built-in corpora, resolved under ``blockscale.data.paths.data_root()``. WikiText-2 maps to its
#: validation split (the test split stays for perplexity evaluation).
BUILTIN = {
    "tinystories": "tinystories/tinystories_val_head.txt",
    "wikitext2": "wikitext-2/valid.txt",
    "shakespeare": "tinyshakespeare/input.txt",
}

_SPLITS = {"train": 1, "val": 2}
_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays: a bijection with good avalanche (wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    h = np.zeros(1, dtype=np.uint64)
    for p in parts:
        h = _mix64(h ^ np.uint64(int(p) & _MASK64))
    return h[0]


def _permute(g: np.ndarray, n: int, key: np.uint64) -> np.ndarray:
    """Row indices ``g`` (uint64) -> window starts in [0, n): for each block of n consecutive rows a
    keyed bijection of [0, n) (4-round Feistel network on 2h >= log2(n) bits, cycle walking)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    block_key = _mix64(np.full(g.shape, key, dtype=np.uint64) ^ (g // np.uint64(n)))
    round_keys = [_mix64(block_key ^ np.uint64(r)) for r in range(4)]

    def feistel(v, ks):
        left, right = v >> np.uint64(half), v & mask
        for k in ks:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(g % np.uint64(n), round_keys)
    bad = out >= np.uint64(n)
    while bad.any():  # cycle walking: re-apply until inside [0, n); < 4 rounds expected
        out[bad] = feistel(out[bad], [k[bad] for k in round_keys])
        bad = out >= np.uint64(n)
    return out


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed that depends only on (seed, *parts): for per-step torch.manual_seed."""
    return int(_key(seed, *parts)) & ((1 << 63) - 1)


def resolve_source(source: Union[str, os.PathLike]) -> Path:
    """A built-in name (see ``BUILTIN``) under data_root(), else a file path. Raises FileNotFoundError."""
    name = str(source)
    path = data_root() / BUILTIN[name] if name in BUILTIN else Path(name)
    if not path.is_file():
        hint = " (set BLOCKSCALE_DATA to the shared data folder)" if name in BUILTIN else ""
        raise FileNotFoundError(f"text data {name!r}: no file at {path}{hint}")
    return path


def _compact(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    tokens = torch.as_tensor(tokens).reshape(-1)
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got {tokens.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
    return tokens.to(torch.uint8 if vocab_size <= 256 else torch.int32).contiguous()


@dataclass
class TokenData:
    """Train / val token streams (1-D, compact dtype) and the vocabulary size."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int

    @classmethod
    def from_tokens(cls, tokens, vocab_size: int, val_fraction: float = 0.1) -> "TokenData":
        """Split a 1-D token sequence: the last ``val_fraction`` of it is val (deterministic)."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}: expected 0 <= val_fraction < 1")
        tokens = _compact(tokens, vocab_size)
        n_val = int(round(tokens.numel() * val_fraction))
        n_train = tokens.numel() - n_val
        return cls(train=tokens[:n_train], val=tokens[n_train:], vocab_size=vocab_size)

    def split(self, name: str) -> torch.Tensor:
        if name not in _SPLITS:
            raise ValueError(f"split {name!r}: expected 'train' or 'val'")
        return self.train if name == "train" else self.val

    def get_batch(self, split: str, batch_size: int, seq_len: int, step: int, rank: int = 0,
                  world_size: int = 1, seed: int = 0, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), long [batch_size, seq_len], y = x shifted by one; see the module docstring for
        which windows are drawn. Within a step, rows get distinct window starts (ranks and
        micro-steps never repeat a window) unless a step needs more rows than there are starts."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside world_size={world_size}")
        if batch_size <= 0 or seq_len <= 0 or step < 0 or micro_step < 0:
            raise ValueError("batch_size and seq_len must be positive, step and micro_step >= 0")
        data = self.split(split)
        high = data.numel() - seq_len  # valid window starts: 0 .. high-1
        if high <= 0:
            raise ValueError(f"{split} split has {data.numel()} tokens: too few for seq_len={seq_len}")
        first = (micro_step * world_size + rank) * batch_size
        rows = np.arange(first, first + batch_size, dtype=np.uint64)
        starts = _permute(rows, high, _key(seed, _SPLITS[split], step))
        idx = torch.from_numpy(starts.astype(np.int64))[:, None] + torch.arange(seq_len + 1)
        chunk = data[idx].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def load_data(source: Union[str, os.PathLike], encode: Optional[Callable[[str], list[int]]] = None,
              vocab_size: Optional[int] = None, val_fraction: float = 0.1) -> TokenData:
    """Tokenize a text file (a path or a ``BUILTIN`` name). Without ``encode``: UTF-8 bytes (vocab
    256). With ``encode`` (any ``str -> list[int]``, e.g. a BPE tokenizer) ``vocab_size`` is required."""
    path = resolve_source(source)
    if encode is None:
        if vocab_size not in (None, 256):
            raise ValueError(f"byte tokenization has vocab 256, got vocab_size={vocab_size}")
        tokens = torch.from_numpy(np.frombuffer(path.read_bytes(), dtype=np.uint8).copy())
        return TokenData.from_tokens(tokens, 256, val_fraction)
    if vocab_size is None:
        raise ValueError("a custom encode needs vocab_size")
    ids = encode(path.read_text(encoding="utf-8"))
    return TokenData.from_tokens(torch.as_tensor(ids, dtype=torch.int64), vocab_size, val_fraction)
