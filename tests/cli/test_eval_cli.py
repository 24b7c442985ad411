"""`blockscale eval tasks` (lm-evaluation-harness on blockscale's numerics, offline local tasks) and `blockscale
eval zero-shot`: results against hand counts, a W4A4 checkpoint against its full-precision baseline, one-line
errors."""
from __future__ import annotations

import json
import sys

import pytest

import blockscale as bs
from cli_runs import run_cli
from local_tasks import LL_TASK, MC_TASK, hand_count, write_tasks

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
TASKS = f"{MC_TASK},{LL_TASK}"


def _one_line_error(code, out, err, expected_code, *words):
    assert code == expected_code, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_eval_tasks_reports_the_hand_count(tmp_path, capsys, stories260k):
    pytest.importorskip("lm_eval")
    folder = write_tasks(tmp_path / "tasks")
    code, out, err = run_cli(["eval", "tasks", "stories260k", "--tasks", TASKS, "--include-path", folder,
                              "--limit", "5", "--json", tmp_path / "r.json"], capsys)
    assert code == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    expected = hand_count(stories260k.model, stories260k.tokenizer.hf, limit=5)
    for task, metrics in expected.items():
        for metric, value in metrics.items():
            assert rep["metrics"][task][metric] == pytest.approx(value, rel=1e-5)
    assert rep["items"] == {MC_TASK: 5, LL_TASK: 5} and rep["limit"] == 5 and rep["backend"] == "hf"
    acc = expected[MC_TASK]["acc"]
    assert f"| {MC_TASK} | acc | 5 | {acc:.4f} |" in out


def test_eval_tasks_on_a_w4a4_checkpoint_with_its_baseline(tmp_path, capsys, stories260k):
    """The checkpoint's own numerics are evaluated (activations quantized too): lm-eval's numbers are the hand count
    on the model ``bs.load`` gives, the baseline's on stories260K, and the recovery their ratio."""
    pytest.importorskip("lm_eval")
    from transformers import AutoTokenizer

    folder, ckpt = write_tasks(tmp_path / "tasks"), tmp_path / "ckpt"
    code, out, err = run_cli(["quantize", "stories260k", "--w4a4", "--skip-indivisible", "--n-samples", "4",
                              "--seq-len", "64", "--out", ckpt], capsys)
    assert code == 0, err
    code, out, err = run_cli(["eval", "tasks", ckpt, "--tasks", TASKS, "--include-path", folder, "--baseline", "auto",
                              "--batch-size", "2", "--json", tmp_path / "r.json"], capsys)
    assert code == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    model = bs.load(ckpt)
    assert {m.scheme_name for m in model.modules() if hasattr(m, "scheme_name")} == {"nvfp4-w4a4"}
    quantized = hand_count(model, AutoTokenizer.from_pretrained(ckpt))
    full = hand_count(stories260k.model, stories260k.tokenizer.hf)
    assert rep["baseline"]["model"] == "stories260k"
    for task in quantized:
        for metric in quantized[task]:
            assert rep["metrics"][task][metric] == pytest.approx(quantized[task][metric], rel=1e-5)
            assert rep["baseline"]["metrics"][task][metric] == pytest.approx(full[task][metric], rel=1e-5)
    ppl_q, ppl_fp = quantized[LL_TASK]["perplexity"], full[LL_TASK]["perplexity"]
    assert ppl_q != pytest.approx(ppl_fp, rel=1e-4)  # 4-bit weights and activations: other numbers
    assert rep["recovery"][LL_TASK]["perplexity"] == pytest.approx(ppl_fp / ppl_q, rel=1e-5)
    if full[MC_TASK]["acc"]:
        assert rep["recovery"][MC_TASK]["acc"] == pytest.approx(quantized[MC_TASK]["acc"] / full[MC_TASK]["acc"])
    assert "| task | metric | items | value | baseline | recovery |" in out


def test_eval_tasks_errors_are_one_line(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    folder = write_tasks(tmp_path / "tasks")
    base = ["eval", "tasks", "stories260k", "--include-path", folder]
    _one_line_error(*run_cli(base + ["--tasks", f"{MC_TASK},no_such_task"], capsys), 2, "--tasks",
                    "unknown task(s) no_such_task")
    _one_line_error(*run_cli(["eval", "tasks", "stories260k", "--tasks", MC_TASK, "--include-path",
                              tmp_path / "nowhere"], capsys), 2, "--include-path", "not a directory")
    _one_line_error(*run_cli(base + ["--tasks", " , "], capsys), 2, "--tasks", "at least one task")
    _one_line_error(*run_cli(base + ["--tasks", MC_TASK, "--baseline", "auto"], capsys), 2, "--baseline auto",
                    "not a blockscale checkpoint")
    _one_line_error(*run_cli(base + ["--tasks", MC_TASK, "--vllm-args", "tensor_parallel_size=2"], capsys), 2,
                    "--vllm-args needs --backend vllm")
    _one_line_error(*run_cli(base + ["--tasks", MC_TASK, "--backend", "vllm"], capsys), 2,
                    "--backend vllm takes a checkpoint directory or a hub name")
    _one_line_error(*run_cli(base + ["--tasks", MC_TASK, "--limit", "0"], capsys), 2, "--limit 0: must be >= 1")


def test_eval_tasks_vllm_without_vllm_is_one_line(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    if "vllm" in sys.modules or __import__("importlib.util").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    line = _one_line_error(*run_cli(["eval", "tasks", ckpt, "--tasks", "hellaswag", "--backend", "vllm",
                                     "--vllm-args", "tensor_parallel_size=2,gpu_memory_utilization=0.8"], capsys),
                           1, "vLLM", "pip install vllm")
    assert line.startswith("blockscale eval tasks: error:")


def test_eval_tasks_without_lm_eval_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: `import lm_eval` raises ImportError
    _one_line_error(*run_cli(["eval", "tasks", "stories260k", "--tasks", "hellaswag"], capsys), 1,
                    "pip install blockscale[eval]")


def test_eval_zero_shot_with_a_baseline(tmp_path, capsys, stories260k):
    code, out, err = run_cli(["eval", "zero-shot", "stories260k", "--limit", "6", "--baseline", "stories260k",
                              "--tasks", "last_word_tinystories,next_sentence_tinystories",
                              "--json", tmp_path / "z.json"], capsys)
    assert code == 0, err
    rep = json.loads((tmp_path / "z.json").read_text())
    lib = bs.eval.zero_shot(stories260k.model, stories260k.tokenizer,
                            ["last_word_tinystories", "next_sentence_tinystories"], limit=6, bos=True)
    assert rep["tasks"] == lib.as_dict()["tasks"] and rep["baseline"]["tasks"] == rep["tasks"]
    assert all(r == 1.0 for r in rep["recovery"].values() if r == r)
    assert "not a standard benchmark" in out and "| task | items | acc | acc_norm | baseline acc | recovery |" in out
    _one_line_error(*run_cli(["eval", "zero-shot", "stories260k", "--tasks", "hellaswag"], capsys), 2,
                    "--tasks hellaswag", "allowed values: last_word_tinystories")
    _one_line_error(*run_cli(["eval", "zero-shot", "stories260k", "--limit", "0"], capsys), 2, "--limit 0")
