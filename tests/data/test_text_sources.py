"""Text sources for calibration / evaluation: built-in corpora, files, ranges, token windows."""
from __future__ import annotations

import json

import pytest
import torch

from blockscale import data_root
from blockscale.models.hf import ModelTokenizer
from blockscale.data.text_sources import calibration_batches, evaluation_tokens, load_text, window_starts
from blockscale.errors import DataError

BYTES = ModelTokenizer(lambda text: list(text.encode("utf-8")), bos_id=256, eos_id=None)


def test_builtin_and_file_sources(tmp_path):
    wiki = load_text("wikitext2")
    assert wiki.startswith(" = Robert Boulter = \n Robert Boulter is") and len(wiki) == 1_285_622
    c4 = load_text("c4")
    with open(data_root() / "c4-validation-2k/c4_validation_2k.jsonl") as f:
        first, second = (json.loads(f.readline())["text"] for _ in range(2))
    assert c4.startswith(first + "\n\n" + second + "\n\n")
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": "one two"}\n\n{"text": "three"}\n')
    assert load_text(str(p)) == "one two\n\nthree"
    t = tmp_path / "plain.txt"
    t.write_text("alpha beta gamma delta epsilon zeta eta theta")
    assert load_text(str(t), max_chars=10) == "alpha beta"


def test_ranges_are_disjoint_whole_words():
    text = load_text("tinystories")
    a, b = load_text("tinystories#0:0.8"), load_text("tinystories#0.8:1")
    assert text.startswith(a) and text.endswith(b)
    assert len(a) + len(b) <= len(text) and len(a) > 0.79 * len(text) and len(b) > 0.19 * len(text)
    assert not a.endswith(" ") and text[len(a)] == " "  # cut at whitespace


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="built-in names"):
        load_text("no-such-corpus")
    with pytest.raises(ValueError, match="need 0 <= A < B <= 1"):
        load_text("wikitext2#0.5:0.2")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_text(str(bad))
    notext = tmp_path / "notext.jsonl"
    notext.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="no string field 'text'"):
        load_text(str(notext))
    with pytest.raises(ValueError, match="n_samples"):
        calibration_batches(BYTES, "wikitext2", 0, 16)


def test_calibration_windows_are_seeded_slices_of_the_stream():
    a = calibration_batches(BYTES, "tinyshakespeare", 4, 64, seed=1)
    b = calibration_batches(BYTES, "tinyshakespeare", 4, 64, seed=1)
    c = calibration_batches(BYTES, "tinyshakespeare", 4, 64, seed=2)
    assert a.shape == (4, 64) and torch.equal(a, b) and not torch.equal(a, c)
    text = load_text("tinyshakespeare").encode()
    for row in a:
        assert bytes(row.tolist()) in text
    withbos = calibration_batches(BYTES, "tinyshakespeare", 3, 64, bos=True)
    assert withbos.shape == (3, 64) and (withbos[:, 0] == 256).all()
    ev = evaluation_tokens(BYTES, "tinyshakespeare", bos_at_start=True, max_tokens=100)
    assert ev.shape == (100,) and ev[0] == 256 and bytes(ev[1:].tolist()) == text[:99]


def test_hf_dataset_source_needs_datasets():
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed; the hub is not reachable here")
    with pytest.raises(ImportError, match="needs the `datasets` package"):
        load_text("hf:wikitext,wikitext-2-raw-v1:test")


def test_model_loading_errors(tmp_path):
    from blockscale.models.hf import load_model

    with pytest.raises(FileNotFoundError, match="GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="not a built-in name"):
        load_model("not-a-model")


@pytest.mark.parametrize("n_tokens,n,body,holdout", [(10_000, 64, 32, 8), (5_000, 40, 100, 1), (2_000, 9, 200, 4)])
def test_held_out_windows_share_no_token_with_the_training_windows(n_tokens, n, body, holdout):
    """The held-out split (best-step selection's windows) is drawn from the tail of the text and the training
    windows from its head, cut in proportion to their numbers: no token position is in both (drawn among the
    training windows, about a third of the held-out tokens of the recovery protocol were also training tokens)."""
    for seed in range(5):
        s = window_starts(n_tokens, n, body, seed=seed, holdout=holdout)
        train, held = s[:-holdout], s[-holdout:]
        assert s.shape == (n,) and int(s.min()) >= 0 and int(s.max()) + body <= n_tokens
        assert int(train.max()) + body <= int(held.min())  # every training token before every held-out token
        cut = n_tokens * (n - holdout) // n
        assert int(train.max()) + body <= cut <= int(held.min())


def test_held_out_windows_leave_calibration_draws_unchanged():
    """Without a held-out split the windows are those calibration always drew (GPTQ / AWQ calibration and the
    committed results reproduce bit for bit); with one, they are the stream's slices at ``window_starts``."""
    g = torch.Generator().manual_seed(3)
    assert torch.equal(window_starts(1_000, 7, 50, seed=3), torch.randint(0, 951, (7,), generator=g))
    ids = torch.tensor(list(load_text("tinyshakespeare", max_chars=400_000).encode()))
    got = calibration_batches(BYTES, "tinyshakespeare", 24, 64, seed=1, holdout=6)
    starts = window_starts(ids.numel(), 24, 64, seed=1, holdout=6)
    assert torch.equal(got, torch.stack([ids[a:a + 64] for a in starts.tolist()]))
    assert torch.equal(calibration_batches(BYTES, "tinyshakespeare", 24, 64, seed=1, holdout=0),
                       calibration_batches(BYTES, "tinyshakespeare", 24, 64, seed=1))


def test_a_held_out_split_needs_a_window_of_text_on_each_side():
    with pytest.raises(DataError, match="too few to hold out 1 of 100 windows of 64 tokens"):
        window_starts(3_000, 100, 64, holdout=1)  # the tail is 30 tokens
    for bad in (8, 9, -1):
        with pytest.raises(ValueError, match=f"holdout={bad}"):
            window_starts(10_000, 8, 16, holdout=bad)
