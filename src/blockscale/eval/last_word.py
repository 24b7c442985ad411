"""Last-word prediction (in the manner of LAMBADA, not LAMBADA itself): greedy decoding of a passage's final
word given the rest of the passage, exact match.

Items, from held-out paragraphs (``eval.passages``) in order, a paragraph giving at most one:

- the passage is the paragraph's last sentences, at most ``MAX_WORDS`` words (a paragraph whose last sentence
  alone is longer gives none);
- it ends with a word of at least ``MIN_TARGET_LETTERS`` ASCII letters, then only ``.``, ``!`` or ``?`` (WikiText:
  after a space) and maybe a closing quote; that word is the target, the text before the space preceding it
  the context (at least ``MIN_CONTEXT_WORDS`` words);
- the target occurs earlier in the passage as a whole word (LAMBADA's passages were chosen so that people
  need the broad context to guess the word; most targets occur in it: here all do, so the passage, not
  general frequency, is what answers it).

Scoring: the continuation " TARGET" after the context (``eval.continuations``: tokens as lm-evaluation-harness
cuts them). An item is correct when greedy decoding writes exactly the target word: each of its tokens is the
model's argmax and the argmax token after them ends the word (its text does not start with a letter or digit:
"friend" when the model would go on to "friends" is wrong).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..data.tokenizer import Tokenizer
from .continuations import ContinuationScore, continuation_scores
from .passages import sentences, tail_sentences

MAX_WORDS = 80
MIN_CONTEXT_WORDS = 10
MIN_TARGET_LETTERS = 3
_LAST_WORD = re.compile(r'^(?P<context>.*\S)\s+(?P<word>[A-Za-z]+)\s?[.!?]"?$', re.S)


@dataclass(frozen=True)
class LastWordItem:
    """context: the passage before its final word; target: that word; paragraph: the paragraph's index."""

    context: str
    target: str
    paragraph: int


def last_word_item(paragraph: str, index: int = 0):
    """The item of one paragraph (module docstring), or None when it gives none."""
    passage = " ".join(tail_sentences(sentences(paragraph), MAX_WORDS))
    m = _LAST_WORD.match(passage)
    if m is None:
        return None
    context, word = m["context"], m["word"]
    if len(word) < MIN_TARGET_LETTERS or len(context.split()) < MIN_CONTEXT_WORDS:
        return None
    if re.search(rf"\b{word}\b", context) is None:
        return None
    return LastWordItem(context, word, index)


def last_word_items(paragraphs: Sequence[str]) -> list[LastWordItem]:
    """Every paragraph's item, in paragraph order."""
    out = []
    for i, p in enumerate(paragraphs):
        item = last_word_item(p, i)
        if item is not None:
            out.append(item)
    return out


def ends_word(tokenizer: Tokenizer, tokens: Sequence[int], next_token: int) -> bool:
    """Whether ``next_token`` after ``tokens`` ends the word they spell: the text it adds does not start with a
    letter or a digit."""
    head = tokenizer.decode(list(tokens))
    full = tokenizer.decode(list(tokens) + [next_token])
    added = full[len(head):] if full.startswith(head) else tokenizer.decode([next_token])
    return not added[:1].isalnum()


def is_correct(tokenizer: Tokenizer, score: ContinuationScore) -> bool:
    """Greedy decoding writes exactly the target word (module docstring)."""
    return score.greedy and ends_word(tokenizer, score.tokens, score.next_token)


def score_last_word(model, tokenizer: Tokenizer, items: Sequence[LastWordItem], *, bos: bool = False,
                    batch_size: int = 8) -> list[bool]:
    """Whether each item is correct (module docstring)."""
    scores = continuation_scores(model, tokenizer, [(it.context, " " + it.target) for it in items], bos=bos,
                                 batch_size=batch_size)
    return [is_correct(tokenizer, s) for s in scores]


__all__ = ["LastWordItem", "MAX_WORDS", "MIN_CONTEXT_WORDS", "MIN_TARGET_LETTERS", "ends_word", "is_correct",
           "last_word_item", "last_word_items", "score_last_word"]
