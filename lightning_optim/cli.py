"""``StepSchedulerCLI``: a ``LightningCLI`` whose ``--lr_scheduler`` steps per optimizer update."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import LightningCLI
from torch.optim.lr_scheduler import ReduceLROnPlateau
from typing_extensions import override


class StepSchedulerCLI(LightningCLI):
    """``LightningCLI`` whose command-line scheduler (``--lr_scheduler CLASS``) gets
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
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}
