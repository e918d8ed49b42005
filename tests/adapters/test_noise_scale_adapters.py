"""The noise scale in the frameworks: lightning_optim.NoiseScaleCallback and
mmengine_optim.NoiseScaleHook log B_simple, the batch and the suggested batch under the shared
names (fused_optim.metrics), with or without AdaScale, and their batch-size ramp raises the
accumulation count of the loop and of the statistics together."""

from __future__ import annotations

import json

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor
import pytest
import torch
from test_lightning import FAST, Regressor, SpyLogger, loader, sgd
from test_mmengine_runner import ADASCALE, BASELINE, train

import lightning_optim
from fused_optim import AdaScale, NoiseScale
from fused_optim.metrics import BATCH, NOISE_SCALE, SUGGESTED_BATCH

KEYS = (NOISE_SCALE, BATCH, SUGGESTED_BATCH)


@pytest.mark.parametrize("adascale", [False, True], ids=["noise-scale", "with-adascale-callback"])
def test_lightning_callback_logs_per_update_and_ramps_the_accumulation(adascale):
    """16 micro-batches of 4 samples per epoch, accumulation 2 (batch 8): 8 updates in epoch 0;
    B_simple is then above 32 samples, so with max_accumulation=8 epoch 1 accumulates 8 (batch
    32, 2 updates per epoch)."""
    spy = SpyLogger()
    callbacks = [lightning_optim.NoiseScaleCallback(micro_batch_size=4, prog_bar=True, max_accumulation=8,
                                                    min_windows=2)]
    if adascale:
        callbacks.append(lightning_optim.AdaScaleCallback())
    trainer = pl.Trainer(max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=1, callbacks=callbacks,
                         **{**FAST, "logger": spy})
    trainer.fit(Regressor(sgd), loader(16))
    opt = trainer.optimizers[0]
    assert type(opt).__name__.endswith("AdaScale" if adascale else "NoiseScale")  # (Lightning subclasses it)
    assert [step for step, _ in spy.series(NOISE_SCALE)] == list(range(10))  # once per update
    assert [b for _, b in spy.series(BATCH)] == [8.0] * 8 + [32.0] * 2
    assert [b for _, b in spy.series(SUGGESTED_BATCH)][-1] == 32.0  # (capped by max_accumulation)
    assert trainer.accumulate_grad_batches == opt.num_gradients_to_accumulate == 8
    if adascale:
        assert isinstance(opt, AdaScale) and opt.scale == 8.0  # the default scale follows the count
    # logged as float32: a relative rounding of 2**-24
    assert spy.series(NOISE_SCALE)[-1][1] == pytest.approx(opt.noise_scale(4), rel=1e-6)
    assert NOISE_SCALE in trainer.progress_bar_metrics


def test_lightning_ramp_resumes_where_it_was(tmp_path):
    """The ramp of the test above, checkpointed after epoch 0 (count 2, 8 windows measured) and
    resumed: epoch 1 accumulates 8 as in the unbroken run (12 updates in 3 epochs, not 18), with
    the same params bit for bit (the statistics come back with the optimizer state)."""
    def fit(epochs, ckpt_path=None, **kw):
        module = Regressor(sgd)
        callback = lightning_optim.NoiseScaleCallback(micro_batch_size=4, max_accumulation=8, min_windows=2)
        trainer = pl.Trainer(max_epochs=epochs, accumulate_grad_batches=2, callbacks=[callback], **{**FAST, **kw})
        trainer.fit(module, loader(16), ckpt_path=ckpt_path)
        return module, trainer

    whole, whole_trainer = fit(3)
    fit(1, enable_checkpointing=True, default_root_dir=tmp_path)
    (ckpt,) = tmp_path.rglob("*.ckpt")
    assert torch.load(ckpt, weights_only=True)["callbacks"]["NoiseScaleCallback"] == {
        "accumulation": 2, "ramp": {"windows": 8}}
    resumed, resumed_trainer = fit(3, ckpt_path=str(ckpt))
    assert resumed_trainer.global_step == whole_trainer.global_step == 12
    assert resumed_trainer.accumulate_grad_batches == 8
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), whole.parameters()))


