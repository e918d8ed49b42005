"""The adapters reach into Lightning's, mmengine's and torch's private internals only from their
``_compat.py`` (where tests/lightning_optim/test_lightning_compat.py and test_mmengine_compat.py check each reach
against the installed versions): no other module of lightning_optim or mmengine_optim reads,
writes, imports or names by string a ``_private`` attribute of an object that is not its own."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("fused_optim", "lightning_optim", "mmengine_optim")
# torch's optimizer protocol: fused_optim's optimizers set it, torch's GradScaler and Lightning read it.
PROTOCOL = {"_step_supports_amp_scaling"}
MODULES = sorted(p for package in ("lightning_optim", "mmengine_optim") for p in (ROOT / package).glob("*.py")
                 if p.name != "_compat.py")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PROTOCOL


def framework_sources(cls: type) -> str:
    """The source of every class ``cls`` inherits from outside our packages."""
    sources = []
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith(OURS) and base.__module__ != "builtins":
            try:
                sources.append(inspect.getsource(base))
            except (OSError, TypeError):  # a C extension type
                pass
    return "\n".join(sources)


def reaches(path: Path) -> list[str]:
    module = importlib.import_module(f"{path.parent.name}.{path.stem}")
    tree = ast.parse(path.read_text())
    found = []
    for cls_node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        inherited = framework_sources(getattr(module, cls_node.name))
        for node in ast.walk(cls_node):  # self._x that a framework base class defines, or overriding it
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and is_private(node.attr) and node.attr in inherited):
                found.append(f"line {node.lineno}: self.{node.attr} (inherited)")
            elif isinstance(node, ast.FunctionDef) and is_private(node.name) and f"def {node.name}(" in inherited:
                found.append(f"line {node.lineno}: def {node.name} (overrides)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith(OURS):
            found += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names if is_private(a.name)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and is_private(str(node.args[1].value))):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_private_framework_internals_are_reached_only_from_compat(path):
    assert reaches(path) == [], f"move these into {path.parent.name}/_compat.py (with a test of the reach)"


def test_the_check_sees_each_kind_of_reach(tmp_path, monkeypatch):
    """The check itself, on a module with one reach of each kind (as the adapters had them)."""
    (tmp_path / "probe_pkg").mkdir()
    (tmp_path / "probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "probe_pkg" / "probe.py").write_text(
        "from mmengine.optim import OptimWrapper\n"
        "from lightning.pytorch.overrides.distributed import _sync_module_states\n"
        "class Wrapper(OptimWrapper):\n"
        "    def _clip_grad(self):\n"
        "        pass\n"
        "    def backward(self, loss):\n"
        "        self._inner_count += 1\n"
        "        self._own = 1\n"
        "def counts(wrapper, module):\n"
        "    return wrapper._accumulative_counts, getattr(module, '_trainer', None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = reaches(tmp_path / "probe_pkg" / "probe.py")
    assert sorted(f.split(": ", 1)[1] for f in found) == sorted([
        "def _clip_grad (overrides)", "self._inner_count (inherited)", "wrapper._accumulative_counts",
        "from lightning.pytorch.overrides.distributed import _sync_module_states", "getattr(module, '_trainer', None)"])
