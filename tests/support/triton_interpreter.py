"""Set-up shared by the Triton kernel tests; import it before anything else that imports triton.

Without a GPU the kernels run on CPU tensors under Triton's interpreter: TRITON_INTERPRET=1 must be
set before ``import triton`` (triton's own library kernels, e.g. ``tl.randint``, are decorated then)
and while kernels run (``make test`` sets it). If another module imported triton first without it,
the kernels cannot run in this process: ``test_rerun_in_a_fresh_interpreter`` reruns the test file
in a fresh one and ``_skip_when_rerun`` skips the in-process tests. With CUDA the same tests run the
kernels on the GPU against the CPU reference.

    from triton_interpreter import DEV, _skip_when_rerun, test_rerun_in_a_fresh_interpreter, tl, triton  # noqa
"""
import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
RERUN = not ON_GPU and not isinstance(tl.randint, InterpretedFunction)


@pytest.fixture(autouse=True)
def _skip_when_rerun(request):
    if RERUN and request.node.name != "test_rerun_in_a_fresh_interpreter":
        pytest.skip("runs in test_rerun_in_a_fresh_interpreter (triton was imported without TRITON_INTERPRET=1)")


def test_rerun_in_a_fresh_interpreter(request):
    if not RERUN:
        pytest.skip("this process runs the kernels itself")
    path = str(request.path)
    root = str(request.config.rootpath)  # the repository: pyproject.toml (pythonpath), tests/conftest.py
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                         cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-6000:] + out.stderr[-2000:]
