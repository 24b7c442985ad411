"""Held-out passages for the zero-shot suite: paragraphs and sentences of text nothing calibrates or trains on.

``HELD_OUT`` names, per corpus, the text source (``data.text_sources``) the suite reads:

- ``tinystories``: ``tinystories#0:0.8``, the first 80% of the TinyStories head in the shared data folder.
  stories260K calibrates (and distills) on the last 20% (``tinystories#0.8:1``: ``ptq.pipeline.default_texts``),
  every other model on C4. (A model *trained* on this file with ``blockscale train --data tinystories`` saw its
  first 90%: the suite is not held out for it.)
- ``wikitext2``: the WikiText-2 raw test split (``wiki.test.raw``): perplexity evaluates on it, nothing calibrates
  on it, and ``blockscale train --data wikitext2`` trains on the (tokenized) validation split.

TinyStories repeats stock passages across stories, so disjoint ranges of the file can still share text: an item
whose context occurs verbatim in ``CALIBRATION[corpus]`` (stories260K's calibration text) is left out
(``calibration_text``; 3 of the 2,245 next-sentence candidates, no last-word one).

A paragraph is a non-empty line that is not a WikiText heading (``= Title =``); a sentence ends with ``.``, ``!``
or ``?`` (and a closing quote) before whitespace and a capital letter or an opening quote.
"""
from __future__ import annotations

import re
from functools import lru_cache

from ..data.text_sources import load_text

HELD_OUT = {"tinystories": "tinystories#0:0.8", "wikitext2": "wikitext2"}
CALIBRATION = {"tinystories": "tinystories#0.8:1"}  # ptq.pipeline.default_texts("stories260k").calib
_SENTENCE_END = re.compile(r'[.!?]"?(?=\s+["A-Z])')
_HEADING = re.compile(r"^=.*=$")


def paragraphs(text: str) -> list[str]:
    """The paragraphs of ``text``: its non-empty lines, stripped, WikiText headings left out."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not _HEADING.match(line):
            out.append(line)
    return out


def sentences(paragraph: str) -> list[str]:
    """The sentences of a paragraph, in order (each stripped; joined by one space they give the paragraph
    back up to whitespace)."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(paragraph):
        out.append(paragraph[start:m.end()].strip())
        start = m.end()
    rest = paragraph[start:].strip()
    return out + ([rest] if rest else [])


def tail_sentences(sents: list[str], max_words: int) -> list[str]:
    """The longest run of the last sentences of ``sents`` with at most ``max_words`` words in all (possibly
    none)."""
    kept, words = [], 0
    for s in reversed(sents):
        words += len(s.split())
        if words > max_words:
            break
        kept.append(s)
    return kept[::-1]


@lru_cache(maxsize=4)
def held_out_paragraphs(corpus: str) -> tuple[str, ...]:
    """The paragraphs of ``HELD_OUT[corpus]`` (read once per process)."""
    if corpus not in HELD_OUT:
        raise ValueError(f"corpus {corpus!r}; allowed values: {', '.join(HELD_OUT)}")
    return tuple(paragraphs(load_text(HELD_OUT[corpus])))


@lru_cache(maxsize=4)
def calibration_text(corpus: str) -> str:
    """The text items of ``corpus`` must not occur in (``CALIBRATION``; "" where nothing calibrates on it)."""
    return load_text(CALIBRATION[corpus]) if corpus in CALIBRATION else ""


__all__ = ["CALIBRATION", "HELD_OUT", "calibration_text", "held_out_paragraphs", "paragraphs", "sentences", "tail_sentences"]
