"""Text for calibration and evaluation: built-in corpora (offline), local files, Hugging Face datasets.

A source is a string:
  - a built-in name: "wikitext2" (WikiText-2 raw test split), "c4" (2,000 C4 validation documents),
    "tinystories", "tinyshakespeare" (read from the shared data folder, see ``data_root``);
  - a path to a ``.txt`` / ``.raw`` file (UTF-8) or a ``.jsonl`` file (one JSON object per line with a
    "text" field; documents joined by blank lines);
  - "hf:DATASET[,CONFIG][:SPLIT]" for a Hugging Face dataset with a "text" column (needs the
    ``datasets`` package and the hub), e.g. "hf:wikitext,wikitext-2-raw-v1:test", "hf:allenai/c4,en:validation".
An optional suffix "#A:B" keeps the characters from fraction A to fraction B of the text (cut at
whitespace), so calibration and evaluation can use disjoint parts of one corpus: "tinystories#0.8:1".
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from ..errors import DataError, UsageError
from .paths import data_root
from .tokenizer import Tokenizer

BUILTIN_TEXTS = {
    "wikitext2": "wikitext-2-raw/wiki.test.raw",
    "c4": "c4-validation-2k/c4_validation_2k.jsonl",
    "tinystories": "tinystories/tinystories_val_head.txt",
    "tinyshakespeare": "tinyshakespeare/input.txt",
}
_RANGE = re.compile(r"^(?P<src>.*)#(?P<a>[0-9.]+):(?P<b>[0-9.]+)$")


def _read_jsonl(path: Path) -> str:
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}: line {n} has no string field 'text'")
            docs.append(obj["text"])
    return "\n\n".join(docs)


def _import_datasets(spec: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"text source 'hf:{spec}' needs the `datasets` package (pip install datasets)") from None
    return datasets


def _read_hf(spec: str) -> str:
    datasets = _import_datasets(spec)
    name, _, split = spec.partition(":")
    path, _, config = name.partition(",")
    try:
        ds = datasets.load_dataset(path, config or None, split=split or "train")
    except Exception as exc:  # network, unknown dataset / config / split: datasets raises many types
        raise DataError(f"text source 'hf:{spec}': the dataset cannot be loaded ({type(exc).__name__}: {exc})") from exc
    if "text" not in ds.column_names:
        raise DataError(f"dataset {spec!r} has no 'text' column (columns: {ds.column_names})")
    return "\n\n".join(t for t in ds["text"] if t)


def _split_range(source: str) -> tuple[str, float, float]:
    """(source without its "#A:B" suffix, A, B)."""
    m = _RANGE.match(source)
    if not m:
        return source, 0.0, 1.0
    lo, hi = float(m["a"]), float(m["b"])
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"text range #{m['a']}:{m['b']}: need 0 <= A < B <= 1")
    return m["src"], lo, hi


def _local_path(source: str) -> Path:
    """The file of a built-in name or path; FileNotFoundError when it does not exist."""
    path = data_root() / BUILTIN_TEXTS[source] if source in BUILTIN_TEXTS else Path(source)
    if not path.is_file():
        hint = (f" (built-in corpora are read from {data_root()}; set BLOCKSCALE_DATA)" if source in BUILTIN_TEXTS
                else f"; built-in names: {', '.join(BUILTIN_TEXTS)}; or hf:DATASET[,CONFIG][:SPLIT]")
        raise FileNotFoundError(f"text source {source!r}: {path} does not exist{hint}")
    return path


def check_text_source(source: str) -> None:
    """Raise what ``load_text`` would for a source that cannot be found, without reading it: ValueError
    (not a non-empty string, a bad "#A:B" range), FileNotFoundError (no such built-in file or path),
    ImportError (``hf:`` without the ``datasets`` package)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"text source must be a non-empty string, got {source!r}")
    source, _, _ = _split_range(source)
    if source.startswith("hf:"):
        _import_datasets(source[3:])
    else:
        _local_path(source)


