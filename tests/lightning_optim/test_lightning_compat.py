"""The private Lightning and torch internals that lightning_optim/_compat.py relies on are still
there, with the signatures and the behaviour it uses, on the installed versions: an upgrade that
changes one fails here, by name."""

import inspect
from collections import defaultdict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.overrides import distributed as lightning_distributed
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_optim import _compat

FAST = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0)


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("method, expected", [
    ("_find_names_from_schedulers", ["self", "lr_scheduler_configs"]),
    ("_find_names_from_optimizers", ["self", "optimizers", "seen_optimizers", "seen_optimizer_types"]),
    ("_extract_lr", ["self", "param_group", "name"]),
])
def test_learning_rate_monitor_methods_overridden_or_called(method, expected):
    assert parameters(getattr(LearningRateMonitor, method)) == expected, (
        f"LearningRateMonitor.{method} changed (checked on Lightning {_compat.LIGHTNING_CHECKED}): "
        "update lightning_optim/_compat.py's SeeThroughMonitor")


def test_see_through_names_the_wrapper_after_the_inner_optimizer_and_restores_the_class():
    class MyMonitor(LearningRateMonitor):
        pass

    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    wrapper = torch.optim.SGD(inner.param_groups, lr=0.5)  # shares the groups, as AdaScale does
    monitor = MyMonitor()
    key = monitor.state_key
    _compat.see_through(monitor, wrapper, inner, skip_lr=True)
    assert isinstance(monitor, MyMonitor) and monitor.state_key == key  # the checkpoint key stays
    assert monitor.inner_series_names([]) == ["lr-SGD"]
    names, _ = monitor._find_names_from_optimizers([wrapper], [], defaultdict(int))
    assert names == [["lr-SGD"]]
    monitor.lrs = {"lr-SGD": []}
    assert monitor._extract_lr(inner.param_groups[0], "lr-SGD") == {}  # left to the caller
    _compat.restore(monitor)
    assert type(monitor) is MyMonitor and "see_through_args" not in vars(monitor)
    assert monitor._extract_lr(inner.param_groups[0], "lr-SGD") == {"lr-SGD": 0.5}


def test_sync_module_states_takes_the_module():
    assert parameters(lightning_distributed._sync_module_states) == ["module"]
    assert _compat.sync_module_states is lightning_distributed._sync_module_states


def test_powersgd_should_compress():
    assert parameters(powerSGD_hook._should_compress) == ["num_rows", "num_cols", "matrix_approximation_rank",
                                                          "min_compression_rate"]
    assert _compat.should_compress(100, 100, 1, 2) == (True, 100 * 100, 100 + 100)  # 10⁴ numbers vs P and Q
    assert _compat.should_compress(2, 2, 1, 2)[0] is False  # 4 numbers vs 4: not worth it


class Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                   "interval": "step"}}


class HandOver(Callback):
    def on_fit_start(self, trainer, pl_module):
        _compat.hand_over_scheduler(trainer.lr_scheduler_configs[0])


@pytest.mark.parametrize("hand_over", [False, True])
def test_lightnings_loop_leaves_a_handed_over_scheduler_alone(hand_over):
    trainer = pl.Trainer(max_steps=5, callbacks=[HandOver()] if hand_over else [], **FAST)
    trainer.fit(Linear(), torch.utils.data.DataLoader(torch.randn(5, 2), batch_size=1))
    config = trainer.lr_scheduler_configs[0]
    assert _compat.is_handed_over(config) == hand_over
    assert config.scheduler.last_epoch == (0 if hand_over else 5)


def test_spawn_launcher_is_configured_and_launches_as_used():
    """``DDPStrategy._configure_launcher`` and ``_MultiProcessingLauncher.launch(function, *args,
    trainer=None, **kwargs)`` as FailureAwareSpawnLauncher uses them; each spawn strategy of
    lightning_optim gets that launcher, the popen ones Lightning's own."""
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    assert parameters(DDPStrategy._configure_launcher) == ["self"]
    assert parameters(_MultiProcessingLauncher.launch) == ["self", "function", "args", "trainer", "kwargs"]
    for name in ("adascale_ddp_spawn", "centralized_spawn", "decentralized_spawn", "powersgd_ddp_spawn",
                 "adascale_ddp"):
        launcher = pl.Trainer(devices=2, strategy=name, **FAST).strategy.launcher
        assert isinstance(launcher, _compat.FailureAwareSpawnLauncher) == name.endswith("_spawn"), name


def test_a_failing_launched_function_calls_on_failure_then_raises():
    failures = []

    def fail(x):
        raise ValueError(f"failed with {x}")

    assert _compat._run_or_fail(lambda x: x + 1, lambda: failures.append(1), 1) == 2 and failures == []
    with pytest.raises(ValueError, match="failed with 3"):
        _compat._run_or_fail(fail, lambda: failures.append(1), 3)
    assert failures == [1]
