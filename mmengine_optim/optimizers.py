"""Every optimizer of :mod:`fused_optim.registry`, registered for mmengine configs.

In our scope (``type='mmengine_optim.<name>'``, no ``custom_imports`` needed) each optimizer class
is registered under its class name (``FusedSGD``, ``FusedLAMB``, …, and ColossalAI's ``Lars`` /
``Lamb`` for ``ColossalLars`` / ``ColossalLamb``: ``CLASS_ALIASES``) and each entry of the core
registry under its entry name (``adamw``, ``nvlamb``, …: the class with the entry's defaults).
After ``custom_imports=dict(imports=['mmengine_optim'])`` the names work bare too: they are added
to mmengine's root registry, except where the name is already taken (another library's
``FusedSGD`` stays, and that is logged once; ours is still ``mmengine_optim.FusedSGD``) or is one
that mmengine's ``DeepSpeedStrategy`` registers later without ``force`` where DeepSpeed is
installed (our taking it would make that strategy raise ``KeyError``): there bare ``FusedAdam``
is DeepSpeed's (a config naming it without that strategy gets a ``KeyError`` saying to write
``mmengine_optim.FusedAdam``), elsewhere ours.
Registering is idempotent: :func:`register_optimizers` runs at import and may run again after a
new core entry.
"""

from __future__ import annotations

import functools

from mmengine import registry as _root

from fused_optim.registry import CLASS_ALIASES, OptimizerSpec, create_optimizer, get_spec, list_optimizers

from .registry import OPTIMIZERS, register


def _entry_factory(spec: OptimizerSpec):
    """``create_optimizer(spec.name, params, **kwargs)``: the class with the entry's defaults,
    keyword arguments overriding them. The first parameter is ``params`` (mmengine's constructor
    fills the first parameter with the model's)."""

    @functools.wraps(spec.cls, assigned=("__module__", "__doc__"), updated=())
    def factory(params, **kwargs):
        return create_optimizer(spec.name, params, **kwargs)

    factory.__name__ = factory.__qualname__ = factory.entry = spec.name
    del factory.__wrapped__  # its signature is its own: mmengine fills the first parameter, ``params``
    return factory


def register_optimizers() -> None:
    """(Re)register every core optimizer in our scope, and bare in the root where the name is free."""
    _root.OPTIMIZERS.import_from_location()  # torch.optim's entries first: we never shadow them
    for name in list_optimizers():
        spec = get_spec(name)
        register(OPTIMIZERS, spec.cls)
        register(OPTIMIZERS, _entry_factory(spec))
    for alias, cls in CLASS_ALIASES.items():
        register(OPTIMIZERS, cls, alias)
