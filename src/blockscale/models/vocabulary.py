"""The vocabulary a model declares, read before its weights load, and the check that a distillation
teacher shares its student's (the KL loss compares their logits position by position).

``declared_vocab_size`` reads ``config.json`` of a local directory (a transformers model or a blockscale
export; untrusted: anything but a positive integer reads as unknown) and knows the built-in models;
hub names and GGUF files are unknown until loaded (None), and ``check_same_vocabulary`` then compares the
loaded models' configs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ..errors import UsageError

BUILTIN_VOCAB_SIZES = {"stories260k": 512, "smollm2-135m": 49152, "smollm2": 49152}
MAX_CONFIG_BYTES = 16 << 20


def _positive_int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def declared_vocab_size(name_or_path: str) -> Optional[int]:
    """The vocabulary size ``name_or_path`` declares (``vocab_size`` of its config, or of its
    ``text_config``), or None when it cannot be read without loading the model."""
    key = str(name_or_path).lower()
    if key in BUILTIN_VOCAB_SIZES:
        return BUILTIN_VOCAB_SIZES[key]
    cfg = Path(name_or_path) / "config.json"
    try:
        if not cfg.is_file() or cfg.stat().st_size > MAX_CONFIG_BYTES:
            return None
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the loader reports an unreadable config in its own words
    if not isinstance(data, dict):
        return None
    text = data.get("text_config")
    return _positive_int(data.get("vocab_size")) or (_positive_int(text.get("vocab_size"))
                                                     if isinstance(text, dict) else None)


def model_vocab_size(model: Any) -> Optional[int]:
    """The vocabulary size of a loaded transformers model (its text config's ``vocab_size``)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return _positive_int(getattr(text, "vocab_size", None))


def check_same_vocabulary(student: str, teacher: str, student_size: Optional[int], teacher_size: Optional[int],
                          student_tokens: Optional[dict] = None, teacher_tokens: Optional[dict] = None) -> None:
    """UsageError (naming --teacher) unless the teacher's vocabulary is the student's: the same size
    (when both are known) and, when both tokenizers are known, the same token -> id maps."""
    if student_size is not None and teacher_size is not None and student_size != teacher_size:
        raise UsageError(f"--teacher {teacher}: its vocabulary has {teacher_size} tokens, {student}'s has "
                         f"{student_size}; the teacher must share the student's tokenizer (the loss compares their "
                         "logits token by token)")
    if student_tokens is not None and teacher_tokens is not None and student_tokens != teacher_tokens:
        differ = sorted((t for t in set(student_tokens) | set(teacher_tokens)
                         if student_tokens.get(t) != teacher_tokens.get(t)), key=repr)[:3]
        shown = "; ".join(f"{t!r}: {_id(student_tokens, t)} in {student}, {_id(teacher_tokens, t)} in the teacher"
                          for t in differ)
        raise UsageError(f"--teacher {teacher}: its tokenizer maps tokens to other ids than {student}'s ({shown}); "
                         "the teacher must share the student's tokenizer")


def _id(tokens: dict, token) -> str:
    return f"id {tokens[token]}" if token in tokens else "absent"


__all__ = ["BUILTIN_VOCAB_SIZES", "check_same_vocabulary", "declared_vocab_size", "model_vocab_size"]
