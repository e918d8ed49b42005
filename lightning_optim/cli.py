"""``LightningCLI`` whose own ``--optimizer`` trains a model that ``configure_model`` shards, and
``StepSchedulerCLI``, whose ``--lr_scheduler`` steps per optimizer update."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import cli
from torch.optim.lr_scheduler import ReduceLROnPlateau
from typing_extensions import override


def follow_module_params(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Points ``optimizer``'s param groups at ``module``'s params where the module replaced them
    after the optimizer was made. LightningCLI makes its ``--optimizer`` when it starts, over the
    params the module has then; FSDP2's ``fully_shard`` in ``configure_model`` replaces each by a
    DTensor param of the same (global) shape, in the same order. The optimizer, still without
    state, then takes the module's params in its params' order. Nothing changes when it holds the
    module's params already; anything else (some of them held, another count or shape, state
    made) raises, naming the mismatch."""
    current = list(module.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    ids = {id(p) for p in current}
    if all(id(p) in ids for p in held):
        return
    problem = ("it holds some of the module's params and not others" if any(id(p) in ids for p in held) else
               f"it holds {len(held)} params, the module has {len(current)}" if len(held) != len(current) else
               "it has state already" if optimizer.state else
               next((f"param {i} has shape {tuple(p.shape)}, the module's {tuple(q.shape)}"
                     for i, (p, q) in enumerate(zip(held, current)) if p.shape != q.shape), None))
    if problem is not None:
        raise RuntimeError(f"{type(optimizer).__name__} was made over params the module no longer has (a "
                           f"strategy replaced them in configure_model), and cannot follow them: {problem}. Make "
                           "the optimizer in the module's configure_optimizers, over self.parameters()")
    replacements = iter(current)
    for group in optimizer.param_groups:
        group["params"] = [next(replacements) for _ in group["params"]]


class LightningCLI(cli.LightningCLI):
    """Lightning's ``LightningCLI``, except that its own ``--optimizer`` (and ``optimizer:`` in
    a config) also trains a module whose ``configure_model`` replaces its params, as FSDP2's
    ``fully_shard`` under ``ModelParallelStrategy`` does. Lightning's makes that optimizer when it
    starts, over the params the module has then, and the run trains nothing (Lightning issue
    #19110); this one points the optimizer at the module's params when Lightning asks the module
    for its optimizers, after ``configure_model`` (:func:`follow_module_params`). Use it where
    ``LightningCLI`` would be: ``LightningCLI(MyModule)``."""

    @staticmethod
    @override
    def configure_optimizers(lightning_module, optimizer, lr_scheduler=None) -> Any:
        follow_module_params(lightning_module, optimizer)
        return cli.LightningCLI.configure_optimizers(lightning_module, optimizer, lr_scheduler)


class StepSchedulerCLI(LightningCLI):
    """:class:`LightningCLI` whose command-line scheduler (``--lr_scheduler CLASS``) gets
    ``interval="step"`` instead of LightningCLI's per-epoch default (``ReduceLROnPlateau`` keeps
    LightningCLI's handling). With :class:`lightning_optim.AdaScaleCallback` among the callbacks
    that makes it a τ-driven schedule: after each update it sits at step ⌊τ⌋, e.g.::

        python train.py fit --optimizer fused_optim.FusedSGD --optimizer.lr 0.1 \\
            --lr_scheduler CosineAnnealingLR --lr_scheduler.T_max 1000 \\
            --trainer.callbacks+=lightning_optim.AdaScaleCallback --trainer.callbacks.tau_target 1000 \\
            --trainer.accumulate_grad_batches 4 --trainer.max_epochs -1

    with ``train.py`` calling ``StepSchedulerCLI(MyModule)`` where it would call ``LightningCLI``.
    """

    @staticmethod
    @override
    def configure_optimizers(lightning_module, optimizer, lr_scheduler=None) -> Any:
        if lr_scheduler is None or isinstance(lr_scheduler, ReduceLROnPlateau):
            return LightningCLI.configure_optimizers(lightning_module, optimizer, lr_scheduler)
        follow_module_params(lightning_module, optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}
