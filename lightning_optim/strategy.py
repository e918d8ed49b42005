"""DDP strategies that wrap the LightningModule's optimizers in AdaScale, by name:
``Trainer(strategy="adascale_ddp")`` (popen launcher, like ``"ddp"``) and
``"adascale_ddp_spawn"`` (like ``"ddp_spawn"``). Registered when ``lightning_optim`` is imported."""

from __future__ import annotations

import atexit
from typing import Any

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerStatus
from typing_extensions import override

from fused_optim.process_group import end_process_group

from ._compat import FailureAwareSpawn
from .callback import AdaScaleCallback
from .wrapping import as_adascale


class GroupEndingDDPStrategy(FailureAwareSpawn):
    """``DDPStrategy`` that ends the rank's process group when the rank's Python exits normally
    (an ``atexit`` handler, which runs before the interpreter finalizes), so that no gloo thread
    outlives it (the abort described in fused_optim/process_group.py).

    Not at the end of ``fit``: a later ``trainer.test``, ``save_checkpoint`` or second ``fit`` in
    the same process reuses the group, and a group re-created at once on the same port could meet
    another rank's old one, still up. After a failed run the group is left alone: ending it waits
    for every rank, which a failed run may never bring (the failing rank would wait at exit for
    ranks blocked in a collective with it, and the launcher, waiting for it, would never end them).
    A rank started by the popen launcher learns of the failure at ``teardown``; a spawned rank,
    where Lightning runs no hook on a failure, from its launcher
    (:class:`~lightning_optim._compat.FailureAwareSpawn`): it then exits at once, and
    Lightning's launcher ends the other ranks and raises the failing rank's error."""

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        atexit.unregister(end_process_group)  # once per process, however many runs
        atexit.register(end_process_group)

    @override
    def teardown(self) -> None:
        trainer = _attached_trainer(self.lightning_module)
        super().teardown()
        if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
            leave_group_at_exit()

    @staticmethod
    def on_rank_failure() -> None:
        leave_group_at_exit()


def leave_group_at_exit() -> None:
    """After a failure: this rank's exit does not end the process group (see
    :class:`GroupEndingDDPStrategy`)."""
    atexit.unregister(end_process_group)


class AdaScaleDDPStrategy(GroupEndingDDPStrategy):
    """``DDPStrategy`` whose optimizers are wrapped in :class:`fused_optim.AdaScale` with the
    world size and ``accumulate_grad_batches`` of the trainer; the module stays unchanged.

    Under automatic optimization the trainer also gets an
    :class:`~lightning_optim.AdaScaleCallback` (with this strategy's AdaScale options) if its
    callbacks have none, so τ drives the ``interval="step"`` schedulers and the ``adascale/*``
    metrics are logged as with the callback; give your own ``AdaScaleCallback`` for a τ target or
    other options. (Manual optimization steps its schedulers itself: nothing is added.)

    Args:
        scale, smoothing, is_scaled_loss, debias_ewma: passed to AdaScale (Lightning divides each
            micro-batch loss by the accumulation count, so ``is_scaled_loss=True`` fits it).
        *args, **kwargs: ``DDPStrategy``'s (``start_method``, ``process_group_backend``, ...).

    Example::

        import lightning.pytorch as pl, lightning_optim
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="adascale_ddp_spawn",
                             accumulate_grad_batches=2, max_steps=100)
        # or explicitly: strategy=lightning_optim.AdaScaleDDPStrategy(scale=8.0, start_method="spawn")
        # or by a name of your own: StrategyRegistry.register("adascale8", AdaScaleDDPStrategy, scale=8.0)
    """

    def __init__(self, *args: Any, scale: float | None = None, smoothing: float | None = None,
                 is_scaled_loss: bool = True, debias_ewma: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.adascale_kwargs = dict(scale=scale, smoothing=smoothing, is_scaled_loss=is_scaled_loss,
                                    debias_ewma=debias_ewma)

    @override
    def setup_environment(self) -> None:
        """DDP's, then the :class:`AdaScaleCallback` the trainer lacks (before a checkpoint's
        callback states are restored, which comes next; ahead of the checkpoint callbacks, which
        save its state after it has seen the batch)."""
        super().setup_environment()
        module = self.lightning_module
        trainer = _attached_trainer(module)
        if trainer is None or not module.automatic_optimization:
            return
        if not any(isinstance(callback, AdaScaleCallback) for callback in trainer.callbacks):
            first_checkpoint = next((i for i, callback in enumerate(trainer.callbacks)
                                     if isinstance(callback, Checkpoint)), len(trainer.callbacks))
            trainer.callbacks.insert(first_checkpoint, AdaScaleCallback(**self.adascale_kwargs))

    @override
    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)  # configure_optimizers, schedulers checked against the raw optimizers
        self.optimizers = [as_adascale(opt, self.world_size, trainer.accumulate_grad_batches, **self.adascale_kwargs)
                           for opt in self.optimizers]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("adascale_ddp", "popen"), ("adascale_ddp_spawn", "spawn")):
            strategy_registry.register(name, cls, description=f"DDP + AdaScale, start_method '{start_method}'",
                                       start_method=start_method, override=True)


def _attached_trainer(module):
    """The Trainer ``module`` (a LightningModule, or None) is attached to, or None."""
    try:
        return None if module is None else module.trainer
    except RuntimeError:  # "... is not attached to a `Trainer`"
        return None


AdaScaleDDPStrategy.register_strategies(StrategyRegistry)
