"""fused_optim's distributed optimizers in mmengine configs, and the model wrapper they need::

    model_wrapper_cfg = dict(type='mmengine_optim.OptimizerSyncedModel')  # no DDP: the optimizer communicates
    optim_wrapper = dict(type='OptimWrapper',
                         optimizer=dict(type='mmengine_optim.CentralizedSGD', lr=0.1, momentum=0.9))

mmengine's optimizer constructor fills an optimizer's first parameter with the model's params;
each name here takes them first: ``PowerSGD`` and ``CentralizedSparsifiedSGD`` are the classes,
the others :mod:`fused_optim.distributed.by_params`'s constructors (``world_size`` defaults to the
group's; ``CustomCentralizedOptimizer`` takes its inner optimizer as a config,
``optimizer=dict(type='mmengine_optim.adamw', lr=1e-3)``; ``DecentralizedSGD`` takes
``neighbors='ring'``, ``dict(type='torus', rows=..., cols=...)`` or a list, for this process's
rank). ``custom_hooks=[dict(type='mmengine_optim.PerRankCheckpointHook')]`` keeps every rank's
params and optimizer state in the checkpoints (exact resume). Train with
``torchrun ... -m mmengine_optim.train CONFIG --launcher pytorch``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fused_optim import distributed as fd
from fused_optim.distributed import by_params

from mmengine.hooks import CheckpointHook, Hook
from mmengine.optim import OptimWrapperDict
from typing_extensions import override

from fused_optim.distributed import per_rank

from .registry import HOOKS, MODEL_WRAPPERS, OPTIMIZERS, register


class OptimizerSyncedModel(torch.nn.Module):
    """A model wrapper that does not communicate: the optimizer averages grads or params itself.
    At construction it broadcasts rank 0's params and buffers (as DDP does), so every rank starts
    from the same model. ``train_step`` / ``val_step`` / ``test_step`` are the module's; the first
    ``train_step`` refuses an optimizer that does not communicate (each rank would train its own)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self._checked = False  # whether train_step has checked that the optimizers communicate
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for tensor in module.state_dict().values():
                    dist.broadcast(tensor, 0)

    def train_step(self, data, optim_wrapper):
        """The module's, after checking (once) that each optimizer of ``optim_wrapper`` (an
        OptimWrapper or an OptimWrapperDict) communicates."""
        if not self._checked:
            wrappers = optim_wrapper.values() if isinstance(optim_wrapper, OptimWrapperDict) else [optim_wrapper]
            for wrapper in wrappers:
                fd.check_communicates(wrapper.optimizer, "mmengine_optim.OptimizerSyncedModel",
                                      "mmengine's MMDistributedDataParallel (leave out model_wrapper_cfg)")
            self._checked = True
        return self.module.train_step(data, optim_wrapper)

    def val_step(self, data):
        return self.module.val_step(data)

    def test_step(self, data):
        return self.module.test_step(data)


class PerRankCheckpointHook(Hook):
    """Per-rank checkpoints for the distributed optimizers: the ranks' params can differ
    (``DecentralizedSGD``) and so can their optimizer state (``PowerSGD``'s error memories), but
    mmengine saves rank 0's only, and only rank 0 runs the save and its hooks. So after each
    iteration (epoch) at which the ``CheckpointHook`` will save (its interval and last save; not
    its best-metric saves), just before it, every rank's model ``state_dict`` and ``optimizer``
    state are gathered to rank 0, which puts them into ``checkpoint["per_rank"]`` (the top-level
    entries stay rank 0's). After a load (``resume``, ``load_from``) each rank takes its own,
    before mmengine loads them. A resume needs the same number of ranks."""

    priority = "LOW"  # before the CheckpointHook (VERY_LOW) in the same after_train_iter / _epoch

    def __init__(self):
        self._gathered = None

    def _gather_if_saving(self, runner, due) -> None:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        saver = next((h for h in runner.hooks if isinstance(h, CheckpointHook)), None)
        if saver is None or not due(saver):
            return
        model = runner.model.module if hasattr(runner.model, "module") else runner.model
        own = {"state_dict": model.state_dict(), "optimizer": runner.optim_wrapper.state_dict()}
        self._gathered = per_rank.gather(own, tuple(own))

    @override
    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self._gather_if_saving(runner, lambda h: not h.by_epoch and (
            h.every_n_train_iters(runner, h.interval, h.save_begin) or (h.save_last and h.is_last_train_iter(runner))))

    @override
    def after_train_epoch(self, runner) -> None:
        self._gather_if_saving(runner, lambda h: h.by_epoch and (
            h.every_n_epochs(runner, h.interval, h.save_begin) or (h.save_last and h.is_last_train_epoch(runner))))

    @override
    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self._gathered is not None:
            checkpoint[per_rank.PER_RANK], self._gathered = self._gathered, None

    @override
    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        per_rank.restore(checkpoint, "the checkpoint", "torchrun's nproc_per_node × nnodes")


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
    register(HOOKS, PerRankCheckpointHook)
