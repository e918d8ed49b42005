"""Optional dependencies: :func:`require` imports one, or fails with one line that names the
package extra to install (``pip install 'fused-optim[lightning]'``), instead of a bare
``ModuleNotFoundError`` from deep inside an import."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """The module ``module``, imported; if it is not installed, ``ImportError`` saying that
    ``needed_by`` needs it and which extra of this package brings it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the module is there; something it imports is not: not ours to rename
        raise ImportError(f"{needed_by} needs {module.split('.')[0]}, which is not installed: "
                          f"pip install 'fused-optim[{extra}]'") from None
