"""Every bad input to the command line ends in one line ``blockscale <cmd>: error: ...`` (exit 2 for a
usage error, 1 for a runtime error, 130 when interrupted), never a traceback; flags are validated
(no silent replacement); resume, teacher and overwrite rules (issue 12)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockscale import cli
from cli_runs import run_cli as run

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]


def assert_error(result, cmd: str, code: int, *parts: str) -> str:
    """Exit code ``code`` and exactly one stderr line ``blockscale <cmd>: error: ...`` holding ``parts``,
    the last one; any line before it is a one-line warning of the command."""
    got, _, err = result
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert got == code, err
    assert lines and lines[-1].startswith(f"blockscale {cmd}: error: "), err
    assert all(line.startswith(f"blockscale {cmd}: warning: ") for line in lines[:-1]), err
    for part in parts:
        assert part in lines[-1], (part, lines[-1])
    return lines[-1]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Shared inputs: a tiny transformers Llama directory (no tokenizer), a truncated and a pickled copy,
    bad recipe files, a plain file."""
    import transformers

    root = tmp_path_factory.mktemp("cli_errors")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "llama")
    data = (root / "llama" / "model.safetensors").read_bytes()
    (root / "trunc").mkdir()
    (root / "trunc" / "config.json").write_text((root / "llama" / "config.json").read_text())
    (root / "trunc" / "model.safetensors").write_bytes(data[:len(data) // 2])
    (root / "pickled").mkdir()
    (root / "pickled" / "config.json").write_text((root / "llama" / "config.json").read_text())
    torch.save({"model.embed_tokens.weight": torch.zeros(64, 32), "note": NotATensor()},
               root / "pickled" / "pytorch_model.bin")
    (root / "deep.yaml").write_text("name: deep\nlinear: " + "[" * 20000 + "]" * 20000 + "\n")
    (root / "name5.yaml").write_text("name: 5\n")
    (root / "a_file").write_text("not a directory")
    return root


class NotATensor:
    """Pickled into a pytorch_model.bin: torch.load(weights_only=True) refuses it."""


@pytest.fixture(scope="module")
def stories_ckpt(tmp_path_factory):
    """An RTN NVFP4 export of stories260k (its metadata names the built-in source model)."""
    out = tmp_path_factory.mktemp("ckpt") / "rtn"
    assert cli.main(["quantize", "stories260k", "--skip-indivisible", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def path_ckpt(files, tmp_path_factory):
    """An RTN export of the tiny local Llama directory: its metadata names a local path."""
    out = tmp_path_factory.mktemp("ckpt") / "from_path"
    assert cli.main(["quantize", str(files / "llama"), "--out", str(out)]) == 0
    return out


def no_cuda_device() -> str:
    """A CUDA device this machine does not have."""
    return f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


# ----------------------------------------------------------------------------- usage errors: exit 2

TRAIN = ["train", "--data", "shakespeare", "--steps", "1", "--no-progress", "--no-plot"]
QUANT = ["quantize", "stories260k", "--skip-indivisible", "--out"]
LSQ = ["learn-scales", "stories260k", "--skip-indivisible", "--out"]

USAGE = [  # (argv with OUT for a fresh output path, command, parts of the message)
    (["eval", "ppl", "stories260k", "--ctx", "0"], "eval ppl", ["--ctx 0", ">= 2"]),
    (QUANT + ["OUT", "--eval", "--ctx", "0"], "quantize", ["--ctx 0"]),
    (QUANT + ["OUT", "--sq-alpha", "nan"], "quantize", ["--sq-alpha nan", "finite"]),
    (QUANT + ["OUT", "--gptq-damp", "inf"], "quantize", ["--gptq-damp inf"]),
    (QUANT + ["OUT", "--n-samples", "0"], "quantize", ["--n-samples 0", ">= 1"]),
    (QUANT + ["OUT", "--n-samples", "1000000000000"], "quantize", ["--n-samples 1000000000000"]),
    (QUANT + ["OUT", "--seq-len", "1000000000"], "quantize", ["--seq-len 1000000000"]),
    (QUANT + ["OUT", "--n-samples", "100000", "--seq-len", "100000"], "quantize", ["--n-samples", "--seq-len",
                                                                                    "calibration tokens"]),
    (QUANT + ["OUT", "--batch-size", "0"], "quantize", ["--batch-size 0"]),
    (QUANT + ["OUT", "--awq-grid", "0"], "quantize", ["--awq-grid 0"]),
    (QUANT + ["OUT", "--max-eval-tokens", "1", "--eval"], "quantize", ["--max-eval-tokens 1"]),
    (QUANT + ["OUT", "--max-shard-size", "lots"], "quantize", ["--max-shard-size"]),
    (["eval", "ppl", "stories260k", "--batch-size", "0"], "eval ppl", ["--batch-size 0"]),
    (["eval", "ppl", "stories260k", "--batch-size", "100000000000"], "eval ppl", ["--batch-size 100000000000"]),
    (["eval", "ppl", "stories260k", "--max-tokens", "1"], "eval ppl", ["--max-tokens 1"]),
    (["eval", "ppl", "stories260k", "--max-tokens", str(10 ** 30)], "eval ppl", ["--max-tokens"]),
    (["eval", "ppl", "stories260k", "--data", "no/such/file.txt"], "eval ppl", ["--data", "no/such/file.txt"]),
    (["formats", "--repeats", "0"], "formats", ["--repeats 0", ">= 1"]),
    (LSQ + ["OUT", "--lr-scales", "nan"], "learn-scales", ["--lr-scales nan"]),
    (LSQ + ["OUT", "--temperature", "inf"], "learn-scales", ["--temperature inf"]),
    (LSQ + ["OUT", "--steps", "0"], "learn-scales", ["--steps 0"]),
    (LSQ + ["OUT", "--grad-accum", "0"], "learn-scales", ["--grad-accum 0"]),
    (LSQ + ["OUT", "--seq-len", "1"], "learn-scales", ["--seq-len 1"]),
    (["demo", "--lsq-lr", "nan", "--out", "OUT"], "demo", ["--lsq-lr nan"]),
    (["demo", "--eval-tokens", "-1", "--out", "OUT"], "demo", ["--eval-tokens -1"]),
    (["demo", "--n-samples", "0", "--out", "OUT"], "demo", ["--n-samples 0"]),
    (TRAIN + ["--min-lr", "nan"], "train", ["--min-lr nan", "finite"]),
    (TRAIN + ["--lr", "inf"], "train", ["--lr inf"]),
    (TRAIN + ["--lr", "0.01", "--min-lr", "0.1"], "train", ["--min-lr 0.1", "--lr"]),
    (TRAIN + ["--betas", "0.9", "nan"], "train", ["--betas"]),
    (TRAIN + ["--grad-clip", "-1"], "train", ["--grad-clip -1"]),
    (TRAIN + ["--weight-decay", "inf"], "train", ["--weight-decay inf"]),
    (TRAIN + ["--val-fraction", "1.5"], "train", ["--val-fraction 1.5"]),
    (TRAIN + ["--threads", "-1"], "train", ["--threads -1"]),
    (["train", "--data", "shakespeare", "--steps", "0"], "train", ["--steps 0"]),
    (TRAIN + ["--batch-size", "1000000000000"], "train", ["--batch-size 1000000000000"]),
    (TRAIN + ["--model-preset", "huge"], "train", ["--model-preset 'huge'", "tiny"]),
    (["train", "--data", "no/such/file.txt"], "train", ["--data", "no/such/file.txt"]),
    (TRAIN + ["--autocast", "fp16"], "train", ["--autocast"]),
]


@pytest.mark.parametrize("argv,cmd,parts", USAGE, ids=[" ".join(a) for a, _, _ in USAGE])
def test_bad_flag_values_are_usage_errors(argv, cmd, parts, tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert_error(run(argv, capsys), cmd, 2, *parts)
    assert not (tmp_path / "out").exists()


DEVICE_CMDS = {
    "eval ppl": ["eval", "ppl", "stories260k", "--device"],
    "quantize": QUANT + ["OUT", "--device"],
    "learn-scales": LSQ + ["OUT", "--device"],
    "train": TRAIN + ["--device"],
}


@pytest.mark.parametrize("cmd", list(DEVICE_CMDS))
@pytest.mark.parametrize("device", ["foo", "missing-cuda", "cuda"])
def test_bad_or_unavailable_device(cmd, device, tmp_path, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    device = no_cuda_device() if device == "missing-cuda" else device
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in DEVICE_CMDS[cmd]] + [device]
    line = assert_error(run(argv, capsys), cmd, 2, f"--device {device}", "cpu")
    assert "available" in line


@pytest.mark.parametrize("argv,cmd", [(["recipes", "DEEP"], "recipes"), (TRAIN + ["--recipe", "DEEP"], "train")])
def test_deeply_nested_recipe_yaml(argv, cmd, files, capsys):
    argv = [str(files / "deep.yaml") if a == "DEEP" else a for a in argv]
    assert_error(run(argv, capsys), cmd, 2, "deep.yaml", "nested")


def test_recipe_name_must_be_a_string(files, capsys):
    from blockscale.recipes import load_recipe_file

    with pytest.raises(ValueError, match="name"):
        load_recipe_file(files / "name5.yaml")
    assert_error(run(TRAIN + ["--recipe", files / "name5.yaml"], capsys), "train", 2, "name5.yaml", "name", "5")


def test_train_out_must_be_a_writable_directory(files, tmp_path, capsys):
    assert_error(run(TRAIN + ["--out", files / "a_file"], capsys), "train", 2, "--out", "a_file", "not a directory")
    assert_error(run(TRAIN + ["--out", files / "a_file" / "sub"], capsys), "train", 2, "--out")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        target = locked / "run"
        if os.access(locked, os.W_OK):  # root ignores the mode bits: use a place nobody can create files in
            if not Path("/proc/self").is_dir():
                pytest.skip("running as root without /proc")
            target = Path("/proc/blockscale-test-run")
        assert_error(run(TRAIN + ["--out", target], capsys), "train", 2, "--out", "not writable")
    finally:
        locked.chmod(0o755)
    assert not (locked / "run").exists()


def test_quantize_out_checks(files, tmp_path, capsys):
    src = files / "llama"
    before = (src / "model.safetensors").read_bytes()
    for out in (src, src / "sub", files):  # is, lies inside, contains the model being read
        assert_error(run(["quantize", src, "--out", out, "--overwrite"], capsys), "quantize", 2, "--out",
                     "model")
    assert (src / "model.safetensors").read_bytes() == before and not (src / "sub").exists()
    assert_error(run(["quantize", src, "--out", files / "a_file"], capsys), "quantize", 2, "--out",
                 "not a directory")
    user = tmp_path / "user"
    (user / "sub").mkdir(parents=True)
    (user / "sub" / "notes.txt").write_text("mine")
    assert_error(run(["quantize", src, "--out", user, "--overwrite"], capsys), "quantize", 2, "--out",
                 "not a blockscale checkpoint")
    assert (user / "sub" / "notes.txt").read_text() == "mine"


def test_missing_tokenizer_names_the_method_flag(files, tmp_path, capsys):
    assert_error(run(["quantize", files / "llama", "--method", "gptq", "--out", tmp_path / "g"], capsys),
                 "quantize", 2, "--method gptq", "no tokenizer")


# ----------------------------------------------------------------------------- runtime errors: exit 1

@pytest.mark.parametrize("argv,cmd", [
    (["quantize", "stories260k", "--method", "gptq", "--skip-indivisible", "--calib", "hf:wikitext", "--out", "OUT"],
     "quantize"),
    (["eval", "ppl", "stories260k", "--data", "hf:wikitext,wikitext-2-raw-v1:test"], "eval ppl"),
])
def test_hf_text_source_without_datasets(argv, cmd, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert_error(run(argv, capsys), cmd, 1, "hf:wikitext", "datasets")


@pytest.mark.parametrize("model,parts", [("trunc", ["model.safetensors"]),
                                         ("pickled", ["pytorch_model.bin", "weights_only=True"])])
def test_unreadable_source_weights(model, parts, files, tmp_path, capsys):
    for cmd in (["quantize", files / model, "--out", tmp_path / "out"], ["eval", "ppl", files / model]):
        assert_error(run(cmd, capsys), "quantize" if cmd[0] == "quantize" else "eval ppl", 1, str(files / model),
                     *parts)
    assert not (tmp_path / "out").exists()


def test_eval_ppl_of_a_nan_model_is_an_error(monkeypatch, capsys):
    from blockscale.models import hf

    make = hf.to_hf_llama

    def nan_llama(model):
        out = make(model)
        with torch.no_grad():
            out.model.norm.weight[0] = float("nan")
        return out

    monkeypatch.setattr(hf, "to_hf_llama", nan_llama)
    code, out, err = run(["eval", "ppl", "stories260k", "--max-tokens", "600"], capsys)
    assert "ppl nan" not in out
    assert_error((code, out, err), "eval ppl", 1, "not finite", "tinystories")


def test_eval_beyond_max_position_embeddings_warns(capsys, tmp_path):
    code, out, err = run(["eval", "ppl", "stories260k", "--ctx", "600", "--max-tokens", "1300",
                          "--json", tmp_path / "r.json"], capsys)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockscale eval ppl: warning: "), err
    assert "--ctx 600" in lines[0] and "max_position_embeddings 512" in lines[0]
    assert json.loads((tmp_path / "r.json").read_text())["ctx"] == 600


def _train_argv(out, *extra):
    return ["train", "--data", "shakespeare", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--eval-batches", "0", "--no-progress", "--no-plot", "--device", "cpu", "--backend", "reference",
            "--threads", "1", "--out", str(out), *extra]


def test_train_resume_under_another_recipe_or_model(tmp_path, capsys):
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        assert run(_train_argv(out, "--recipe", "bf16"), capsys)[0] == 0
        ckpt = torch.load(out / "ckpt.pt", weights_only=True)
        assert ckpt["record"]["recipe"]["name"] == "bf16" and ckpt["record"]["model"]["dim"] == 32
        assert_error(run(_train_argv(out, "--recipe", "nvfp4-nvidia", "--steps", "3", "--resume"), capsys),
                     "train", 1, "recipe", "'bf16'", "'nvfp4-nvidia'", "--force")
        assert_error(run(_train_argv(out, "--steps", "3", "--resume"), capsys), "train", 1, "recipe", "--force")
        assert_error(run(_train_argv(out, "--recipe", "bf16", "--seq-len", "80", "--steps", "3", "--resume"),
                         capsys), "train", 1, "model", "max_seq_len")
        assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 2  # nothing was trained
        code, printed, err = run(_train_argv(out, "--recipe", "nvfp4-nvidia", "--steps", "3", "--resume",
                                             "--force"), capsys)
        assert code == 0, err
        assert "done: step 3" in printed
    finally:
        torch.set_num_threads(threads)


def test_train_resume_of_an_old_checkpoint_notes_the_missing_record(tmp_path, capsys):
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        assert run(_train_argv(out), capsys)[0] == 0
        ckpt = torch.load(out / "ckpt.pt", weights_only=True)
        del ckpt["record"]
        torch.save(ckpt, out / "ckpt.pt")
        code, printed, err = run(_train_argv(out, "--recipe", "bf16", "--steps", "3", "--resume"), capsys)
        assert code == 0, err
        notes = [line for line in printed.splitlines() if "records no recipe" in line]
        assert len(notes) == 1 and "not checked" in notes[0]
    finally:
        torch.set_num_threads(threads)


def test_learn_scales_resume_under_another_mode(tmp_path, capsys):
    out = tmp_path / "lsq"
    args = ["learn-scales", "stories260k", "--skip-indivisible", "--steps", "1", "--n-samples", "4", "--seq-len",
            "32", "--batch-size", "1", "--out", out]
    assert run(args + ["--mode", "tied"], capsys)[0] == 0
    state = torch.load(Path(str(out) + ".train") / "latest.pt", weights_only=True)
    assert state["record"]["mode"] == "tied"
    assert_error(run(args + ["--mode", "dual", "--steps", "2", "--resume", "--overwrite"], capsys), "learn-scales",
                 1, "mode", "'tied'", "'dual'", "--force")


def test_learn_scales_teacher_must_be_explicit(stories_ckpt, path_ckpt, tmp_path, capsys):
    common = ["--steps", "1", "--n-samples", "4", "--seq-len", "32", "--batch-size", "1"]
    assert_error(run(["learn-scales", stories_ckpt, "--out", tmp_path / "a"] + common, capsys), "learn-scales", 2,
                 "--teacher", "'stories260k'", "--teacher-from-metadata")
    # a local path recorded in the metadata is never loaded, even with the flag
    assert_error(run(["learn-scales", path_ckpt, "--teacher-from-metadata", "--out", tmp_path / "b"] + common,
                     capsys), "learn-scales", 2, "--teacher-from-metadata", "local path", "--teacher")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    code, _, err = run(["learn-scales", stories_ckpt, "--teacher-from-metadata", "--out", tmp_path / "c"] + common,
                       capsys)
    assert code == 0, err
    assert (tmp_path / "c" / "lsq_report.json").is_file()


def test_demo_failure_leaves_no_empty_out_directory(tmp_path, capsys):
    out = tmp_path / "new" / "demo"
    assert_error(run(["demo", "--model", "no-such-model", "--out", out], capsys), "demo", 2, "no-such-model")
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert_error(run(["demo", "--model", "no-such-model", "--out", kept], capsys), "demo", 2)
    assert kept.is_dir()  # it existed before: left alone
    from blockscale.cli.demo import run_demo  # a failure after run_demo made the directory: removed again

    with pytest.raises(FileNotFoundError, match="no-such-model"):
        run_demo(model="no-such-model", out_dir=str(out))
    assert not out.exists() and not out.parent.exists()
    with pytest.raises(FileNotFoundError):
        run_demo(model="no-such-model", out_dir=str(kept / "sub"))
    assert kept.is_dir() and not (kept / "sub").exists()


def test_eval_with_a_tokenizer_of_another_vocabulary(files):
    from blockscale.errors import DataError
    from blockscale.models.hf import load_model, stories260k_tokenizer
    from blockscale.ptq.pipeline import evaluate_ppl

    lm = load_model(str(files / "llama"))  # vocabulary 64; tok512 ids reach 511
    with pytest.raises(DataError, match="outside the model's vocabulary of 64"):
        evaluate_ppl(lm.model, stories260k_tokenizer(), "tinystories", 16, max_tokens=200)


# ----------------------------------------------------------------------------- the top level

@pytest.mark.parametrize("exc,code,parts", [
    (RuntimeError("boom"), 1, ["internal error: RuntimeError: boom (rerun with --debug for the traceback)"]),
    (KeyError("k"), 1, ["internal error: KeyError"]),
    (MemoryError(), 1, ["out of memory"]),
    (RecursionError("maximum recursion depth exceeded"), 1, ["maximum recursion depth"]),
    (FileExistsError("x exists"), 1, ["x exists"]),
    (ImportError("needs the `gguf` package\n(pip install gguf)"), 1, ["needs the `gguf` package (pip install gguf)"]),
])
def test_top_level_reports_any_exception_in_one_line(exc, code, parts, monkeypatch, capsys):
    from blockscale.cli import formats_table

    def fail(*a, **k):
        raise exc

    monkeypatch.setattr(formats_table, "run_demo", fail)
    assert_error(run(["formats", "--repeats", "1"], capsys), "formats", code, *parts)


def test_keyboard_interrupt_and_debug(monkeypatch, capsys):
    from blockscale.cli import formats_table

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(formats_table, "run_demo", interrupt)
    code, _, err = run(["formats", "--repeats", "1"], capsys)
    assert code == 130 and err.strip() == "blockscale formats: interrupted"

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(formats_table, "run_demo", boom)
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["--debug", "formats", "--repeats", "1"])
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["formats", "--repeats", "1", "--debug"])


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["quantize", "stories260k", "--out", "x", "--method", "hqq"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("blockscale quantize: error: argument --method: invalid choice")
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--steps", "x", "--data", "shakespeare"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("blockscale train: error: argument --steps")


def test_train_config_rejects_non_finite_and_out_of_range_values():
    from blockscale.train import TrainConfig

    for kw, match in [({"min_lr": math.nan}, "TrainConfig.min_lr=nan"), ({"lr": math.inf}, "TrainConfig.lr=inf"),
                      ({"betas": (0.9, 1.0)}, "TrainConfig.betas"), ({"grad_clip": math.nan}, "grad_clip"),
                      ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr"), ({"steps": 2.5}, "steps"),
                      ({"device": "foo"}, "device")]:
        with pytest.raises(ValueError, match=match.replace(".", r"\.")):
            TrainConfig(**kw)


def test_no_traceback_reaches_the_terminal(files):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "blockscale.cli", "recipes", str(files / "deep.yaml")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockscale recipes: error: ") and "nested" in lines[0]
