"""mmengine's default optim wrapper constructor, with a clear error for an optimizer name that no
registry in reach holds.

mmengine's ``DefaultOptimWrapperConstructor`` looks the config's ``optimizer.type`` up itself and
passes what it gets to ``inspect.signature``: a name it does not find — a typo, or ``FusedAdam``
where mmengine leaves that bare name to DeepSpeed — fails with ``TypeError: None is not a
callable object``. :class:`OptimWrapperConstructor` raises a ``KeyError`` that names the type and
what to write instead. Importing ``mmengine_optim`` registers it under mmengine's name
``DefaultOptimWrapperConstructor`` (the constructor every ``optim_wrapper`` config gets unless it
names another); for the names it finds it is mmengine's, unchanged.
"""

from __future__ import annotations

import difflib

from mmengine import registry as _root
from mmengine.optim import DefaultOptimWrapperConstructor
from typing_extensions import override

from .registry import DEEPSPEED_NAMES, OPTIMIZERS, SCOPE


class OptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """``DefaultOptimWrapperConstructor`` that refuses an unknown optimizer type by name."""

    @override
    def __call__(self, model):
        optimizer_type = self.optimizer_cfg.get("type")
        if isinstance(optimizer_type, str):
            with _root.OPTIMIZERS.switch_scope_and_registry(None) as registry:  # where mmengine looks
                if registry.get(optimizer_type) is None:
                    raise KeyError(unknown_optimizer(optimizer_type))
        return super().__call__(model)


def unknown_optimizer(name: str) -> str:
    """Why ``name`` is no optimizer type, and what to write instead."""
    if "." not in name and name in OPTIMIZERS.module_dict:  # ours, its bare name left to its owner
        owner = "DeepSpeed's (mmengine's DeepSpeedStrategy registers it)" if name in DEEPSPEED_NAMES else "another's"
        return (f"optim_wrapper.optimizer.type={name!r}: the bare name is {owner}; write "
                f"type='{SCOPE}.{name}' for fused_optim's")
    known = {n.lower(): n for n in sorted(set(_root.OPTIMIZERS.module_dict) | set(OPTIMIZERS.module_dict))}
    close = [known[n] for n in difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.6)]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"optim_wrapper.optimizer.type={name!r} is not an optimizer name{hint} (fused_optim's are "
            f"'{SCOPE}.<name>': {', '.join(sorted(OPTIMIZERS.module_dict))})")


def register_constructor() -> None:
    """Make :class:`OptimWrapperConstructor` the one configs get by default (idempotent)."""
    _root.OPTIM_WRAPPER_CONSTRUCTORS.register_module(name="DefaultOptimWrapperConstructor",
                                                     module=OptimWrapperConstructor, force=True)
