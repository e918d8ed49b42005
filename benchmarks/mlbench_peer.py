"""mlbench-core 3.0.0's own distributed optimizers, as the peers of :mod:`.distributed`'s table.

mlbench-core is optional and never a dependency: ``pip install --no-deps mlbench-core==3.0.0`` in
any venv with torch and numpy (tests/golden/record_mlbench_distributed.py's venv serves). Its
``optim/pytorch/{centralized,decentralized}.py`` and the modules they import are loaded by path as
modules of empty stub packages, so no ``mlbench_core/__init__`` (which imports the rest of
mlbench's dependencies) runs. They are built as record_mlbench_distributed.py builds them where
3.0.0's constructors are broken: ``CentralizedSGD`` as master's constructor does (its
``GenericCentralizedOptimizer.__init__`` and a ``torch.optim.SGD``), and ``DecentralizedSGD``'s
rank 0 (rejected by ``if not rank``) with a stand-in rank, its aggregation's rank set to 0 after.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path

PACKAGE = "mlbench_core"
# the packages on the way to the modules we load: stubs, their __init__ never runs
_STUBS = ("", ".utils", ".utils.pytorch", ".aggregation", ".aggregation.pytorch", ".optim", ".optim.pytorch")


def find(site: str | None) -> tuple[Path | None, str]:
    """(the ``mlbench_core`` directory, "") under ``site`` (a site-packages directory), or in this
    interpreter when ``site`` is None; (None, why not) when it is absent."""
    if site is not None:
        root = Path(site) / PACKAGE
        return (root, "") if (root / "optim" / "pytorch" / "centralized.py").is_file() else (
            None, f"no {PACKAGE} under {site}")
    spec = importlib.util.find_spec(PACKAGE)  # a top-level find_spec does not import the package
    if spec is None or not spec.submodule_search_locations:
        return None, f"{PACKAGE} is not installed in {sys.executable} (pass --mlbench SITE_PACKAGES)"
    return Path(next(iter(spec.submodule_search_locations))), ""


def modules(root: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """mlbench's (optim.pytorch.centralized, optim.pytorch.decentralized) modules, loaded by path."""
    for suffix in _STUBS:
        name = PACKAGE + suffix
        if name not in sys.modules:
            stub = sys.modules[name] = types.ModuleType(name)
            stub.__path__ = [str(root.joinpath(*suffix.split(".")[1:]))]
    return (importlib.import_module(f"{PACKAGE}.optim.pytorch.centralized"),
            importlib.import_module(f"{PACKAGE}.optim.pytorch.decentralized"))


def variants(root: str | Path, rank: int, world: int, neighbors: list[int], sgd: dict) -> dict:
    """name -> (model -> mlbench's optimizer over it), named as our rows in :mod:`.distributed`."""
    import torch

    # its PowerSGD writes P·Qᵀ (n × m) into a view of a ≥3-d grad with matmul(out=): torch resizes
    # the view (same storage, same numel: the values land right) and warns, once per shape
    warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
    central, decentral = modules(Path(root))

    def centralized(model, by_layer=False):
        opt = object.__new__(central.CentralizedSGD)  # 3.0.0's constructor raises: master's
        central.GenericCentralizedOptimizer.__init__(opt, world_size=world, model=model, by_layer=by_layer)
        opt.optimizer = torch.optim.SGD(model.parameters(), **sgd)
        return opt

    def decentralized(model):
        opt = decentral.DecentralizedSGD(rank=rank or world, neighbors=neighbors, model=model, **sgd)
        opt.agg.__self__.rank = rank  # 3.0.0 rejects rank 0: built with a stand-in (not a neighbour)
        return opt

    return {
        "CentralizedSGD (flat)": centralized,
        "CentralizedSGD (by layer)": lambda m: centralized(m, by_layer=True),
        **{f"PowerSGD rank {r}": (lambda m, r=r: central.PowerSGD(model=m, rank=r, **sgd)) for r in (1, 2, 4)},
        "DecentralizedSGD (ring)": decentralized,
    }