def load_text(source: str, max_chars: Optional[int] = None) -> str:
    """The text of ``source`` (see the module docstring), at most ``max_chars`` characters."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"text source must be a non-empty string, got {source!r}")
    source, lo, hi = _split_range(source)
    if source.startswith("hf:"):
        text = _read_hf(source[3:])
    else:
        path = _local_path(source)
        try:
            text = _read_jsonl(path) if path.suffix == ".jsonl" else path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"text source {source!r}: {path} is not UTF-8 text ({exc.reason} at byte "
                            f"{exc.start})") from None
    if (lo, hi) != (0.0, 1.0):
        a, b = int(lo * len(text)), int(hi * len(text))
        a = a if a == 0 else text.find(" ", a) + 1 or a  # whole words at both ends
        b = b if b == len(text) else max(text.rfind(" ", a, b), a)
        text = text[a:b]
    if max_chars is not None:
        text = text[:max_chars]
    if not text.strip():
        raise DataError(f"text source {source!r} is empty")
    return text


def _token_stream(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)


def window_starts(n_tokens: int, n_samples: int, body: int, seed: int = 0, holdout: int = 0) -> torch.Tensor:
    """Seeded random start offsets of ``n_samples`` windows of ``body`` tokens in a stream of ``n_tokens``.
    With ``holdout`` the last ``holdout`` windows come from the stream's tail and the others from its head, cut in
    proportion to their numbers, so no held-out window shares a token with a training window; without it, the
    offsets are those calibration has always drawn. DataError when a part is shorter than one window."""
    gen = torch.Generator().manual_seed(seed)
    if not holdout:
        return torch.randint(0, n_tokens - body + 1, (n_samples,), generator=gen)
    if not 0 < holdout < n_samples:
        raise ValueError(f"holdout={holdout}: must be between 1 and n_samples - 1 ({n_samples - 1})")
    cut = n_tokens * (n_samples - holdout) // n_samples
    if min(cut, n_tokens - cut) < body:
        raise DataError(f"the text gives {n_tokens} tokens: too few to hold out {holdout} of {n_samples} windows "
                        f"of {body} tokens from a part of the text of their own (need at least {body} tokens in each "
                        "part)")
    train = torch.randint(0, cut - body + 1, (n_samples - holdout,), generator=gen)
    held = cut + torch.randint(0, n_tokens - cut - body + 1, (holdout,), generator=gen)
    return torch.cat([train, held])


def calibration_batches(tokenizer: Tokenizer, source: str, n_samples: int, seq_len: int, seed: int = 0,
                        bos: bool = False, holdout: int = 0) -> torch.Tensor:
    """[n_samples, seq_len] token windows at seeded random offsets of the tokenized ``source``
    (as GPTQ / AWQ calibrate); with ``bos`` each window starts with BOS. ``holdout``: the last ``holdout`` windows
    are drawn from the end of the text, disjoint from the others (a held-out split: ``window_starts``)."""
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"n_samples={n_samples}, seq_len={seq_len}: need n_samples >= 1 and seq_len >= 2")
    body = seq_len - 1 if bos else seq_len
    # enough text for a few times the tokens we need, without tokenizing a whole corpus
    ids = _token_stream(tokenizer, load_text(source, max_chars=max(400_000, 16 * n_samples * seq_len)))
    if ids.numel() < body + 1:
        raise DataError(f"text source {source!r} has only {ids.numel()} tokens; need at least {body + 1}")
    starts = window_starts(ids.numel(), n_samples, body, seed, holdout)
    out = torch.stack([ids[s:s + body] for s in starts.tolist()])
    if bos:
        if tokenizer.bos_id is None:
            raise UsageError("bos=True (BOS opening every calibration window) but the tokenizer has no BOS token")
        out = torch.cat([torch.full((n_samples, 1), tokenizer.bos_id, dtype=torch.long), out], dim=1)
    return out


def evaluation_tokens(tokenizer: Tokenizer, source: str, bos_at_start: bool = False,
                      max_tokens: Optional[int] = None) -> torch.Tensor:
    """The whole of ``source`` as one token stream (optionally BOS first), cut to ``max_tokens``."""
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens}: need at least 2 tokens (or None for the whole text)")
    ids = _token_stream(tokenizer, load_text(source))
    if bos_at_start:
        if tokenizer.bos_id is None:
            raise UsageError("BOS at the stream start requested (bos 'stream') but the tokenizer has no BOS token")
        ids = torch.cat([torch.tensor([tokenizer.bos_id]), ids])
    return ids if max_tokens is None else ids[:max_tokens]


__all__ = ["BUILTIN_TEXTS", "calibration_batches", "check_text_source", "evaluation_tokens", "load_text",
           "window_starts"]
