"""Child registries of mmengine's, with scope ``mmengine_optim``.

A config names ``type='mmengine_optim.FusedLAMB'`` (or any entry here) without ``custom_imports``:
for an unknown scope mmengine imports ``'<scope>.registry'`` — this module, whose package import
registers everything — and looks the name up in the child registry of that scope. Names inside
our scope never clash with what other libraries put in mmengine's root registries; each name is
also registered bare in the root where that is free (see :func:`register_bare`).
"""

from __future__ import annotations

import importlib
import importlib.util

import mmengine.runner  # noqa: F401  (imports mmengine's strategies, which register their names first)
from mmengine import registry as _root
from mmengine.logging import print_log

SCOPE = "mmengine_optim"

# Registered into mmengine's root OPTIMIZERS by DeepSpeedStrategy.__init__ without force=True,
# where DeepSpeed is installed.
DEEPSPEED_NAMES = frozenset({"DeepSpeedCPUAdam", "FusedAdam", "FusedLamb", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"})
# mmengine's own entries that cannot work without a package (the one imported here); where that is
# missing, ours take the bare name.
NEEDS = {(_root.OPTIM_WRAPPERS.name, "ColossalAIOptimWrapper"): "colossalai.booster"}
_reported: set[str] = set()  # bare names held by another library, logged once


class _ScopedRegistry(_root.Registry):
    """A child registry whose unknown names raise ``KeyError`` naming the key and the registry.
    (mmengine's optimizer constructor calls ``get`` directly and would otherwise fail with
    ``TypeError: None is not a callable object``.)"""

    def get(self, key: str):
        obj = super().get(key)
        if obj is None:
            raise KeyError(f"{key.split('.')[-1]} is not in the {SCOPE}::{self.name} registry; "
                           f"it has: {', '.join(sorted(self.module_dict))}")
        return obj


def _child(root):
    return _ScopedRegistry(root.name, parent=root, scope=SCOPE, locations=[SCOPE])


OPTIMIZERS = _child(_root.OPTIMIZERS)
OPTIM_WRAPPERS = _child(_root.OPTIM_WRAPPERS)
HOOKS = _child(_root.HOOKS)
MODEL_WRAPPERS = _child(_root.MODEL_WRAPPERS)


def register_bare(child: _root.Registry, name: str, obj) -> None:
    """Also register ``obj`` under its bare ``name`` in ``child``'s root registry (for configs that
    use ``custom_imports``), unless the name is taken — by another library (logged once, but for
    torch.optim's SGD, Adam, AdamW and Adagrad; ours stays reachable as ``mmengine_optim.<name>``) — or is claimed later by DeepSpeedStrategy. A
    name held by an mmengine class that cannot work here (:data:`NEEDS`) becomes ours."""
    root = child.parent
    if root is _root.OPTIMIZERS and name in DEEPSPEED_NAMES and deepspeed_installed():
        return
    taken = root.module_dict.get(name)
    if taken is None or (taken is not obj and _cannot_work(root, name, taken)):
        root.register_module(name=name, module=obj, force=True)
    elif (getattr(taken, "entry", taken) != getattr(obj, "entry", obj) and (root.name, name) not in _reported
          and not taken.__module__.startswith("torch.optim")):  # SGD, Adam, AdamW, Adagrad stay torch's, as documented
        _reported.add((root.name, name))
        print_log(f"{SCOPE}: the bare {root.name} name {name!r} belongs to {taken.__module__}.{taken.__qualname__}; "
                  f"use type='{SCOPE}.{name}' for ours", logger="current")


def register(child: _root.Registry, obj, name: str | None = None) -> None:
    """Register ``obj`` in our scope (replacing an older entry of ours) and bare where free."""
    name = name or obj.__name__
    child.register_module(name=name, module=obj, force=True)
    register_bare(child, name, obj)


def deepspeed_installed() -> bool:
    """Whether mmengine's DeepSpeedStrategy can register DeepSpeed's optimizers (it imports
    ``deepspeed``, and registers nothing where that fails)."""
    return importlib.util.find_spec("deepspeed") is not None


def _cannot_work(root: _root.Registry, name: str, taken) -> bool:
    """Whether ``taken``, mmengine's own entry ``name``, needs a package that does not import here."""
    needed = NEEDS.get((root.name, name))
    if needed is None or not getattr(taken, "__module__", "").startswith("mmengine."):
        return False
    try:
        importlib.import_module(needed)
    except Exception:  # mmengine's own test: any failure leaves the class without its package
        return True
    return False
