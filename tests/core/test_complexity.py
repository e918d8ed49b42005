"""No function of the shipped packages has a cyclomatic complexity above ``LIMIT`` (radon's count:
1 + one per branch, loop, ``and`` / ``or``, ``except``, comprehension ``for`` / ``if``). A function
above it holds several steps that each deserve a name: split it."""

from __future__ import annotations

from pathlib import Path

import pytest

radon_complexity = pytest.importorskip("radon.complexity", reason="pip install 'fused-optim[test]' (radon)")
from radon.visitors import Class  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fused_optim", "lightning_optim", "mmengine_optim")
LIMIT = 15


def _blocks(blocks, prefix=""):
    """Every function, method and closure of radon's blocks (its top-level functions, classes and
    their methods), as (qualified name, complexity)."""
    for block in blocks:
        if isinstance(block, Class):
            for inner in block.inner_classes:
                yield from _blocks([inner, *inner.methods], f"{prefix}{block.name}.")
            continue
        name = f"{prefix}{block.classname}.{block.name}" if block.is_method else f"{prefix}{block.name}"
        yield name, block.complexity
        yield from _blocks(block.closures, f"{name}.")


def complexities(root: Path = ROOT) -> dict[str, int]:
    """``"path:qualified name" -> complexity`` of every function under the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            blocks = radon_complexity.cc_visit(path.read_text())
            for name, complexity in _blocks(blocks):
                found[f"{path.relative_to(root).as_posix()}:{name}"] = complexity
    return found


def test_no_function_is_above_the_limit():
    over = {name: c for name, c in complexities().items() if c > LIMIT}
    assert not over, f"above cyclomatic complexity {LIMIT} (split them): {over}"


def test_the_count_sees_methods_closures_and_boolean_operators(tmp_path):
    """A method and a closure are counted on their own, ``and`` / ``or`` count as branches."""
    (tmp_path / "fused_optim").mkdir()
    (tmp_path / "fused_optim" / "m.py").write_text(
        "class A:\n"
        "    def f(self, a, b):\n"
        "        def g(x):\n"
        "            return x if x else 0\n"
        "        return a and b or g(a)\n"
        "\n"
        "    class B:\n"
        "        def h(self, x):\n"
        "            for _ in x:\n"
        "                pass\n"
    )
    assert complexities(tmp_path) == {"fused_optim/m.py:A.f": 3, "fused_optim/m.py:A.f.g": 2,
                                      "fused_optim/m.py:A.B.h": 2}
