"""experiments/zero_shot_results.py on a smoke run (stories260K, a few items, a few distillation steps): every cell
once, a rerun computes nothing, ``--max-minutes 0`` starts nothing, the report has a row per cell."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "zero_shot_results.py"


def _script():
    spec = importlib.util.spec_from_file_location("zero_shot_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_resumes_and_reports(tmp_path, capsys):
    script, out = _script(), tmp_path / "run"
    smoke = ["--model", "stories260k", "--limit", "4", "--eval-tokens", "1024", "--steps", "2", "--out", str(out)]
    assert script.main(smoke + ["--max-minutes", "0"]) == 0
    assert "--max-minutes 0 spent" in capsys.readouterr().out and not (out / "results.jsonl").exists()
    assert script.main(smoke) == 0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows] == ["full precision", "RTN (scale to 6) | w4a16", "RTN + 4/6 | w4a16",
                                        "Hessian-aware scales | w4a16", "Hessian-aware scales + recovery | w4a16"]
    for r in rows:
        assert r["tokens_evaluated"] > 1000 and set(r["tasks"]) == {"last_word_tinystories", "last_word_wikitext2",
                                                                   "next_sentence_tinystories"}
        assert all(t["items"] == 4 for t in r["tasks"].values())
    assert rows[-1]["steps"] == 2 and rows[-1]["trainable_params"] > 0
    assert rows[1]["ppl"] > rows[0]["ppl"]  # 4-bit weights cost perplexity
    capsys.readouterr()
    assert script.main(smoke) == 0  # nothing left to do
    assert "every cell is in" in capsys.readouterr().out
    assert len((out / "results.jsonl").read_text().splitlines()) == 5
    assert script.main(["--report-only", str(out)]) == 0
    md = capsys.readouterr().out
    assert "not a standard benchmark" in md and md.count("\n| ") == 6  # the header and a row per cell
    assert "| Hessian-aware scales + recovery (W4A16) |" in md and "(100%)" in md
