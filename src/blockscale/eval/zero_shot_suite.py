"""blockscale's own small zero-shot suite (not a standard benchmark): accuracy on three deterministic tasks built
from held-out text in the shared data folder (``eval.passages``), next to perplexity.

    result = zero_shot(model, tokenizer)                   # 200 items per task
    result = zero_shot(model, tokenizer, limit=50)         # the first 50 of those 200, per task
    result.tasks["next_sentence_tinystories"].acc_norm
    zero_shot_recovery(result, zero_shot(full_precision, tokenizer))  # {task: acc / full-precision acc}

Tasks (``ZERO_SHOT_TASKS``):

- ``last_word_tinystories``, ``last_word_wikitext2``: last-word prediction (``eval.last_word``), exact match of
  the greedily decoded final word of a passage;
- ``next_sentence_tinystories``: the true last sentence of a paragraph among four (``eval.next_sentence``), by
  log-likelihood (``acc``) and by log-likelihood per character (``acc_norm``).

Items: every candidate of a task's held-out text (but those whose context occurs in the calibration text:
``eval.passages``), shuffled by ``random.Random(seed)``; a task's items are the
first ``limit`` (default ``DEFAULT_ITEMS``) of that order, so a smaller limit is a prefix of a larger one and every
model sees the same items (they are text, tokenized per model). Chance: 1/4 for next sentence, near 0 for last
word.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

from ..data.tokenizer import Tokenizer
from .last_word import last_word_items, score_last_word
from .next_sentence import make_item, passages, score_next_sentence
from .passages import calibration_text, held_out_paragraphs

DEFAULT_ITEMS = 200


@dataclass(frozen=True)
class ZeroShotTask:
    """A task: its held-out corpus (``eval.passages.HELD_OUT``), what it measures, and its kind."""

    name: str
    corpus: str
    kind: str  # "last_word" | "next_sentence"
    description: str


TASKS = {t.name: t for t in (
    ZeroShotTask("last_word_tinystories", "tinystories", "last_word",
                 "greedy final word of a TinyStories passage, exact match"),
    ZeroShotTask("last_word_wikitext2", "wikitext2", "last_word",
                 "greedy final word of a WikiText-2 passage, exact match"),
    ZeroShotTask("next_sentence_tinystories", "tinystories", "next_sentence",
                 "the true last sentence of a TinyStories paragraph among 4, by log-likelihood"),
)}
ZERO_SHOT_TASKS = tuple(TASKS)


@dataclass(frozen=True)
class TaskAccuracy:
    """One task's result: items scored, acc (and acc_norm where the task has it), and each item's acc."""

    task: str
    items: int
    acc: float
    acc_norm: Optional[float] = None
    correct: tuple[bool, ...] = ()


@dataclass(frozen=True)
class ZeroShotResult:
    """Per-task accuracies, in task order, and the seconds scoring took."""

    tasks: dict
    seconds: float

    def as_dict(self) -> dict:
        """JSON-ready: {task: {items, acc, acc_norm}} and seconds (per-item results left out)."""
        return {"tasks": {k: {f: v for f, v in asdict(t).items() if f not in ("task", "correct")}
                          for k, t in self.tasks.items()}, "seconds": self.seconds}


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    """``tasks`` as a tuple of known task names (ValueError naming the unknown ones)."""
    if isinstance(tasks, str):
        tasks = (tasks,)
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"zero-shot task(s) {', '.join(map(repr, bad)) or '(none)'}; allowed values: "
                         f"{', '.join(ZERO_SHOT_TASKS)}")
    return tuple(dict.fromkeys(tasks))


def _check_limit(limit: Optional[int]) -> int:
    if limit is None:
        return DEFAULT_ITEMS
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit={limit!r}: must be an integer >= 1 (or None: {DEFAULT_ITEMS} items per task)")
    return limit


@lru_cache(maxsize=16)
def _order(task: str, seed: int) -> tuple:
    """The task's candidates (last word: items; next sentence: passages) in their seeded order, and the pool."""
    paras = held_out_paragraphs(TASKS[task].corpus)
    found = last_word_items(paras) if TASKS[task].kind == "last_word" else passages(paras)
    seen = calibration_text(TASKS[task].corpus)  # (text repeated in the calibration part: left out)
    found = [c for c in found if not (seen and c.context in seen)]
    shuffled = list(found)
    random.Random(seed).shuffle(shuffled)
    return tuple(shuffled), tuple(found)


