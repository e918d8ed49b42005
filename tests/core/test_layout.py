"""Imports run one way: the adapters (``lightning_optim``, ``mmengine_optim``) import the core
(``fused_optim``); the repository's ``examples/`` and ``benchmarks/`` (not shipped) import
anything; the core never imports a framework, an adapter, an example or a benchmark, and the
adapters never import an example or a benchmark. Within the shipped packages the imports form no
cycle.

Checked twice: statically, from every module's ``import`` statements (also those inside functions,
which run late), and at run time, by importing every module of the core and the adapters in a
fresh process and looking at what got loaded."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = "fused_optim"
ADAPTERS = ("lightning_optim", "mmengine_optim")
SHIPPED = (CORE, *ADAPTERS)
NOT_SHIPPED = ("examples", "benchmarks")
FRAMEWORKS = ("lightning", "pytorch_lightning", "mmengine")
# What each layer must not import (a name, or any module inside it).
FORBIDDEN = {"core": (*FRAMEWORKS, *ADAPTERS, *NOT_SHIPPED), "adapters": NOT_SHIPPED}


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """``"core"`` or ``"adapters"``."""
    return "core" if module.split(".")[0] == CORE else "adapters"


def imports(root: Path, path: Path) -> set[str]:
    """The absolute names ``path`` imports: ``import a.b`` gives ``a.b``; ``from p import x`` gives
    ``p`` and ``p.x`` (x may be a module), relative imports resolved against the module's package;
    ``importlib.import_module("a.b")`` with a literal name gives ``a.b``."""
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def shipped_modules(root: Path) -> dict[str, Path]:
    return {module_name(root, path): path for package in SHIPPED for path in sorted((root / package).rglob("*.py"))}


def violations(root: Path) -> list[str]:
    """``"module imports name"`` for every import under ``root`` that runs against the direction."""
    return [f"{module} imports {name}" for module, path in shipped_modules(root).items()
            for name in sorted(imports(root, path)) if within(name, FORBIDDEN[layer(module)])]


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the shipped modules it imports. ``from p import x`` counts as importing ``p.x``
    where that is a module, else ``p`` (a name of p's ``__init__``). A module's own ancestor
    packages are left out where it imports a module through them: Python runs a package's
    ``__init__`` before any of its modules, so that edge is no dependency of the module's."""
    modules = shipped_modules(root)
    graph = {}
    for module, path in modules.items():
        names = imports(root, path)
        targets = {name for name in names if name in modules}
        # `from p import x` also gives p: drop it where x was a module (the edge is p.x).
        targets -= {name for name in targets if any(other.startswith(name + ".") for other in targets)}
        graph[module] = {t for t in targets if t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_imports_against_the_direction():
    assert violations(ROOT) == []


def test_the_shipped_packages_import_without_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    """Two modules importing each other, one of them inside a function (it runs late, so Python
    does not fail, but the modules still depend on each other both ways), and a package whose
    ``__init__`` imports its modules (no cycle): only the two are reported."""
    files = {
        "fused_optim/__init__.py": "from .registry import create\nfrom .adam import Adam\n",
        "fused_optim/adam.py": "from . import _ops\n",
        "fused_optim/_ops.py": "",
        "fused_optim/registry.py": "from .distributed import by_params\n",
        "fused_optim/distributed/__init__.py": "from .by_params import SGD\n",
        "fused_optim/distributed/by_params.py": "def f():\n    from ..registry import create\n",
        "lightning_optim/__init__.py": "from fused_optim import Adam\n",
        "mmengine_optim/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert cycles(import_graph(tmp_path)) == [["fused_optim.distributed.by_params", "fused_optim.registry"]]


def test_the_check_finds_each_kind_of_wrong_import(tmp_path):
    """A tree with one wrong import per rule (absolute, inside a function, by import_module) and
    allowed ones: exactly the wrong ones are reported."""
    files = {
        "fused_optim/__init__.py": "",
        "fused_optim/cli.py": "def bench():\n    from benchmarks import optimizers\n",
        "fused_optim/adam.py": "import torch\nfrom lightning.pytorch import Callback\n",
        "fused_optim/norm.py": "import importlib\nimportlib.import_module('mmengine_optim.hooks')\n",
        "examples/__init__.py": "import lightning_optim\nimport mmengine\n",  # examples: anything
        "lightning_optim/__init__.py": "from fused_optim import AdaScale\nimport lightning.pytorch\n",
        "mmengine_optim/__init__.py": "from examples.mmengine_digits import DigitsDataset\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert violations(tmp_path) == [
        "fused_optim.adam imports lightning.pytorch",
        "fused_optim.adam imports lightning.pytorch.Callback",
        "fused_optim.cli imports benchmarks",
        "fused_optim.cli imports benchmarks.optimizers",
        "fused_optim.norm imports mmengine_optim.hooks",
        "mmengine_optim imports examples.mmengine_digits",
        "mmengine_optim imports examples.mmengine_digits.DigitsDataset",
    ]


# Imports every module of the given packages in a fresh process, then prints which modules of the
# forbidden ones got loaded.
LOADED = """
import importlib, json, pkgutil, sys
packages, forbidden = sys.argv[1].split(","), tuple(sys.argv[2].split(","))
def load(name):
    module = importlib.import_module(name)
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        load(f"{name}.{info.name}")
for package in packages:
    load(package)
print(json.dumps(sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))))
"""


def loaded(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", LOADED, ",".join(packages), ",".join(forbidden)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_importing_the_core_loads_no_framework_adapter_example_or_benchmark():
    assert loaded(("fused_optim",), FORBIDDEN["core"]) == []


@pytest.mark.slow
def test_importing_the_adapters_loads_no_example_or_benchmark():
    assert loaded(ADAPTERS, FORBIDDEN["adapters"]) == []
