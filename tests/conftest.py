"""Shared fixtures. Test modules opt in with ``pytestmark = pytest.mark.usefixtures(...)`` (or a fixture argument).

Session-scoped fixtures are built once per pytest run and shared by every test that asks for them: read them,
never change them; a test that changes the object takes the function-scoped copy (``stories260k_copy``)."""
import copy
import os

import pytest
import torch

import blockscale as bs

# the compiled kernels are proven bit-identical explicitly (backend "compiled": quant/test_fast_paths.py, ...);
# background compilation under "auto" (quant/test_fast_kernel.py tests it) would only compete for the two cores
os.environ.setdefault("BLOCKSCALE_COMPILE_AFTER", "never")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on two cores: one intra-op thread each (the workers are the
    # parallelism), the same count in every test (torch.compile guards on it: no recompiles between tests)
    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """Small tensor work: intra-op threads only add contention on a busy 2-core machine (a no-op under
    `make test`'s workers, which run every test on one thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def reference_backend():
    """Eager reference kernels (no torch.compile) for the duration of a test."""
    with bs.use_backend("reference"):
        yield


@pytest.fixture(scope="session")
def stories260k():
    """The built-in stories260K (``blockscale.models.hf.load_model("stories260k")``: a transformers Llama and
    its tok512 tokenizer, from the shared data directory), loaded once per session. Read-only: quantize a
    ``copy.deepcopy`` of ``.model``, or take ``stories260k_copy``."""
    from blockscale.models.hf import load_model

    return load_model("stories260k")


@pytest.fixture
def stories260k_copy(stories260k):
    """A private deep copy of the session's stories260K (model and tokenizer), free to change in place."""
    return copy.deepcopy(stories260k)
