"""The one tokenizer interface: what training data, calibration and evaluation ask of a tokenizer.

    ids = tok.encode("Once upon a time")     # list[int], no special tokens
    tok.decode(ids) == "Once upon a time"    # where the tokenizer is lossless
    tok.vocab_size, tok.bos_id, tok.eos_id   # ids are None where the tokenizer has no such token

Three classes satisfy it: ``ByteTokenizer`` (here: UTF-8 bytes), ``models.stories260k.Tok512`` (llama2.c
BPE) and ``models.hf.ModelTokenizer`` (a loaded model's tokenizer: transformers or tok512). Callers type
against ``Tokenizer``; ``isinstance(tok, Tokenizer)`` checks the members exist.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """encode(text) -> token ids (no BOS / EOS added); decode(ids) -> text; vocab_size; bos_id / eos_id
    (None when the tokenizer has no such token)."""

    vocab_size: Optional[int]
    bos_id: Optional[int]
    eos_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, lossless for any text; no BOS / EOS."""

    vocab_size = 256
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


__all__ = ["ByteTokenizer", "Tokenizer"]