def zero_shot_items(task: str, limit: Optional[int] = None, seed: int = 0) -> list:
    """The items of ``task`` (``LastWordItem`` / ``NextSentenceItem``): the first ``limit`` (default
    ``DEFAULT_ITEMS``) in the seeded order (fewer when the text has fewer)."""
    (task,) = check_tasks((task,))
    n = _check_limit(limit)
    shuffled, pool = _order(task, seed)
    if TASKS[task].kind == "last_word":
        return list(shuffled[:n])
    items = []
    for passage in shuffled:
        if len(items) == n:
            break
        item = make_item(passage, pool, seed)
        if item is not None:
            items.append(item)
    return items


def _score(task: str, model, tokenizer, items, bos: bool, batch_size: int) -> TaskAccuracy:
    if not items:
        return TaskAccuracy(task, 0, float("nan"))
    if TASKS[task].kind == "last_word":
        correct = score_last_word(model, tokenizer, items, bos=bos, batch_size=batch_size)
        return TaskAccuracy(task, len(items), sum(correct) / len(items), None, tuple(correct))
    acc, norm = score_next_sentence(model, tokenizer, items, bos=bos, batch_size=batch_size)
    return TaskAccuracy(task, len(items), sum(acc) / len(items), sum(norm) / len(items), tuple(acc))


def zero_shot(model, tokenizer: Tokenizer, tasks: Sequence[str] = ZERO_SHOT_TASKS, limit: Optional[int] = None, *,
              bos: bool = False, batch_size: int = 8, seed: int = 0,
              log: Optional[Callable[[str], None]] = None) -> ZeroShotResult:
    """Accuracy of ``model`` on each of ``tasks`` (module docstring): ``limit`` items per task (default
    ``DEFAULT_ITEMS``); ``bos``: BOS opens every sequence (a tokenizer without one: no BOS); ``log``: called with
    a line per task done."""
    tasks = check_tasks(tasks)
    n = _check_limit(limit)
    t0 = time.time()
    out = {}
    for task in tasks:
        t = time.time()
        out[task] = _score(task, model, tokenizer, zero_shot_items(task, n, seed), bos, batch_size)
        if log is not None:
            r = out[task]
            log(f"{task}: acc {r.acc:.4f}" + (f", acc_norm {r.acc_norm:.4f}" if r.acc_norm is not None else "")
                + f" ({r.items} items, {time.time() - t:.1f} s)")
    return ZeroShotResult(out, time.time() - t0)


def zero_shot_recovery(result: ZeroShotResult, baseline: ZeroShotResult, field: str = "acc") -> dict:
    """{task: ``field`` of ``result`` / that of ``baseline``} for the tasks both have (NaN where the baseline's
    is 0 or missing)."""
    out = {}
    for task, r in result.tasks.items():
        b = baseline.tasks.get(task)
        mine, theirs = getattr(r, field), getattr(b, field, None) if b is not None else None
        ok = mine is not None and theirs is not None and theirs > 0 and not math.isnan(theirs)
        out[task] = mine / theirs if ok else float("nan")
    return out


__all__ = ["DEFAULT_ITEMS", "TASKS", "TaskAccuracy", "ZERO_SHOT_TASKS", "ZeroShotResult", "ZeroShotTask", "check_tasks",
           "zero_shot", "zero_shot_items", "zero_shot_recovery"]
