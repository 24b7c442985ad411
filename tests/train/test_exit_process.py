"""``train.distributed.exit_process``: how a process of a torchrun job ends. A rank skips interpreter
finalisation (a gloo worker thread releasing the last collective's tensors during finalisation aborted 1 run
in 8 of a 2-rank ``learn-scales --fsdp``: tests/cli/test_learn_scales_fsdp.py), with its output flushed and
its exit status kept; a single process exits normally."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import atexit, sys
from blockscale.train.distributed import exit_process
atexit.register(lambda: print("finalised", flush=True))
print("buffered line", end="")          # not flushed yet: exit_process must flush it
sys.stderr.write("on stderr")
exit_process(int(sys.argv[1]))
"""


def _run(world: str, code: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": world, "PYTHONPATH": os.pathsep.join([str(REPO / "src"),
                                                                               os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONUNBUFFERED", None)
    return subprocess.run([sys.executable, "-c", SCRIPT, str(code)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_ends_without_finalisation_with_its_output_and_status(code):
    proc = _run("2", code)
    assert proc.returncode == code
    assert proc.stdout == "buffered line"  # flushed, and no atexit handler ran
    assert proc.stderr == "on stderr"


def test_a_single_process_exits_normally():
    proc = _run("1", 3)
    assert proc.returncode == 3
    assert proc.stdout == "buffered line" + "finalised\n"


ENTRY = """
import atexit, runpy, sys
atexit.register(lambda: print("finalised", flush=True))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("world", ["1", "2"])
@pytest.mark.parametrize("module, args, code", [("blockscale.cli", ["recipes"], 0),
                                                ("blockscale.cli", ["recipes", "no-such-recipe"], 2),
                                                ("blockscale.train", ["--data", "no/such/file"], 2)])
def test_the_command_line_entry_points_end_through_exit_process(module, args, code, world):
    """``python -m blockscale.cli`` and ``python -m blockscale.train`` end with the command's exit status; as
    a rank of a job without finalisation (no atexit handler runs), alone normally."""
    env = {**os.environ, "WORLD_SIZE": world, "PYTHONPATH": os.pathsep.join([str(REPO / "src"),
                                                                             os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", ENTRY, module, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.endswith("finalised\n") == (world == "1"), proc.stdout[-300:]
    if code:
        assert proc.stderr.count("\n") == 1 and "error:" in proc.stderr, proc.stderr


def test_the_console_script_is_the_entry_python_m_runs():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["blockscale"] == "blockscale.cli.main:entry"
