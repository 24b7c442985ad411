"""Shared fixtures. Test modules opt in with ``pytestmark = pytest.mark.usefixtures(...)`` (or a fixture argument).

Session-scoped fixtures are built once per pytest run and shared by every test that asks for them: read them,
never change them; a test that changes the object takes the function-scoped copy (``stories260k_copy``)."""
import copy

import pytest
import torch

import blockscale as bs


@pytest.fixture
def one_thread():
    """Small tensor work: intra-op threads only add contention on a busy 2-core machine."""
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
