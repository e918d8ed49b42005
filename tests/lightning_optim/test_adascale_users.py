"""lightning_optim's AdaScale as a user meets it: the strategy alone schedules by τ, a scheduler
that cannot follow τ is named at fit start, and the gain an update applied is readable from any
callback, whatever the order of the callbacks. One process (a DDP strategy on one device)."""

from __future__ import annotations

import math
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

import lightning_optim
from fused_optim.metrics import GAIN
from fused_optim.process_group import end_process_group
from test_lightning import FAST, Regressor, hand_loop, loader, sgd

EPOCH_WARNING = "AdaScaleCallback: the lr scheduler"


def cosine_per_step(params):
    opt = sgd(params)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.fixture
def one_rank_ddp():
    """A DDP strategy on one device runs in this process (no rank to launch): its process group
    and the environment variables Lightning's launcher sets are undone afterwards."""
    saved = dict(os.environ)
    yield
    end_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("own_callback", [False, True])
def test_adascale_ddp_strategy_alone_drives_the_schedule_by_tau(one_rank_ddp, own_callback, tmp_path):
    """``strategy="adascale_ddp"`` without an AdaScaleCallback: the strategy adds one (ahead of the
    checkpoint callback), so the step scheduler sits at ⌊τ⌋ (not at the update count) and the
    gain is logged; a callback the user gives is kept, alone (its τ target stops the run)."""
    callbacks = [ModelCheckpoint(save_last=False)]
    if own_callback:
        callbacks.append(lightning_optim.AdaScaleCallback(tau_target=5.0))
    trainer = pl.Trainer(devices=1, strategy="adascale_ddp", accumulate_grad_batches=2, max_epochs=3,
                         callbacks=callbacks, default_root_dir=tmp_path, **{**FAST, "enable_checkpointing": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(cosine_per_step), loader(8))
    assert not [w for w in caught if EPOCH_WARNING in str(w.message)]
    adascales = [cb for cb in trainer.callbacks if isinstance(cb, lightning_optim.AdaScaleCallback)]
    assert len(adascales) == 1 and (adascales[0] is callbacks[-1]) == own_callback
    assert trainer.callbacks.index(adascales[0]) < trainer.callbacks.index(callbacks[0])  # saved after it
    opt = trainer.optimizers[0]
    tau, (config,) = opt.scale_invariant_steps, trainer.lr_scheduler_configs
    assert tau > trainer.global_step + 1  # gains > 1: ⌊τ⌋ is not the update count
    assert config.scheduler.last_epoch == math.floor(tau)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * (1 + math.cos(math.pi * math.floor(tau) / 40)), rel=1e-12)
    assert trainer.callback_metrics[GAIN] > 1.0
    if own_callback:
        assert trainer.global_step < 12 and tau >= 5.0  # stopped at the target, before 3 epochs × 4 updates


def epoch_scheduler_as_lightning_cli_returns_it(params):
    opt = sgd(params)
    return LightningCLI.configure_optimizers(None, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1))


@pytest.mark.parametrize("make, warns", [(epoch_scheduler_as_lightning_cli_returns_it, True),
                                         (cosine_per_step, False)], ids=["epoch-interval", "step-interval"])
def test_a_scheduler_stepped_per_epoch_is_named_once_at_fit_start(make, warns):
    """The scheduler plain LightningCLI makes (``interval="epoch"``) cannot follow τ: one warning
    names it and the fixes; a per-step scheduler gets none."""
    trainer = pl.Trainer(max_epochs=2, accumulate_grad_batches=2, callbacks=[lightning_optim.AdaScaleCallback()],
                         **FAST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(make), loader(4))
    ours = [str(w.message) for w in caught if EPOCH_WARNING in str(w.message)]
    if warns:
        (message,) = ours
        assert "StepLR steps per epoch" in message and '"interval": "step"' in message
        assert "StepSchedulerCLI" in message and "follow_tau=False" in message
    else:
        assert ours == []


class ReadsTheGain(Callback):
    """A user's callback: in each ``on_train_batch_end``, the AdaScaleCallback's ``applied_gain``."""

    def __init__(self):
        self.gains = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        adascale = next(cb for cb in trainer.callbacks if isinstance(cb, lightning_optim.AdaScaleCallback))
        self.gains.append(adascale.applied_gain)


@pytest.mark.parametrize("user_first", [True, False], ids=["user-callback-first", "user-callback-last"])
def test_applied_gain_is_the_update_just_applied_whatever_the_callback_order(user_first):
    """10 micro-batches, accumulation 4: updates after batches 3, 7 and 9 (the last window short).
    ``applied_gain`` is the gain of the update of that batch (the hand loop's Δτ), None where no
    update was applied, the same listed before or after AdaScaleCallback."""
    reader, adascale = ReadsTheGain(), lightning_optim.AdaScaleCallback()
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=4,
                         callbacks=[reader, adascale] if user_first else [adascale, reader], **FAST)
    trainer.fit(Regressor(sgd), loader(10))
    _, want = hand_loop([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], 4)
    taus = [t for _, t in want]
    gains = [b - a for a, b in zip([0.0] + taus, taus)]
    assert [i for i, g in enumerate(reader.gains) if g is not None] == [3, 7, 9]
    assert [g for g in reader.gains if g is not None] == pytest.approx(gains, rel=1e-9)
    assert min(gains) > 1.0 and len(set(gains)) == 3  # a stale (previous) gain would not match
    assert trainer.callback_metrics[GAIN].item() == pytest.approx(gains[-1], rel=1e-6)  # logged as float32
