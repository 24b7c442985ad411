"""blockscale's zero-shot suite (``bs.eval.zero_shot``): items chosen deterministically from held-out text, their
construction rules, and the scores checked against an independent count on stories260K (greedy generation for the
last word, one sequence at a time for the next sentence)."""
from __future__ import annotations

import re

import pytest
import torch

import blockscale as bs
from blockscale.data.text_sources import calibration_batches, load_text
from blockscale.eval.continuations import continuation_scores
from blockscale.eval.last_word import MIN_TARGET_LETTERS
from blockscale.eval.next_sentence import ENDING_WORDS, LENGTH_SLACK, STORY_DISTANCE, normalized
from blockscale.eval.passages import CALIBRATION, HELD_OUT, held_out_paragraphs, sentences
from blockscale.eval.zero_shot_suite import TASKS
from blockscale.ptq.pipeline import default_texts

pytestmark = pytest.mark.usefixtures("one_thread")
LW = ("last_word_tinystories", "last_word_wikitext2")
NS = "next_sentence_tinystories"


@pytest.mark.parametrize("task", bs.eval.ZERO_SHOT_TASKS)
def test_items_are_fixed_and_a_limit_is_a_prefix(task):
    items = bs.eval.zero_shot_items(task)
    assert len(items) == bs.eval.DEFAULT_ITEMS == 200
    assert bs.eval.zero_shot_items(task) == items
    assert bs.eval.zero_shot_items(task, limit=50) == items[:50]
    assert len({it.paragraph for it in items}) == 200  # one item per paragraph
    # another seed, another order (same rules)
    assert [it.paragraph for it in bs.eval.zero_shot_items(task, seed=1)] != [it.paragraph for it in items]


@pytest.mark.parametrize("task", LW)
def test_last_word_items_end_their_passage_and_occur_in_it(task):
    paras = held_out_paragraphs(TASKS[task].corpus)
    for it in bs.eval.zero_shot_items(task):
        assert re.fullmatch(rf"[A-Za-z]{{{MIN_TARGET_LETTERS},}}", it.target)
        assert re.search(rf"\b{it.target}\b", it.context)  # the passage holds the answer
        text = paras[it.paragraph]
        passage = f"{it.context} {it.target}"
        assert passage in text and re.fullmatch(r'\s?[.!?]"?', text[text.index(passage) + len(passage):])


def test_next_sentence_distractors_are_other_stories_last_sentences():
    paras = held_out_paragraphs("tinystories")
    last = {}  # normalized last sentence -> paragraphs it ends
    for i, p in enumerate(paras):
        last.setdefault(normalized(sentences(p)[-1]), set()).add(i)
    labels = []
    for it in bs.eval.zero_shot_items(NS):
        assert len(it.endings) == 4
        true = it.endings[it.label]
        assert sentences(paras[it.paragraph])[-1] == true and it.context in paras[it.paragraph]
        keys = [normalized(e) for e in it.endings]
        assert len(set(keys)) == 4  # no distractor equals the true ending or another distractor
        for k, e in enumerate(it.endings):
            n = len(e.split())
            assert ENDING_WORDS[0] <= n <= ENDING_WORDS[1] and '"' not in e
            if k != it.label:
                assert abs(n - len(true.split())) <= LENGTH_SLACK
                assert any(abs(j - it.paragraph) >= STORY_DISTANCE for j in last[keys[k]])
        labels.append(it.label)
    assert sorted(set(labels)) == [0, 1, 2, 3] and max(labels.count(k) for k in range(4)) < 80


def _ranges(source):
    m = re.fullmatch(r".*#([0-9.]+):([0-9.]+)", source)
    return (float(m[1]), float(m[2])) if m else (0.0, 1.0)


def test_held_out_text_is_disjoint_from_calibration(stories260k):
    calib = default_texts("stories260k").calib  # the only built-in model calibrating on TinyStories
    assert CALIBRATION == {"tinystories": calib}
    assert calib.split("#")[0] == HELD_OUT["tinystories"].split("#")[0] == "tinystories"
    assert _ranges(HELD_OUT["tinystories"])[1] <= _ranges(calib)[0]
    assert default_texts("smollm2-135m").calib == "c4" and HELD_OUT["wikitext2"] == "wikitext2"
    calib_text = load_text(calib)
    windows = calibration_batches(stories260k.tokenizer, calib, 128, 512, bos=True)
    decoded = [stories260k.tokenizer.decode(w[1:].tolist()) for w in windows]
    for task in (LW[0], NS):
        for it in bs.eval.zero_shot_items(task):
            assert it.context not in calib_text and not any(it.context in d for d in decoded)
    c4 = load_text("c4")
    assert not any(it.context in c4 for it in bs.eval.zero_shot_items(LW[1]))


