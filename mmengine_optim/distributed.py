"""fused_optim's distributed optimizers in mmengine configs, and the model wrapper they need::

    model_wrapper_cfg = dict(type='mmengine_optim.OptimizerSyncedModel')  # no DDP: the optimizer communicates
    optim_wrapper = dict(type='OptimWrapper',
                         optimizer=dict(type='mmengine_optim.CentralizedSGD', lr=0.1, momentum=0.9))

mmengine's optimizer constructor fills an optimizer's first parameter with the model's params;
each name here takes them first: ``PowerSGD`` and ``CentralizedSparsifiedSGD`` are the classes,
the others :mod:`fused_optim.distributed.by_params`'s constructors (``world_size`` defaults to the group's; ``CustomCentralizedOptimizer``
takes its inner optimizer as a config, ``optimizer=dict(type='mmengine_optim.adamw', lr=1e-3)``;
``DecentralizedSGD`` takes ``neighbors='ring'``, ``dict(type='torus', rows=..., cols=...)`` or a
list, for this process's rank). Train with ``torchrun ... -m mmengine_optim.train CONFIG --launcher pytorch``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fused_optim import distributed as fd
from fused_optim.distributed import by_params

from .registry import MODEL_WRAPPERS, OPTIMIZERS, register


class OptimizerSyncedModel(torch.nn.Module):
    """A model wrapper that does not communicate: the optimizer averages grads or params itself.
    At construction it broadcasts rank 0's params and buffers (as DDP does), so every rank starts
    from the same model. ``train_step`` / ``val_step`` / ``test_step`` are the module's."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for tensor in module.state_dict().values():
                    dist.broadcast(tensor, 0)

    def train_step(self, data, optim_wrapper):
        return self.module.train_step(data, optim_wrapper)

    def val_step(self, data):
        return self.module.val_step(data)

    def test_step(self, data):
        return self.module.test_step(data)


def CustomCentralizedOptimizer(params, optimizer: dict, world_size=None, **kwargs):  # noqa: N802
    """fused_optim's params-first ``CustomCentralizedOptimizer``, its inner ``optimizer`` a config
    that mmengine's registry builds (any optimizer type it knows)."""
    return by_params.CustomCentralizedOptimizer(params, lambda ps: OPTIMIZERS.build({**optimizer, "params": ps}),
                                                world_size, **kwargs)


def register_distributed() -> None:
    """Register the names above in our scope (and bare where free); idempotent."""
    for factory in (by_params.CentralizedSGD, by_params.CentralizedAdam, CustomCentralizedOptimizer,
                    by_params.DecentralizedSGD, fd.PowerSGD, fd.CentralizedSparsifiedSGD):
        register(OPTIMIZERS, factory)
    register(MODEL_WRAPPERS, OptimizerSyncedModel)
