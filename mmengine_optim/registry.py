"""Child registries of mmengine's, with scope ``mmengine_optim``.

A config names ``type='mmengine_optim.FusedLAMB'`` (or any entry here) without ``custom_imports``:
for an unknown scope mmengine imports ``'<scope>.registry'`` — this module, whose package import
registers everything — and looks the name up in the child registry of that scope. Names inside
our scope never clash with what other libraries put in mmengine's root registries.
"""

from __future__ import annotations

from mmengine import registry as _root

SCOPE = "mmengine_optim"


def _child(root):
    return _root.Registry(root.name, parent=root, scope=SCOPE, locations=[SCOPE])


OPTIMIZERS = _child(_root.OPTIMIZERS)
OPTIM_WRAPPERS = _child(_root.OPTIM_WRAPPERS)
HOOKS = _child(_root.HOOKS)
MODELS = _child(_root.MODELS)
DATASETS = _child(_root.DATASETS)
METRICS = _child(_root.METRICS)
