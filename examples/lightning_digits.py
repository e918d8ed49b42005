"""The Lightning configs' module (``configs/lightning/*.yaml``): :mod:`.digits` as a
LightningModule for ``LightningCLI``, sharded by FSDP2 (``fully_shard``) when the strategy is
Lightning's ``ModelParallelStrategy``, left whole for any other strategy (``FSDPStrategy``, DDP,
one device). The optimizer (and a scheduler) come from the config as the module's arguments,
made in ``configure_optimizers`` over the sharded params::

    model:
      optimizer:
        class_path: fused_optim.FusedAdam
        init_args: {lr: 0.001}

    python -m examples.lightning_digits fit --config configs/lightning/digits_fsdp2_fused_adam.yaml

Not LightningCLI's own ``optimizer:`` / ``--optimizer``: LightningCLI makes that optimizer when it
starts, over the params FSDP2 replaces in ``configure_model``, and the run then trains nothing
(docs/frameworks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fused_optim.optional import require

from .digits import DigitsCNN, load_digits

pl = require("lightning.pytorch", "examples", "the Lightning example")
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable  # noqa: E402


class DigitsModule(pl.LightningModule):
    """:class:`examples.digits.DigitsCNN` trained by cross-entropy on the digits' train split,
    ``batch_size`` images per rank and step, by ``optimizer`` (a class path in the config) with
    ``scheduler`` stepped per update, if given."""

    def __init__(self, optimizer: OptimizerCallable, scheduler: LRSchedulerCallable | None = None,
                 width: int = 16, batch_size: int = 32):
        super().__init__()
        self.net = DigitsCNN(width)
        self.optimizer, self.scheduler, self.batch_size = optimizer, scheduler, batch_size

    def configure_model(self):
        """Under ModelParallelStrategy: each conv and linear layer, then the net, become FSDP2
        units over the data-parallel dimension of the strategy's device mesh (their params
        become DTensors sharded along dim 0)."""
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net.modules():
            if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler(optimizer), "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(*load_digits("train")), batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss)
        return loss


def main(args: list[str] | None = None):
    """LightningCLI on :class:`DigitsModule` (the command line, or ``args``); returns it."""
    from lightning.pytorch.cli import LightningCLI

    return LightningCLI(DigitsModule, auto_configure_optimizers=False, args=args)


if __name__ == "__main__":
    from fused_optim.process_group import end_process_group

    main()
    end_process_group()  # a rank's gloo threads end before Python does (see fused_optim.process_group)
