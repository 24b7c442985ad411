"""learn-scales best-step selection on held-out training windows and latent weights in block units (issue 32):
by default a run never exports a student worse on its held-out windows than the PTQ model it started from."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockscale import cli
from blockscale.cli.learn_scales_defaults import default_holdout, default_lr_weights, default_select_every
from cli_runs import run_cli as run

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--skip-indivisible", "--n-samples", "40", "--seq-len", "32", "--batch-size", "2"]


def test_default_holdout_and_weight_lr():
    assert [default_holdout(n) for n in (8, 31, 32, 40, 256)] == [0, 0, 1, 1, 8]
    assert default_holdout(40, world_size=2) == 0 and default_holdout(64, world_size=2) == 2
    assert default_holdout(96, world_size=2) == 2 and default_holdout(128, world_size=3) == 3
    assert [default_select_every(s) for s in (1, 4, 5, 50, 200)] == [1, 1, 1, 10, 40]
    assert (default_lr_weights("block"), default_lr_weights("raw")) == (3e-3, 5e-5)


def test_a_run_that_only_gets_worse_exports_its_ptq_start(tmp_path, capsys):
    """A learning rate far too large: every evaluation on the held-out windows is worse than the start, so the
    export is the PTQ model's tensors exactly (the same as `blockscale quantize`)."""
    ptq = tmp_path / "ptq"
    assert cli.main(["quantize", "stories260k", "--skip-indivisible", "--out", str(ptq)]) == 0
    out = tmp_path / "out"
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--train", "all", "--steps", "6",
                             "--lr-scales", "3", "--lr-weights", "3", "--select-every", "1", "--lr-retries", "0",
                             "--out", out], capsys)
    assert code == 0, err
    assert "kept step 0" in stdout + err and "did not beat the start" not in stdout + err
    report = json.loads((out / "lsq_report.json").read_text())
    assert report["distill"]["best_step"] == 0
    losses = dict(report["distill"]["eval_losses"])
    assert sorted(losses) == [0, 1, 2, 3, 4, 5, 6] and min(losses[s] for s in range(1, 7)) > losses[0]
    got, want = load_file(out / "model.safetensors"), load_file(ptq / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    state = torch.load(tmp_path / "out.train" / "latest.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 6 and any(k.endswith("weight_relative") for k in state["trainable"])  # block units


def test_by_default_a_run_that_never_beats_its_start_runs_again_at_a_third_of_the_lr(tmp_path, capsys):
    """The same run with the default --lr-retries 1: the first attempt keeps step 0, so the start is put back and
    the run repeated at lr 1 / 1 (files in out.train/retry-1); the report lists both attempts."""
    out = tmp_path / "out"
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--train", "all", "--steps", "6",
                             "--lr-scales", "3", "--lr-weights", "3", "--select-every", "1", "--out", out], capsys)
    assert code == 0, err
    assert "learning did not beat the start" in stdout and "--lr-scales 1, --lr-weights 1; retry 1 of 1" in stdout
    attempts = json.loads((out / "lsq_report.json").read_text())["distill"]["attempts"]
    assert [(a["lr_scales"], a["lr_weights"]) for a in attempts] == [(3, 3), (1, 1)]
    assert attempts[0]["best_step"] == 0 and (tmp_path / "out.train" / "retry-1" / "latest.pt").exists()


def test_lr_retries_need_held_out_windows(tmp_path, capsys):
    for flags, why in ((["--holdout", "0"], "--holdout 0)"), (["--n-samples", "8"], "by default for --n-samples 8")):
        code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--lr-retries", "2", *flags,
                                 "--out", tmp_path / "o"], capsys)
        assert code == 2 and "--lr-retries 2: a retry needs held-out windows" in err and why in err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_holdout_0_exports_the_last_step(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--steps", "3", "--holdout", "0",
                             "--out", out], capsys)
    assert code == 0, err
    assert "kept step" not in stdout + err
    report = json.loads((out / "lsq_report.json").read_text())
    assert report["distill"]["best_step"] is None and report["distill"]["eval_losses"] == []


def test_the_held_out_windows_are_drawn_from_a_part_of_the_text_of_their_own(tmp_path, capsys, monkeypatch):
    """learn-scales (and --method auto's start selection) draw the training windows with the held-out split apart:
    the last --holdout windows from the end of the text, sharing no token with the windows it trains on
    (data.text_sources.window_starts). The held-out windows the step was chosen on are those rows."""
    import importlib

    from blockscale.data import text_sources

    recover_mod = importlib.import_module("blockscale.lsq.recover")  # (the package exports a function of that name)

    real, drawn, held = text_sources.calibration_batches, [], []

    def recording(tokenizer, source, n_samples, seq_len, seed=0, bos=False, holdout=0):
        out = real(tokenizer, source, n_samples, seq_len, seed=seed, bos=bos, holdout=holdout)
        drawn.append((n_samples, seq_len, holdout, out))
        return out

    real_split = recover_mod.split_holdout
    monkeypatch.setattr(text_sources, "calibration_batches", recording)
    monkeypatch.setattr(recover_mod, "split_holdout", lambda t, h: held.append((t, h)) or real_split(t, h))
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--steps", "1", "--holdout", "8",
                             "--out", tmp_path / "o"], capsys)
    assert code == 0, err
    training = [d for d in drawn if (d[0], d[1]) == (40, 32)]
    assert len(training) == 1 and training[0][2] == 8  # the run's own windows, with the split apart
    assert len(held) == 1 and held[0][1] == 8 and torch.equal(held[0][0], training[0][3])
