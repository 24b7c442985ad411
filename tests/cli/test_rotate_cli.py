"""``blockscale quantize --rotate`` (issue 33): a rotated run end to end on a saved tiny Llama (loads whole: the
rotations need the embeddings and lm_head, so the default falls back from streaming in one line), the checkpoint
reloading bit for bit with its online rotations, and one-line errors for a bad value or ``--streaming``."""
from __future__ import annotations

import json

import pytest
import torch

import blockscale as bs
from blockscale.nn.input_rotation import input_rotations

pytest.importorskip("transformers")
from cli_runs import run_cli  # noqa: E402
from tiny_models import tiny_hf_llama, token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hf_dir(tmp_path):
    tiny_hf_llama().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_quantize_rotate_end_to_end(hf_dir, tmp_path, capsys):
    out = tmp_path / "q"
    code, stdout, err = run_cli(["quantize", hf_dir, "--out", out, "--rotate", "r1r2r4",
                                 "--method", "rtn"], capsys)
    assert code == 0, err
    assert f"not streaming {hf_dir}: --rotate r1r2r4 rotates the whole model before PTQ; loading it whole" in stdout
    report = json.loads((out / "ptq_report.json").read_text())
    assert report["ptq"]["rotation"][0] == "rotate r1r2r4:" and report["ptq"]["config"]["rotate"] == "r1r2r4"
    assert "rotate r1r2r4:\n  fused R1 random-hadamard 64 seed 0 on the residual stream" in stdout
    model = bs.load(out)
    assert set(input_rotations(model)) == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    ids = token_ids(1, 8)
    with torch.no_grad():
        assert bool(torch.isfinite(model(ids).logits).all())


@pytest.mark.parametrize("argv, line", [
    (["--rotate", "r5"], "blockscale quantize: error: --rotate: rotate='r5': unknown token 'r5'; allowed: none, r4, "
                         "r1r2, r1r2r4, r3, r1r2r3r4, quip, block:N, mr (tokens may be joined with '+')"),
    (["--rotate", "r4", "--format", "modelopt"], "blockscale quantize: error: rotate='r4' rotates Linear inputs or "
     "keys online, which modelopt checkpoints cannot hold: export compressed-tensors (transform_config), or use fused "
     "rotations only (rotate='r1r2')"),
    (["--rotate", "r3", "--format", "modelopt"], "blockscale quantize: error: rotate='r3' rotates Linear inputs or "
     "keys online, which modelopt checkpoints cannot hold: export compressed-tensors (transform_config), or use fused "
     "rotations only (rotate='r1r2')"),
    (["--rotate", "r4", "--streaming"], "blockscale quantize: error: --streaming: --rotate r4 rotates the whole model "
                                        "before PTQ; leave out --streaming (or give --no-streaming) to load it whole"),
])
def test_rotate_errors_are_one_line(hf_dir, tmp_path, capsys, argv, line):
    code, _, err = run_cli(["quantize", hf_dir, "--out", tmp_path / "q", *argv], capsys)
    assert code == 2 and err.strip() == line
    assert not (tmp_path / "q").exists()


SMALL = ["--skip-indivisible", "--n-samples", "40", "--seq-len", "32", "--batch-size", "2"]


def test_learn_scales_keeps_rotations_fixed(tmp_path, capsys):
    """learn-scales with --rotate (W4A16: no calibrated input scales, which depend on --n-samples): a run that never
    beats its start exports exactly what quantize --rotate writes (transform_config and matrices included); a run
    from that rotated checkpoint keeps its online rotations; ModelOpt output of it is refused before loading."""
    from safetensors.torch import load_file

    ptq = tmp_path / "ptq"
    code, _, err = run_cli(["quantize", "stories260k", "--skip-indivisible", "--rotate", "r1r2+mr",
                            "--out", ptq], capsys)
    assert code == 0, err
    out = tmp_path / "out"
    code, stdout, err = run_cli(["learn-scales", "stories260k", *SMALL, "--rotate", "r1r2+mr", "--steps", "3",
                                 "--train", "all", "--lr-scales", "3", "--lr-weights", "3", "--select-every", "1",
                                 "--lr-retries", "0", "--out", out], capsys)
    assert code == 0, err
    got, want = load_file(out / "model.safetensors"), load_file(ptq / "model.safetensors")
    assert got.keys() == want.keys() and any(k.endswith("v_input.weight") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)
    tc = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]
    assert tc == json.loads((ptq / "config.json").read_text())["quantization_config"]["transform_config"]
    again = tmp_path / "again"
    code, _, err = run_cli(["learn-scales", ptq, "--teacher", "stories260k", *SMALL, "--steps", "2", "--out", again],
                           capsys)
    assert code == 0, err
    assert set(input_rotations(bs.load(again))) == set(input_rotations(bs.load(ptq))) != set()
    code, _, err = run_cli(["learn-scales", ptq, "--teacher", "stories260k", *SMALL, "--steps", "2", "--format", "modelopt", "--out",
                            tmp_path / "mo"], capsys)
    assert code == 2 and "rotates Linear inputs or keys online (transform_config), which modelopt checkpoints cannot" in err
