"""Choosing the PTQ start by the held-out next-token loss (issue 32: one default that picks each model's best start):
``lsq.choose_start`` and ``learn-scales --method auto``."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockscale import lsq
from blockscale.data.text_sources import calibration_batches
from blockscale.models.hf import load_model
from blockscale.ptq import GPTQOptions, PTQConfig
from blockscale.ptq.pipeline import default_texts
from cli_runs import run_cli as run

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(activations="w4a16", skip_indivisible=True, n_samples=8, seq_len=32)
CANDIDATES = (lsq.StartCandidate("RTN-6", "rtn", "6"), lsq.StartCandidate("RTN hessian", "rtn", "hessian"),
              lsq.StartCandidate("GPTQ 4/6-aware", "gptq", "4over6", GPTQOptions(four_over_six="aware")))


@pytest.fixture(scope="module")
def stories():
    lm = load_model("stories260k")
    texts = default_texts("stories260k")
    held = calibration_batches(lm.tokenizer, texts.calib, 6, 64, seed=1, bos=texts.calib_bos)
    return lm, texts, held


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def test_choose_start_keeps_the_candidate_with_the_lowest_held_out_next_token_loss(stories):
    lm, texts, held = stories
    lines = []
    choice = lsq.choose_start(lm.model, lm.tokenizer, PTQConfig(**BASE), texts.calib, held, texts.calib_bos,
                              CANDIDATES, progress=False, log=lines.append)
    assert list(choice.scores) == [c.label for c in CANDIDATES] == list(choice.seconds)
    assert choice.label == min(choice.scores, key=choice.scores.get)
    assert len(set(choice.scores.values())) == 3  # three different models, three different losses
    assert [ln.split(":")[0] for ln in lines] == [f"start {c.label}" for c in CANDIDATES]
    # the student kept is that candidate's quantize_student, bit for bit, and its score is its held-out loss
    cand = next(c for c in CANDIDATES if c.label == choice.label)
    fresh = lsq.quantize_student(lm.model, lm.tokenizer, cand.config(PTQConfig(**BASE)), texts.calib,
                                 texts.calib_bos, progress=False)
    assert choice.student.report.to_dict()["config"]["method"] == cand.method
    assert torch.equal(_logits(choice.student.model, held[:2]), _logits(fresh.model, held[:2]))
    assert choice.scores[choice.label] == lsq.eval_next_token_loss(fresh.model, held)
    assert choice.student.weights.keys() == fresh.weights.keys()
    assert all(torch.equal(choice.student.weights[k], fresh.weights[k]) for k in fresh.weights)
    # the full-precision model is left as it was: every candidate quantized a copy
    assert not any("NVFP4" in type(m).__name__ for m in lm.model.modules())
    assert choice.to_dict() == {"chosen": choice.label, "criterion": "held-out next-token loss", "candidates": [
        {"label": c.label, "loss": choice.scores[c.label], "ptq_seconds": choice.seconds[c.label]} for c in CANDIDATES]}


def test_a_tie_keeps_the_earlier_candidate(stories):
    lm, texts, held = stories
    twins = (lsq.StartCandidate("first", "rtn", "6"), lsq.StartCandidate("second", "rtn", "6"))
    choice = lsq.choose_start(lm.model, lm.tokenizer, PTQConfig(**BASE), texts.calib, held, texts.calib_bos,
                              twins, progress=False)
    assert choice.scores["first"] == choice.scores["second"] and choice.label == "first"


@pytest.mark.parametrize("candidates, heldout, match", [
    ((), None, "candidates is empty"),
    ((lsq.StartCandidate("a", "rtn", "6"), lsq.StartCandidate("a", "rtn", "hessian")), None, "'a' appears twice"),
    (("rtn",), None, "holds a str"),
    (None, torch.zeros(4, dtype=torch.long), r"heldout must be an integer tensor \[n >= 1, T >= 2\]"),
    (None, torch.zeros(0, 8, dtype=torch.long), "heldout must be"),
])
def test_choose_start_refuses_bad_input_before_quantizing(stories, candidates, heldout, match):
    lm, texts, held = stories
    with pytest.raises(ValueError, match=match):
        lsq.choose_start(lm.model, lm.tokenizer, PTQConfig(**BASE), texts.calib,
                         held if heldout is None else heldout, texts.calib_bos,
                         CANDIDATES if candidates is None else candidates, progress=False)


SMALL = ["--skip-indivisible", "--n-samples", "40", "--seq-len", "32", "--batch-size", "2"]


def test_learn_scales_method_auto_reports_every_candidate_and_starts_from_the_lowest(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--method", "auto", "--steps", "2",
                             "--holdout", "8", "--out", out], capsys)
    assert code == 0, err
    report = json.loads((out / "lsq_report.json").read_text())
    sel = report["ptq"]["start_selection"]
    scores = {c["label"]: c["loss"] for c in sel["candidates"]}
    assert list(scores) == [c.label for c in lsq.START_CANDIDATES]
    assert sel["chosen"] == min(scores, key=scores.get) and len(set(scores.values())) == len(scores)
    assert f"start: {sel['chosen']}" in stdout and stdout.count("held-out next-token loss") == len(scores)
    chosen = next(c for c in lsq.START_CANDIDATES if c.label == sel["chosen"])
    assert (report["ptq"]["config"]["method"], report["ptq"]["config"]["scale_rule"]) == (chosen.method,
                                                                                        chosen.scale_rule)
    assert load_file(out / "model.safetensors")  # exported


@pytest.mark.parametrize("flags, why", [
    (["--scale-rule", "hessian"], "--scale-rule: --method auto tries its own PTQ starts"),
    (["--gptq-damp", "0.1"], "--gptq-damp: --method auto tries its own PTQ starts"),
    (["--holdout", "0"], "--method auto chooses the start by the loss on the held-out training windows"),
    (["--n-samples", "8"], "by default for --n-samples 8"),
    (["--candidates", "RTN hessian,GPTQ"], "'GPTQ' is not a start; allowed (comma-separated): RTN hessian, GPTQ"),
    (["--candidates", "RTN hessian, RTN hessian"], "'RTN hessian' is named twice"),
])
def test_learn_scales_method_auto_refusals_are_one_line(tmp_path, capsys, flags, why):
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--method", "auto", *flags,
                             "--out", tmp_path / "o"], capsys)
    assert code == 2 and why in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_learn_scales_candidates_tries_only_those_in_their_order(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--method", "auto", "--candidates",
                             "GPTQ hessian, RTN hessian", "--steps", "1", "--holdout", "8", "--out", out], capsys)
    assert code == 0, err
    sel = json.loads((out / "lsq_report.json").read_text())["ptq"]["start_selection"]
    assert [c["label"] for c in sel["candidates"]] == ["GPTQ hessian", "RTN hessian"]
    assert stdout.count("held-out next-token loss") == 2 and "AWQ" not in stdout


def test_learn_scales_candidates_needs_method_auto(tmp_path, capsys):
    code, stdout, err = run(["learn-scales", "stories260k", *SMALL, "--method", "gptq", "--candidates",
                             "RTN hessian", "--out", tmp_path / "o"], capsys)
    assert code == 2 and "--candidates 'RTN hessian': only with --method auto" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_each_candidate_keeps_the_runs_activations_rotation_and_calibration():
    base = PTQConfig(activations="w4a4", rotate="r4", n_samples=8, seq_len=32, skip_indivisible=True, seed=3)
    for cand in lsq.START_CANDIDATES:
        cfg = cand.config(base)
        assert (cfg.method, cfg.scale_rule) == (cand.method, cand.scale_rule)
        assert (cfg.activations, cfg.rotate, cfg.n_samples, cfg.seq_len, cfg.skip_indivisible, cfg.seed) == (
            "w4a4", "r4", 8, 32, True, 3)
    gptq46 = next(c for c in lsq.START_CANDIDATES if c.label == "GPTQ 4/6-aware").config(base)
    awq = next(c for c in lsq.START_CANDIDATES if c.label == "AWQ + GPTQ hessian").config(base)
    assert gptq46.options.four_over_six == "aware" and awq.options.quantizer == "gptq"
    assert [c.label for c in lsq.START_CANDIDATES] == ["RTN hessian", "GPTQ hessian", "GPTQ 4/6-aware",
                                                       "AWQ + GPTQ hessian"]  # cheapest first: a tie keeps it
