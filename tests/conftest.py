import pytest
import torch

from fused_optim import _build


@pytest.fixture(scope="session", autouse=True)
def kernels():
    """Build (or load) the CPU kernels once; a build failure fails the run loudly here."""
    _build.load()
    torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where torch sees a GPU; elsewhere they skip, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