def test_lightning_learning_rate_monitor_keeps_its_series():
    """With the callback (which wraps the optimizer in a NoiseScale) the monitor's series is the
    one it has without (lr-FusedSGD, not lr-NoiseScale), with the same lrs (the wrapper changes
    none); the monitor gets its own methods back after the fit."""
    series = []
    for callbacks in ([], [lightning_optim.NoiseScaleCallback(micro_batch_size=4)]):
        monitor = LearningRateMonitor()
        trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[monitor, *callbacks],
                             **{**FAST, "logger": SpyLogger()})
        trainer.fit(Regressor(sgd), loader(8))
        series.append(monitor.lrs)
        assert "_find_names_from_optimizers" not in vars(monitor)
    assert series[1] == series[0] and list(series[0]) == ["lr-FusedSGD"]


def test_lightning_callback_needs_accumulation_or_devices():
    trainer = pl.Trainer(max_steps=1, callbacks=[lightning_optim.NoiseScaleCallback(micro_batch_size=4)], **FAST)
    with pytest.raises(RuntimeError, match=r"NoiseScale needs .*Trainer\(accumulate_grad_batches=4\)"):
        trainer.fit(Regressor(sgd), loader(4))


@pytest.mark.slow
@pytest.mark.parametrize("config", [BASELINE, ADASCALE], ids=["fused-wrapper", "adascale-wrapper"])
def test_mmengine_hook_logs_per_update_and_ramps_accumulative_counts(config, tmp_path):
    """The digits configs with accumulative_counts=2 (batch 64): from the 4th update B_simple is
    above 128 samples, and with max_accumulation=4 the count becomes 4 at the next update whose
    iteration it divides (iteration 8)."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"_base_ = [{str(config)!r}]\noptim_wrapper = dict(accumulative_counts=2)\n"
                   "custom_hooks = [dict(type='mmengine_optim.NoiseScaleHook', max_accumulation=4, min_windows=2)]\n")
    runner = train(cfg, tmp_path, "train_cfg.max_iters=16", "default_hooks.logger.interval=2")
    (scalars,) = tmp_path.rglob("vis_data/scalars.json")
    logged = [json.loads(line) for line in scalars.read_text().splitlines()]
    logged = [r for r in logged if NOISE_SCALE in r]
    assert [r["iter"] for r in logged] == list(range(2, 17, 2)) and all(set(KEYS) <= set(r) for r in logged)
    assert [r[BATCH] for r in logged] == [64.0] * 3 + [128.0] * 5
    wrapper = runner.optim_wrapper
    opt = wrapper.optimizer
    assert isinstance(opt, AdaScale if config == ADASCALE else NoiseScale)
    assert wrapper._accumulative_counts == opt.num_gradients_to_accumulate == 4
    assert logged[-1][NOISE_SCALE] == opt.noise_scale(32)


@pytest.mark.slow
def test_mmengine_ramp_resumes_where_it_was(tmp_path):
    """The ramp of the test above under AdaScale (whose statistics are in the checkpoint), resumed
    from iteration 12 (count 4 since iteration 8): the resumed run keeps count 4 and ends with the
    unbroken run's params, bit for bit (it fell back to the config's count 2)."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"_base_ = [{str(ADASCALE)!r}]\noptim_wrapper = dict(accumulative_counts=2)\n"
                   "custom_hooks = [dict(type='mmengine_optim.NoiseScaleHook', max_accumulation=4, min_windows=2)]\n")
    options = ["train_cfg.max_iters=24", "default_hooks.checkpoint.interval=12",
               "default_hooks.param_scheduler.max_scale_invariant_iters=None"]
    whole = train(cfg, tmp_path / "whole", *options)
    saved = torch.load(tmp_path / "whole" / "iter_12.pth", weights_only=True)["noise_scale_ramp"]
    assert saved["accumulation"] == 4
    resumed = train(cfg, tmp_path / "resumed", *options, resume=tmp_path / "whole" / "iter_12.pth")
    assert resumed.optim_wrapper._accumulative_counts == whole.optim_wrapper._accumulative_counts == 4
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), whole.model.parameters()))
