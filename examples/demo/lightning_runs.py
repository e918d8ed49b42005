"""The demo's runs in Lightning (``python -m examples.demo``): a LightningModule for the digits CNN, the
run's Trainer (``accumulate_grad_batches`` and ``AdaScaleCallback``, or ``"adascale_ddp_spawn"``
over 2 CPU processes) and a progress bar that records the run."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ProgressBar
from torch.utils.data import DataLoader, TensorDataset

from fused_optim import AdaScale, FusedSGD
from fused_optim.process_group import end_process_group
from lightning_optim import AdaScaleCallback

from ..digits import DigitsCNN, load_digits
from .plan import Run, Setup
from .recorder import Recorder, load_result


class DigitsModule(pl.LightningModule):
    """The digits CNN trained with FusedSGD (momentum, weight decay, state_dtype) on the run's schedule:
    cosine over ``run.schedule_steps`` after a linear warm-up from lr/S (``interval="step"``:
    with AdaScaleCallback it follows ⌊τ⌋)."""

    def __init__(self, run: Run, setup: Setup):
        super().__init__()
        self.run, self.demo_setup = run, setup
        self.net = DigitsCNN()

    def train_dataloader(self) -> DataLoader:
        images, labels = load_digits("train")
        return DataLoader(TensorDataset(images, labels), batch_size=self.run.batch_size, shuffle=True, drop_last=True,
                          generator=torch.Generator().manual_seed(self.demo_setup.seed))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        run = self.run
        opt = FusedSGD(self.parameters(), lr=run.lr, **self.demo_setup.optimizer_options())
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=run.schedule_steps - run.warmup_steps)
        if run.warmup_steps:
            warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / run.scale, total_iters=run.warmup_steps)
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, sched], milestones=[run.warmup_steps])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RecordingProgressBar(ProgressBar):
    """Lightning's progress bar slot, filled by the demo's :class:`Recorder` (one bar per run in
    τ, on rank 0), which it feeds after each optimizer update."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        _quiet()  # also in spawned ranks

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.recorder.start(pl_module.net)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not trainer.is_global_zero or trainer.global_step == self.recorder.steps:
            return  # a micro-batch that only accumulated
        opt = trainer.strategy.optimizers[0]
        adascale = opt if isinstance(opt, AdaScale) else None
        tau = None if adascale is None else adascale.scale_invariant_steps
        self.recorder.update(pl_module.net, trainer.global_step, tau, adascale)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.recorder.finish(pl_module.net)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # After the strategy's teardown, which unwrapped the DDP module: a spawned rank ends its
        # process group before its Python exits (see fused_optim.process_group).
        end_process_group()


def train(run: Run, setup: Setup, out_dir: Path, title: str) -> dict:
    """Train ``run`` with Lightning; its result as :meth:`Recorder.finish` wrote it."""
    _quiet()
    pl.seed_everything(setup.seed, verbose=False)
    callbacks = [RecordingProgressBar(Recorder(run, setup, out_dir, title))]
    if run.method == "adascale":
        callbacks.append(AdaScaleCallback(tau_target=run.tau_target, log=False))
    trainer = pl.Trainer(
        accelerator="cpu", devices=run.world_size, strategy="adascale_ddp_spawn" if run.world_size > 1 else "auto",
        accumulate_grad_batches=run.accumulate, max_steps=run.max_steps, max_epochs=-1, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0)
    trainer.fit(DigitsModule(run, setup))
    return load_result(run, out_dir)


def _quiet() -> None:
    """Keep the demo's output to its bars and table: Lightning's info lines and the warnings
    about a tiny in-memory dataset (no workers, few batches) say nothing about the experiment."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    for message in (".*does not have many workers.*", ".*number of training batches.*logging interval.*",
                    r".*isinstance\(treespec, LeafSpec\)"):
        warnings.filterwarnings("ignore", message=message)
