import importlib.util
import multiprocessing.process
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import fused_optim
from fused_optim import _build

# Child processes (DDP ranks, the CLI, workers) import the fused_optim under test, not whichever
# copy their working directory holds (the repo, when the tests run against the installed package):
# no cwd or script directory on their sys.path (Python >= 3.11), this package's root first on it.
# The repository's examples/ and benchmarks/ (not in the package) are found after it: last.
REPO = Path(__file__).resolve().parents[1]
os.environ["PYTHONSAFEPATH"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(fused_optim.__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")]), str(REPO)])


def _import_from_repository(name: str) -> None:
    """Import the repository's top-level package ``name`` by path: the fused_optim under test
    stays the one imported above (the repository's root is not put first on sys.path), and a
    package of the same name elsewhere on sys.path (fairscale's wheel ships a ``benchmarks``)
    does not shadow it."""
    spec = importlib.util.spec_from_file_location(name, REPO / name / "__init__.py",
                                                  submodule_search_locations=[str(REPO / name)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


for _package in ("examples", "benchmarks"):
    _import_from_repository(_package)

# The tests' folders mirror the source (core, kernels, emulation, distributed, the adapters, build,
# ...); some tests reuse another file's cases and helpers by module name (``from test_ops import
# SCALARS``), across folders: every folder is on the path (test file names are unique, as pytest
# requires without packages).
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(d) for d in sorted(TESTS.iterdir()) if d.is_dir() and d.name not in ("golden", "__pycache__")]


@pytest.fixture(scope="session", autouse=True)
def kernels():
    """Build (or load) the CPU kernels once; a build failure fails the run loudly here."""
    _build.load()
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def seeded_rng(request):
    """Each test draws from torch's and Python's global generators seeded from its own id: its
    data is the same whichever tests ran before it and in every run (torch seeds its default
    generator at random at startup), so a failure reproduces from the test's id alone (its file's
    name and its name with parameters: the same from any working directory)."""
    seed = zlib.crc32(f"{request.node.path.name}::{request.node.name}".encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def only_slow_tests_start_processes(request, monkeypatch):
    """The fast tier (``make test-fast``: ``-m "not slow"``) starts no process: a test that starts
    one (a compiler, ninja, a worker, a spawned rank, the CLI) must be marked ``slow``. A test
    without the mark that tries fails at once, naming the fix."""
    if request.node.get_closest_marker("slow"):
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow "
                           "(make test-fast runs no test that compiles or spawns)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


# Folders whose every test compiles (the emulated CUDA library, the build checks) or starts ranks.
SLOW_FOLDERS = ("emulation", "distributed", "build")


def pytest_collection_modifyitems(config, items):
    """Tests in :data:`SLOW_FOLDERS` are marked ``slow``. Tests marked ``cuda`` run only where torch
    sees a GPU; elsewhere they skip, saying why."""
    for item in items:
        if item.path.parent.name in SLOW_FOLDERS and item.path.parent.parent == TESTS:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
