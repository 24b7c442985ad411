"""Shared fixtures. Test modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
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
