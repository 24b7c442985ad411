"""`blockscale demo` end to end on the built-in stories260K (SmolLM2's own run is `make demo`)."""
from __future__ import annotations

import json

import pytest

from blockscale import cli
from blockscale.cli.demo import run_demo

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_demo_on_stories260k(tmp_path, capsys, monkeypatch):
    import blockscale.cli.demo as demo_mod
    from blockscale import lsq

    real, drawn = demo_mod.calibration_batches, []
    monkeypatch.setattr(demo_mod, "calibration_batches",
                        lambda *a, **k: drawn.append((a[2:], k)) or real(*a, **k))
    out = tmp_path / "demo"
    assert cli.main(["demo", "--model", "stories260k", "--out", str(out), "--eval-tokens", "4096", "--n-samples", "4",
                     "--seq-len", "64", "--lsq-steps", "8", "--lsq-lr", "3e-3"]) == 0
    text = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    rows = rep["rows"]
    label = "NVFP4 Hessian-aware block scales + learned scales and weights (8 steps)"
    rtn, hessian, learned = (rows["NVFP4 RTN (scale to 6)"], rows["NVFP4 Hessian-aware block scales"], rows[label])
    assert learned["steps"] == 8 and learned["train"] == "all" and learned["lr_weights"] == 3e-3  # block units
    # the step kept on the 16 held-out windows: the start (0) or an evaluated step (every 8 // 5 = 1 steps)
    losses = dict(learned["held_out_losses"])
    assert sorted(losses) == list(range(9)) and learned["best_step"] == min(losses, key=lambda s: (losses[s], s))
    assert learned["trainable_params"] > 0
    # the learning windows: 512 x 128 with the held-out ones drawn from a part of the text of their own (no token
    # shared with training: data.text_sources.window_starts, tested in tests/data/test_text_sources.py)
    assert [(a, k["holdout"]) for a, k in drawn] == [((512, 128), lsq.RECOVERY_HOLDOUT)]
    # Hessian-aware scales beat RTN, and distilling their value scales and weights from the full-precision model
    # lowers the perplexity further
    assert rep["eval"]["ppl"] < learned["ppl"]["ppl"] < hessian["ppl"]["ppl"] < rtn["ppl"]["ppl"], rows
    # learning beat its start on the held-out windows (the first and last training batches are different windows,
    # so their two losses do not compare)
    assert learned["best_step"] > 0 and losses[learned["best_step"]] < losses[0], losses
    assert rep["reloaded_logits_bit_identical"] is True  # the learned model, exported and reloaded
    assert rep["reloaded_ppl"]["ppl"] == learned["ppl"]["ppl"]
    assert f"| {label} |" in text and f"| {label}, reloaded from checkpoint-compressed-tensors |" in text
    assert "kept in high precision" in text  # stories260K's down_proj (in_features 172)
    assert (out / "checkpoint-compressed-tensors" / "model.safetensors").is_file()
    assert "NVFP4 weights" in text and "(largest: model.embed_tokens.weight fp32 131.1 kB)" in text  # what the size is
    # blockscale's zero-shot suite next to each perplexity (12 items per task by default); the reloaded model has the
    # in-memory one's logits bit for bit, hence its accuracies
    zs = rep["zero_shot"]
    reloaded = f"{label}, reloaded from checkpoint-compressed-tensors"
    assert set(zs) == {"full precision", *rows, reloaded} and zs[reloaded] == zs[label]
    assert all(t["items"] == 12 for r in zs.values() for t in r["tasks"].values())
    assert rows[label]["zero_shot"] == zs[label] and "| zero-shot acc |" in text and "not a standard benchmark" in text
    mean = sum(t["acc"] for t in zs[label]["tasks"].values()) / 3
    assert f"| {label} | {learned['ppl']['ppl']:.3f} | " in text and f" | {mean:.3f} | " in text


@pytest.mark.parametrize("kw,match", [(dict(lsq_steps=-1), "lsq_steps"), (dict(lsq_lr=0.0), "lsq_lr"),
                                      (dict(lsq_lr_weights=float("nan")), "lsq_lr_weights"),
                                      (dict(best="sweep"), "best='sweep'; allowed values: hessian, awq, gptq"),
                                      (dict(lsq_train="weights"), "lsq_train='weights'; allowed values: all, scales"),
                                      (dict(eval_tokens=-5), "eval_tokens"),
                                      (dict(zero_shot_items=-1), "zero_shot_items")])
def test_demo_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        run_demo(model="stories260k", out_dir=str(tmp_path), **kw)
