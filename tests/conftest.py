import pytest
import torch

from fused_optim import _build


@pytest.fixture(scope="session", autouse=True)
def kernels():
    """Build (or load) the CPU kernels once; a build failure fails the run loudly here."""
    _build.load()
    torch.set_num_threads(2)
