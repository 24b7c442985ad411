"""`blockscale demo` end to end on the built-in stories260K (SmolLM2's own run is `make demo`)."""
from __future__ import annotations

import json

import pytest

from blockscale import cli
from blockscale.cli.demo import run_demo

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_demo_on_stories260k(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--model", "stories260k", "--out", str(out), "--eval-tokens", "4096", "--n-samples", "4",
                     "--seq-len", "64", "--lsq-steps", "8", "--lsq-lr", "3e-3"]) == 0
    text = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    rows = rep["rows"]
    rtn, learned = rows["NVFP4 RTN (scale to 6)"], rows["NVFP4 RTN + learned scales (8 scale-only steps)"]
    assert learned["steps"] == 8 and learned["trainable_params"] > 0
    # distilling the scales from the full-precision model lowers the RTN model's perplexity
    assert rep["eval"]["ppl"] < learned["ppl"]["ppl"] < rtn["ppl"]["ppl"], (rep["eval"], learned, rtn)
    assert learned["final_loss"] < learned["first_loss"]
    assert rep["reloaded_logits_bit_identical"] is True
    assert "| NVFP4 RTN + learned scales (8 scale-only steps) |" in text
    assert "kept in high precision" in text  # stories260K's down_proj (in_features 172)
    assert (out / "checkpoint-compressed-tensors" / "model.safetensors").is_file()
    assert "NVFP4 weights" in text and "(largest: model.embed_tokens.weight fp32 131.1 kB)" in text  # what the size is


@pytest.mark.parametrize("kw,match", [(dict(lsq_steps=-1), "lsq_steps"), (dict(lsq_lr=0.0), "lsq_lr"),
                                      (dict(eval_tokens=-5), "eval_tokens")])
def test_demo_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        run_demo(model="stories260k", out_dir=str(tmp_path), **kw)
