"""learn-scales reliability (issue 29): periodic checkpoints that a killed run resumes from bit for bit,
a diverging run that stops with one line and exports nothing, ``--teacher`` honoured on a model input,
and a teacher with another vocabulary refused before anything loads."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockscale import cli
from cli_runs import run_cli as run
from blockscale.cli.learn_scales import default_ckpt_interval

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--skip-indivisible", "--n-samples", "8", "--seq-len", "32", "--batch-size", "2"]
STEPS = 60  # default --ckpt-interval: 6


def error_line(result, code: int) -> str:
    got, _, err = result
    lines = [line for line in err.strip().splitlines() if ": warning: " not in line]
    assert got == code and len(lines) == 1 and lines[0].startswith("blockscale learn-scales: error: "), err
    return lines[0]


def trained(train_dir: Path) -> dict:
    state = torch.load(train_dir / "latest.pt", map_location="cpu", weights_only=True)
    return state


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run with checkpoints only at the end (--ckpt-interval 0)."""
    out = tmp_path_factory.mktemp("lsq_straight") / "out"
    assert cli.main(["learn-scales", "stories260k", *SMALL, "--steps", str(STEPS), "--ckpt-interval", "0",
                     "--out", str(out)]) == 0
    rows = [json.loads(line) for line in open(str(out) + ".train/metrics.jsonl")]
    return out, rows


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """stories260k as a transformers directory: perturbed (another teacher, same vocabulary), with a NaN weight,
    and a tiny Llama with another vocabulary."""
    import transformers

    from blockscale.models.hf import load_model

    root = tmp_path_factory.mktemp("teachers")
    lm = load_model("stories260k")
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(3.0)
    lm.model.save_pretrained(root / "other")
    with torch.no_grad():
        lm.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    lm.model.save_pretrained(root / "nan")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "vocab96")
    for name, first in (("chars", 1), ("chars_reversed", -1)):  # vocab 96, two tokenizers with other ids
        transformers.LlamaForCausalLM(cfg).save_pretrained(root / name)
        _char_tokenizer(first).save_pretrained(root / name)
    return root


def _char_tokenizer(order: int):
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)][::order]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_default_checkpoint_interval():
    assert [default_ckpt_interval(s) for s in (1, 5, 19, 20, 60, 100, 499, 500, 10_000)] == [1, 1, 1, 2, 6, 10, 49,
                                                                                               50, 50]


