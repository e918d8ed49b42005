"""The private mmengine internals that mmengine_optim/_compat.py relies on are still there, with
the signatures and the behaviour it uses, on the installed mmengine: an upgrade that changes one
fails here, by name."""

import inspect

import pytest
import torch
from mmengine.hooks import CheckpointHook, Hook
from mmengine.model import BaseModel
from mmengine.optim import MultiStepLR, OptimWrapper
from mmengine.runner import Runner

from mmengine_optim import _compat

CHECKED = f"(checked on mmengine {_compat.MMENGINE_CHECKED}): update mmengine_optim/_compat.py"


def test_accumulative_counts_is_what_the_windows_follow():
    """A count set through _compat, then ``initialize_count_status``: updates every 2 backwards,
    and the last short window (5 = 2 + 2 + 1) divides its loss by 1."""
    param = torch.nn.Parameter(torch.zeros(()))
    wrapper = OptimWrapper(torch.optim.SGD([param], lr=0.1), accumulative_counts=3)
    assert _compat.accumulative_counts(wrapper) == 3, CHECKED
    _compat.set_accumulative_counts(wrapper, 2)
    wrapper.initialize_count_status(torch.nn.Linear(1, 1), 0, 5)
    updates, factors = [], []
    for _ in range(5):
        factors.append(float(1 / wrapper.scale_loss(torch.tensor(1.0))))
        wrapper.backward((param + 1).sum())
        updates.append(wrapper.should_update())
    assert updates == [False, True, False, True, True], CHECKED
    assert factors == [2.0, 2.0, 2.0, 2.0, 1.0], CHECKED


def test_scheduler_steps_counts_every_step_also_past_the_end():
    wrapper = OptimWrapper(torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=0.1))
    scheduler = MultiStepLR(wrapper, milestones=[1], by_epoch=False, end=2)
    for _ in range(4):
        scheduler.step()
    assert _compat.scheduler_steps(scheduler) == 4, CHECKED
    assert scheduler.last_step < 4  # the public count stops at ``end``: not a substitute


def test_checkpoint_hooks_save_takes_the_runner():
    assert list(inspect.signature(CheckpointHook._save_checkpoint).parameters) == ["self", "runner"], CHECKED


class Quadratic(BaseModel):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def forward(self, inputs, data_samples=None, mode="tensor"):
        out = self.net(inputs)
        return {"loss": out.pow(2).mean()} if mode == "loss" else out


class RecordingWrapper(OptimWrapper):
    runners: list = []

    def initialize_count_status(self, model, init_counts, max_counts):
        super().initialize_count_status(model, init_counts, max_counts)
        self.runners.append(_compat.calling_runner())


def runner(tmp_path, max_iters=1, **kwargs) -> Runner:
    model = Quadratic()
    data = torch.utils.data.DataLoader([{"inputs": torch.ones(2)}] * 2, batch_size=1)
    return Runner(model=model, work_dir=str(tmp_path), train_dataloader=data,
                  train_cfg=dict(by_epoch=False, max_iters=max_iters), log_level="WARNING",
                  optim_wrapper=RecordingWrapper(torch.optim.SGD(model.parameters(), lr=0.1)),
                  default_hooks=dict(checkpoint=None, logger=None), **kwargs)


@pytest.mark.slow
def test_runner_train_calls_initialize_count_status_itself(tmp_path):
    run = runner(tmp_path / "a")
    run.train()
    assert RecordingWrapper.runners == [run], CHECKED
    RecordingWrapper.runners.clear()
    run.optim_wrapper.initialize_count_status(run.model, 0, 1)  # from anywhere else: no runner
    assert RecordingWrapper.runners == [None]
    RecordingWrapper.runners.clear()


@pytest.mark.slow
def test_is_resuming_is_the_runners_resume_argument(tmp_path):
    assert _compat.is_resuming(runner(tmp_path / "a", resume=True)) is True, CHECKED
    assert _compat.is_resuming(runner(tmp_path / "b", load_from=None)) is False, CHECKED


class ShortenLoop(Hook):
    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        _compat.set_max_iters(runner.train_loop, 3)


@pytest.mark.slow
def test_set_max_iters_is_the_loops_length(tmp_path):
    """Set after the first of 5 iterations: the runner reports it and the loop ends there."""
    run = runner(tmp_path, max_iters=5, custom_hooks=[ShortenLoop()])
    run.train()
    RecordingWrapper.runners.clear()
    assert (run.max_iters, run.iter) == (3, 3), CHECKED


def test_amp_update_scale_backs_off_on_overflow_and_grows_after_the_interval():
    scale, tracker = torch.tensor(8.0), torch.zeros((), dtype=torch.int32)
    _compat.amp_update_scale_(scale, tracker, torch.tensor(1.0), 2.0, 0.5, 2)  # overflow: × backoff
    assert (float(scale), int(tracker)) == (4.0, 0), f"(checked on torch {_compat.TORCH_CHECKED})"
    for _ in range(2):  # two clean steps: × growth
        _compat.amp_update_scale_(scale, tracker, torch.tensor(0.0), 2.0, 0.5, 2)
    assert (float(scale), int(tracker)) == (8.0, 0), f"(checked on torch {_compat.TORCH_CHECKED})"
