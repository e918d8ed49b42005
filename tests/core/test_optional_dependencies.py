"""A missing optional dependency is an ImportError of one line that names the extra to install,
wherever an optional one is imported: the adapters and the examples."""

import subprocess
import sys

import pytest

from fused_optim.optional import require

# Imports each module named on the command line with one package hidden (as if not installed).
HIDDEN = """
import sys
sys.modules[sys.argv[1]] = None  # `import X` raises ModuleNotFoundError, as for a missing package
try:
    {statement}
except ImportError as exc:
    print(exc)
"""


@pytest.mark.slow
@pytest.mark.parametrize("hidden, statement, message", [
    ("lightning", "import lightning_optim",
     "lightning_optim needs lightning, which is not installed: pip install 'fused-optim[lightning]'"),
    ("mmengine", "import mmengine_optim",
     "mmengine_optim needs mmengine, which is not installed: pip install 'fused-optim[mmengine]'"),
    ("matplotlib", "from examples.demo import report; report.figure([], None, '')",
     "the demo's plot needs matplotlib, which is not installed: pip install 'fused-optim[examples]'"),
    ("sklearn", "from examples.digits import load_digits; load_digits('val')",
     "the digits dataset needs sklearn, which is not installed: pip install 'fused-optim[examples]'"),
], ids=["lightning_optim", "mmengine_optim", "demo-plot", "digits"])
def test_a_missing_package_names_the_extra(hidden, statement, message):
    out = subprocess.run([sys.executable, "-c", HIDDEN.format(statement=statement), hidden], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == message, out.stdout + out.stderr


def test_require_returns_the_module_and_leaves_other_import_errors_alone(monkeypatch):
    import json

    assert require("json", "test", "this test") is json
    with pytest.raises(ImportError, match=r"^this test needs no_such_package_x, which is not installed: "
                                          r"pip install 'fused-optim\[test\]'$"):
        require("no_such_package_x.sub", "test", "this test")
    # a module that exists but whose own import fails: its error, unchanged
    monkeypatch.setitem(sys.modules, "broken_dep_y", None)
    monkeypatch.setattr("importlib.import_module", lambda name: __import__("broken_dep_y"))
    with pytest.raises(ModuleNotFoundError, match="broken_dep_y"):
        require("some_module", "test", "this test")