def test_a_killed_run_resumes_from_its_periodic_checkpoint_bit_for_bit(tmp_path, straight, capsys):
    """SIGKILL once the first periodic checkpoint exists (default interval), then --resume: the learned scales,
    the optimizer's state and the export equal the uninterrupted run's exactly."""
    ref_out, ref_rows = straight
    out = tmp_path / "out"
    ckpt = Path(str(out) + ".train") / "latest.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BLOCKSCALE_COMPILE_AFTER": "never"}
    proc = subprocess.Popen([sys.executable, "-m", "blockscale.cli", "learn-scales", "stories260k", *SMALL, "--steps",
                             str(STEPS), "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert not out.exists()
    killed_at = trained(ckpt.parent)["step"]
    assert 0 < killed_at < STEPS and killed_at % default_ckpt_interval(STEPS) == 0

    code, _, err = run(["learn-scales", "stories260k", *SMALL, "--steps", str(STEPS), "--out", out, "--resume"], capsys)
    assert code == 0, err
    assert f"resuming from {ckpt} at step {killed_at}" in err + _
    a, b = trained(ckpt.parent), trained(Path(str(ref_out) + ".train"))
    assert a["step"] == b["step"] == STEPS
    assert a["trainable"].keys() == b["trainable"].keys()
    assert all(torch.equal(a["trainable"][k], b["trainable"][k]) for k in a["trainable"])
    for i, st in b["optimizer"]["state"].items():
        assert all(torch.equal(st[k], a["optimizer"]["state"][i][k]) for k in st)
    got, want = load_file(out / "model.safetensors"), load_file(ref_out / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    rows = [json.loads(line) for line in open(ckpt.parent / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]


def test_a_diverging_run_stops_with_one_line_and_exports_nothing(tmp_path, teachers, capsys):
    """A teacher with a NaN weight makes the loss NaN at step 1: one line naming the step, no export, no checkpoint."""
    out = tmp_path / "out"
    line = error_line(run(["learn-scales", "stories260k", *SMALL, "--steps", "8", "--teacher", teachers / "nan",
                           "--out", out], capsys), 1)
    assert "training diverged at step 1: the loss is nan" in line and f"nothing was exported to {out}" in line
    assert not out.exists() and not (Path(str(out) + ".train") / "latest.pt").exists()


def test_a_huge_learning_rate_is_refused_before_any_work(tmp_path, capsys):
    """--lr-weights 1e38 overflowed inside AdamW ("internal error"); it is now out of the flag's range."""
    for flag in ("--lr-weights", "--lr-scales"):
        line = error_line(run(["learn-scales", "stories260k", "--train", "all", flag, "1e38", "--out",
                               tmp_path / "o"], capsys), 2)
        assert f"{flag} 1e+38" in line or f"{flag} 1e38" in line, line
    assert not (tmp_path / "o").exists()


def test_teacher_is_honoured_on_a_model_input(tmp_path, teachers, straight, capsys):
    """learn-scales MODEL --teacher OTHER distils from OTHER (the first loss is the KL to OTHER, not to MODEL),
    records it, and keeps MODEL's tokenizer and name."""
    ref_out, ref_rows = straight
    out = tmp_path / "out"
    code, _, err = run(["learn-scales", "stories260k", *SMALL, "--steps", "2", "--ckpt-interval", "0", "--teacher",
                        teachers / "other", "--out", out], capsys)
    assert code == 0, err
    report = json.loads((out / "lsq_report.json").read_text())
    assert report["teacher"] == str(teachers / "other") and report["model"] == "stories260k"
    own = json.loads((ref_out / "lsq_report.json").read_text())["distill"]["first_loss"]
    assert report["distill"]["first_loss"] > 10 * own, (report["distill"], own)
    meta = json.loads((out / "config.json").read_text())["quantization_config"]["blockscale"]["metadata"]
    assert meta["model"] == "stories260k" and meta["scale_learning"]["teacher"] == str(teachers / "other")
    assert (out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists()


def test_a_teacher_with_another_vocabulary_is_refused_before_loading(tmp_path, teachers, monkeypatch, capsys):
    import blockscale.models.hf as hf
    import blockscale.ptq.pipeline as pipeline

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the vocabulary check")

    monkeypatch.setattr(hf, "load_model", no_loading)
    monkeypatch.setattr(pipeline, "open_model", no_loading)
    line = error_line(run(["learn-scales", "stories260k", "--teacher", teachers / "vocab96", "--out", tmp_path / "o"],
                          capsys), 2)
    assert f"--teacher {teachers / 'vocab96'}: its vocabulary has 96 tokens, stories260k's has 512" in line
    assert not (tmp_path / "o").exists()


def test_teacher_from_metadata_needs_a_checkpoint_input(tmp_path, capsys):
    line = error_line(run(["learn-scales", "stories260k", "--teacher-from-metadata", "--out", tmp_path / "o"], capsys),
                      2)
    assert "--teacher-from-metadata: only with a quantized checkpoint input" in line


def test_a_checkpoint_input_with_a_teacher_of_another_vocabulary_is_refused_before_loading(tmp_path, teachers,
                                                                                          monkeypatch, capsys):
    """Was a raw size-mismatch error after both models had loaded."""
    import blockscale.models.hf as hf
    import blockscale.ptq.pipeline as pipeline

    ckpt = tmp_path / "ckpt"
    assert cli.main(["quantize", "stories260k", "--out", str(ckpt)]) == 0

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the vocabulary check")

    monkeypatch.setattr(hf, "load_model", no_loading)
    monkeypatch.setattr(pipeline, "open_model", no_loading)
    line = error_line(run(["learn-scales", ckpt, "--teacher", teachers / "vocab96", "--out", tmp_path / "o"], capsys),
                      2)
    assert f"--teacher {teachers / 'vocab96'}: its vocabulary has 96 tokens, {ckpt}'s has 512" in line
    assert not (tmp_path / "o").exists()
    line = error_line(run(["learn-scales", ckpt, "--teacher", "stories260k", "--teacher-from-metadata", "--out",
                           tmp_path / "o"], capsys), 2)  # was: --teacher-from-metadata silently ignored
    assert "--teacher and --teacher-from-metadata both name the teacher: give one of them" in line


def test_a_teacher_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, teachers, capsys):
    line = error_line(run(["learn-scales", teachers / "chars", "--teacher", teachers / "chars_reversed", "--steps",
                           "1", "--out", tmp_path / "o"], capsys), 2)
    assert f"--teacher {teachers / 'chars_reversed'}: its tokenizer maps tokens to other ids than " \
        f"{teachers / 'chars'}'s (" in line
    assert f"' ': id 1 in {teachers / 'chars'}, id 95 in the teacher" in line
    assert not (tmp_path / "o").exists()
