"""Next sentence among four (in the manner of HellaSwag, not HellaSwag itself): which sentence ends the
paragraph, the true one or one of three drawn from other stories, chosen by log-likelihood.

Items, from held-out TinyStories paragraphs (``eval.passages``):

- the ending is the paragraph's last sentence: ``ENDING_WORDS`` words, no quotation mark (a quote would tell
  the endings apart by punctuation alone), ending with ``.``, ``!`` or ``?``;
- the context is the sentences before it, the last ones up to ``CONTEXT_MAX_WORDS`` words, at least
  ``MIN_CONTEXT_WORDS``;
- the distractors: three other paragraphs' last sentences satisfying the same rules, from paragraphs at least
  ``STORY_DISTANCE`` paragraphs away (a story of the file spans a few paragraphs: another story), within
  ``LENGTH_SLACK`` words of the true ending's length (length tells nothing), different from it and from each
  other once case and punctuation are ignored; drawn with ``random.Random`` seeded by (seed, paragraph), and the
  true ending put at a position drawn from the same generator.

Scoring (``eval.continuations``): the log-likelihood of " ENDING" after the context for each of the four; ``acc``:
the most likely is the true one; ``acc_norm``: the same with each log-likelihood divided by the ending's length in
characters (lm-evaluation-harness' acc_norm). Ties go to the first ending.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from ..data.tokenizer import Tokenizer
from .continuations import continuation_scores
from .passages import sentences, tail_sentences

ENDING_WORDS = (5, 25)
CONTEXT_MAX_WORDS = 60
MIN_CONTEXT_WORDS = 8
CHOICES = 4
STORY_DISTANCE = 10
LENGTH_SLACK = 2


@dataclass(frozen=True)
class NextSentenceItem:
    """context; endings: the four candidate sentences; label: the true one's index; paragraph: its index."""

    context: str
    endings: tuple[str, ...]
    label: int
    paragraph: int


def _ending_ok(sentence: str) -> bool:
    lo, hi = ENDING_WORDS
    return lo <= len(sentence.split()) <= hi and '"' not in sentence and sentence[-1:] in (".", "!", "?")


def normalized(sentence: str) -> str:
    """A sentence compared without case and punctuation: its lower-case words of letters and digits."""
    return " ".join(re.findall(r"[a-z0-9]+", sentence.lower()))


@dataclass(frozen=True)
class Passage:
    """A paragraph that can give an item: its index, context and true ending."""

    paragraph: int
    context: str
    ending: str


def passages(paragraphs: Sequence[str]) -> list[Passage]:
    """Every paragraph whose context and last sentence follow the rules (module docstring), in order."""
    out = []
    for i, p in enumerate(paragraphs):
        sents = sentences(p)
        if len(sents) < 2 or not _ending_ok(sents[-1]):
            continue
        context = " ".join(tail_sentences(sents[:-1], CONTEXT_MAX_WORDS))
        if len(context.split()) >= MIN_CONTEXT_WORDS:
            out.append(Passage(i, context, sents[-1]))
    return out


def make_item(passage: Passage, pool: Sequence[Passage], seed: int = 0) -> Optional[NextSentenceItem]:
    """``passage``'s item with distractors from the endings of ``pool`` (module docstring); None when fewer
    than three qualify."""
    words = len(passage.ending.split())
    seen = {normalized(passage.ending)}
    candidates = []
    for other in pool:
        key = normalized(other.ending)
        if (abs(other.paragraph - passage.paragraph) >= STORY_DISTANCE and key not in seen
                and abs(len(other.ending.split()) - words) <= LENGTH_SLACK):
            seen.add(key)
            candidates.append(other.ending)
    if len(candidates) < CHOICES - 1:
        return None
    rng = random.Random(seed * 1_000_003 + passage.paragraph)
    endings = rng.sample(candidates, CHOICES - 1)
    label = rng.randrange(CHOICES)
    endings.insert(label, passage.ending)
    return NextSentenceItem(passage.context, tuple(endings), label, passage.paragraph)


def choose(values: Sequence[float]) -> int:
    """The index of the largest value, the first on ties."""
    return max(range(len(values)), key=lambda k: (values[k], -k))


def score_next_sentence(model, tokenizer: Tokenizer, items: Sequence[NextSentenceItem], *, bos: bool = False,
                        batch_size: int = 8) -> tuple[list[bool], list[bool]]:
    """(correct by log-likelihood, correct by log-likelihood per character) for each item."""
    pairs = [(it.context, " " + e) for it in items for e in it.endings]
    lp = [s.logprob for s in continuation_scores(model, tokenizer, pairs, bos=bos, batch_size=batch_size)]
    acc, acc_norm = [], []
    for n, it in enumerate(items):
        mine = lp[n * CHOICES:(n + 1) * CHOICES]
        acc.append(choose(mine) == it.label)
        acc_norm.append(choose([v / len(e) for v, e in zip(mine, it.endings)]) == it.label)
    return acc, acc_norm


__all__ = ["CHOICES", "CONTEXT_MAX_WORDS", "ENDING_WORDS", "LENGTH_SLACK", "MIN_CONTEXT_WORDS", "NextSentenceItem",
           "Passage", "STORY_DISTANCE", "choose", "make_item", "normalized", "passages", "score_next_sentence"]