def _greedy_word(model, tok, ids: list[int], max_new: int) -> str:
    """The first word greedy decoding writes after ``ids``, one token at a time."""
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            text = tok.decode(out).lstrip()
            m = re.match(r"[A-Za-z0-9]*", text)
            if len(m[0]) < len(text):  # something after the word: it is complete
                return m[0]
    return "<unfinished>"


def _logprob(model, ids: list[int], start: int) -> float:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return float(sum(lp[p - 1, ids[p]] for p in range(start, len(ids))))


def test_scores_match_an_independent_count_on_stories260k(stories260k):
    model, tok = stories260k.model, stories260k.tokenizer
    res = bs.eval.zero_shot(model, tok, limit=24, bos=True, batch_size=5)
    assert list(res.tasks) == list(bs.eval.ZERO_SHOT_TASKS)
    bos = [tok.bos_id]
    for task in LW:
        expected = []
        for it in bs.eval.zero_shot_items(task, 24):
            ctx = tok.encode(it.context)
            expected.append(_greedy_word(model, tok, bos + ctx, 12) == it.target)
        r = res.tasks[task]
        assert r.correct == tuple(expected) and r.items == 24 and r.acc == sum(expected) / 24
    acc, norm = [], []
    for it in bs.eval.zero_shot_items(NS, 24):
        ctx = bos + tok.encode(it.context)
        lps = []
        for e in it.endings:
            whole = bos + tok.encode(f"{it.context} {e}")
            assert whole[:len(ctx)] == ctx  # (the context's tokens are a prefix here)
            lps.append(_logprob(model, whole, len(ctx)))
        acc.append(max(range(4), key=lambda k: lps[k]) == it.label)
        norm.append(max(range(4), key=lambda k: lps[k] / len(it.endings[k])) == it.label)
    r = res.tasks[NS]
    assert r.correct == tuple(acc) and r.acc == sum(acc) / 24 and r.acc_norm == sum(norm) / 24
    # a trained model: well above chance on its own kind of text, nothing on Wikipedia's final words
    assert r.acc > 0.25 and res.tasks[LW[0]].acc > 0.05 and res.tasks[LW[1]].acc == 0.0


def test_same_items_same_accuracy_twice_and_any_batch(stories260k):
    model, tok = stories260k.model, stories260k.tokenizer
    a = bs.eval.zero_shot(model, tok, [LW[0], NS], limit=16, bos=True, batch_size=16)
    b = bs.eval.zero_shot(model, tok, [LW[0], NS], limit=16, bos=True, batch_size=3)
    assert a.tasks == b.tasks
    assert a.as_dict()["tasks"] == {t: {"items": 16, "acc": r.acc, "acc_norm": r.acc_norm} for t, r in a.tasks.items()}
    half = bs.eval.zero_shot(model, tok, [NS], limit=8, bos=True)
    assert half.tasks[NS].correct == a.tasks[NS].correct[:8]
    rec = bs.eval.zero_shot_recovery(half, a)
    assert rec == {NS: half.tasks[NS].acc / a.tasks[NS].acc}


def test_a_long_context_loses_its_left_tokens(stories260k):
    model, tok = stories260k.model, stories260k.tokenizer
    ctx = "Once upon a time, there was a little girl named Lily. She loved to play outside in the"
    ids = tok.encode(ctx)
    full, cut = continuation_scores(model, tok, [(ctx, " park")], bos=True)[0], continuation_scores(
        model, tok, [(ctx, " park")], bos=True, max_len=9)[0]
    cont = list(full.tokens)
    assert cut.tokens == full.tokens and cut.logprob != full.logprob
    kept = [tok.bos_id] + ids[len(ids) - (9 - 1 - len(cont)):]
    assert abs(cut.logprob - _logprob(model, kept + cont, len(kept))) < 1e-5  # (FP32 vs FP64 log-softmax)


def test_bad_arguments(stories260k):
    with pytest.raises(ValueError, match="'hellaswag'; allowed values: last_word_tinystories"):
        bs.eval.zero_shot(stories260k.model, stories260k.tokenizer, ["hellaswag"])
    with pytest.raises(ValueError, match="limit=0: must be an integer >= 1"):
        bs.eval.zero_shot_items(NS, limit=0)
