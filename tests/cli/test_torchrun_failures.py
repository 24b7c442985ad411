"""`blockscale quantize` under a real 2-process torchrun (gloo, CPU) when one rank's inputs differ from the
others' (issue 29): a rank failing alone (its --calib file missing) and ranks given different models each end
with one line naming the rank and the cause, every rank stopping at the first synchronisation point (not
calibrating on until it blocks against a dead peer), and nothing written.

The per-rank arguments come from a launcher script that replaces ``{RANK}`` in its arguments by the rank, as a
user's shell wrapper would."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = """import os, sys
from blockscale.cli.main import main
from blockscale.train.distributed import exit_process
exit_process(main([a.replace("{RANK}", os.environ["RANK"]) for a in sys.argv[1:]]))
"""


def _model(d: Path, seed: int) -> str:
    from blockscale.models.hf_moe_export import byte_transformers_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)  # a byte-level vocabulary, as the tokenizer
    byte_transformers_tokenizer().save_pretrained(d)
    return str(d)


def _torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp / "launch.py").write_text(LAUNCHER)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp / "launch.py"), "quantize", *args, "--method", "gptq", "--n-samples", "4", "--seq-len", "32",
           "--batch-size", "1", "--out", str(tmp / "out")]
    # a rank left waiting for a dead peer would block for gloo's 30-minute timeout: the 240 s here catch that
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)


def _error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "blockscale quantize: error:" in line]


@pytest.fixture
def calib(tmp_path) -> Path:
    f = tmp_path / "cal_0.txt"
    f.write_text("Once upon a time there was a little robot who loved to count the stars at night. " * 20)
    return f


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_a_rank_whose_calibration_file_is_missing_is_reported_and_every_rank_stops(tmp_path, calib):
    model = _model(tmp_path / "m", 0)
    proc = _torchrun(tmp_path, model, "--calib", str(tmp_path / "cal_{RANK}.txt"))
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "rank 1" in lines[0] and "cal_1.txt" in lines[0], lines
    assert not re.search(r'File ".*blockscale[/\\\\]', proc.stderr), proc.stderr[-4000:]  # torchrun's own only
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_ranks_given_different_models_are_refused_before_calibration(tmp_path, calib):
    _model(tmp_path / "m0", 0)
    _model(tmp_path / "m1", 1)  # same config and sizes, other weights (a fine-tune)
    proc = _torchrun(tmp_path, str(tmp_path / "m{RANK}"), "--calib", str(calib))
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "rank 1 holds another model than rank 0" in lines[0] and "weights of" in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_rank_0_failing_alone_prints_its_line_and_rank_1_stops(tmp_path, calib):
    _model(tmp_path / "m1", 0)  # rank 0's model directory does not exist
    proc = _torchrun(tmp_path, str(tmp_path / "m{RANK}"), "--calib", str(calib))
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1 and "m0" in lines[0] and "error: rank" not in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_world_size_without_torchrun_is_one_usage_error(tmp_path):
    """WORLD_SIZE set by hand (no torchrun, so no RANK / MASTER_ADDR / MASTER_PORT): one line naming what is
    missing and how to launch, exit status 2, nothing written (torch's own error was an 'internal error')."""
    env = {**os.environ, "WORLD_SIZE": "2", "PYTHONPATH": os.pathsep.join([str(REPO / "src"),
                                                                           os.environ.get("PYTHONPATH", "")])}
    for v in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    proc = subprocess.run([sys.executable, "-m", "blockscale.cli", "quantize", "stories260k", "--out",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not" in proc.stderr and "torchrun" in proc.stderr
    assert not (tmp_path / "out").exists()
