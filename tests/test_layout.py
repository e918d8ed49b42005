"""Imports run one way: the adapters (``lightning_optim``, ``mmengine_optim``) import the core,
the examples (``fused_optim.examples``) import the adapters and the core; the core never imports a
framework, an adapter or the examples, and the adapters never import the examples.

Checked twice: statically, from every module's ``import`` statements (also those inside functions,
which run late), and at run time, by importing every module of the core and the adapters in a
fresh process and looking at what got loaded."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = "fused_optim.examples"
ADAPTERS = ("lightning_optim", "mmengine_optim")
FRAMEWORKS = ("lightning", "pytorch_lightning", "mmengine")
# What each layer must not import (a name, or any module inside it).
FORBIDDEN = {"core": (*FRAMEWORKS, *ADAPTERS, EXAMPLES), "adapters": (EXAMPLES,)}
# The one exception: `fused-optim demo` runs the examples, importing them when the command runs.
ALLOWED = {("fused_optim.cli", "fused_optim.examples.demo")}


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    """``"core"``, ``"adapters"`` or None (the examples, which may import anything of ours)."""
    if module == EXAMPLES or module.startswith(EXAMPLES + "."):
        return None
    return "core" if module.split(".")[0] == "fused_optim" else "adapters"


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


def violations(root: Path) -> list[str]:
    """``"module imports name"`` for every import under ``root`` that runs against the direction."""
    found = []
    for package in ("fused_optim", *ADAPTERS):
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(root, path)
            kind = layer(module)
            for name in sorted(imports(root, path)):
                allowed = any(module == m and within(name, (target,)) for m, target in ALLOWED)
                if kind and within(name, FORBIDDEN[kind]) and not allowed:
                    found.append(f"{module} imports {name}")
    return found


def test_no_module_imports_against_the_direction():
    assert violations(ROOT) == []


def test_the_check_finds_each_kind_of_wrong_import(tmp_path):
    """A tree with one wrong import per rule (absolute, relative, inside a function, by
    import_module) and allowed ones: exactly the wrong ones are reported."""
    files = {
        "fused_optim/__init__.py": "",
        "fused_optim/cli.py": "def demo():\n    from .examples.demo import run_demo\n",  # the allowed one
        "fused_optim/adam.py": "import torch\nfrom lightning.pytorch import Callback\n",
        "fused_optim/bench/__init__.py": "",
        "fused_optim/bench/run.py": "def f():\n    from ..examples import digits\n",
        "fused_optim/norm.py": "import importlib\nimportlib.import_module('mmengine_optim.hooks')\n",
        "fused_optim/examples/__init__.py": "import lightning_optim\nimport mmengine\n",  # examples: anything
        "lightning_optim/__init__.py": "from fused_optim import AdaScale\nimport lightning.pytorch\n",
        "mmengine_optim/__init__.py": "from fused_optim.examples.mmengine_digits import DigitsDataset\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert violations(tmp_path) == [
        "fused_optim.adam imports lightning.pytorch",
        "fused_optim.adam imports lightning.pytorch.Callback",
        "fused_optim.bench.run imports fused_optim.examples",
        "fused_optim.bench.run imports fused_optim.examples.digits",
        "fused_optim.norm imports mmengine_optim.hooks",
        "mmengine_optim imports fused_optim.examples.mmengine_digits",
        "mmengine_optim imports fused_optim.examples.mmengine_digits.DigitsDataset",
    ]


# Imports every module of the given packages (but the examples) in a fresh process, then prints
# which modules of the forbidden ones got loaded.
LOADED = """
import importlib, json, pkgutil, sys
packages, forbidden = sys.argv[1].split(","), tuple(sys.argv[2].split(","))
def load(name):
    module = importlib.import_module(name)
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if f"{name}.{info.name}" != "fused_optim.examples":
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


def test_importing_the_core_loads_no_framework_adapter_or_example():
    assert loaded(("fused_optim",), FORBIDDEN["core"]) == []


def test_importing_the_adapters_loads_no_example():
    assert loaded(ADAPTERS, FORBIDDEN["adapters"]) == []
