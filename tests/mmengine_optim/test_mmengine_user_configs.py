"""Configs as a user writes them, run with ``Runner.from_cfg``: mmengine's default CheckpointHook
resumes under torch's default ``weights_only``; a checkpoint interval inside accumulation windows
warns; the loop's length (mmengine's ETA) follows the τ target."""

import os
import warnings
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

# Every test builds an mmengine Runner, whose environment report starts the compiler (its version).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# A plain mmengine config: mmengine's default hooks (its CheckpointHook), our optimizer by bare name.
PLAIN = """
custom_imports = dict(imports=['mmengine_optim', 'examples.mmengine_digits'], allow_failed_imports=False)
model = dict(type='DigitsClassifier', width=16)
train_dataloader = dict(batch_size=32, num_workers=0, sampler=dict(type='DefaultSampler', shuffle=True),
                        collate_fn=dict(type='default_collate'), dataset=dict(type='DigitsDataset', split='train'))
optim_wrapper = dict(optimizer=dict(type='FusedSGD', lr=0.1, momentum=0.9))
train_cfg = dict(by_epoch=False, max_iters=8)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=4))
randomness = dict(seed=0)
log_level = 'WARNING'
"""


def run(config_text: str, work_dir: Path, **overrides) -> Runner:
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "config.py").write_text(config_text)
    cfg = Config.fromfile(work_dir / "config.py")
    cfg.merge_from_dict(dict(work_dir=str(work_dir), experiment_name=work_dir.name, **overrides))
    runner = Runner.from_cfg(cfg)
    runner.train()
    return runner


def params(runner):
    return [p.detach().clone() for p in runner.model.parameters()]


def test_mmengines_default_checkpoint_hook_resumes_under_weights_only(tmp_path):
    assert os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") is None
    whole = run(PLAIN, tmp_path / "whole")
    assert not any(type(h).__name__ == "PortableCheckpointHook" for h in whole.hooks)
    resumed = run(PLAIN, tmp_path / "resumed", resume=True, load_from=str(tmp_path / "whole" / "iter_4.pth"))
    assert resumed.iter == whole.iter == 8
    for a, b in zip(params(resumed), params(whole)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert resumed.message_hub.get_scalar("train/loss").data[1].sum() == 8  # the resumed log goes on from iter 4


ACCUMULATING = PLAIN.replace("optim_wrapper = dict(", "optim_wrapper = dict(type='FusedOptimWrapper', accumulative_counts=2, ")


def window_warnings(config_text: str, work_dir: Path, **overrides) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(config_text, work_dir, **overrides)
    return [str(w.message) for w in caught if "accumulation windows" in str(w.message)]


def test_a_checkpoint_inside_accumulation_windows_warns_once_naming_the_fix(tmp_path):
    config = ACCUMULATING.replace("interval=4", "interval=3")
    (message,) = window_warnings(config, tmp_path / "odd", train_cfg=dict(max_iters=4))
    assert "CheckpointHook(interval=3, save_begin=0) saves every 3 iterations" in message
    assert "accumulative_counts=2" in message and "checkpoint=dict(interval=4)" in message
    assert window_warnings(ACCUMULATING, tmp_path / "even", train_cfg=dict(max_iters=4)) == []


def test_an_epoch_checkpoint_inside_accumulation_windows_warns(tmp_path):
    """45 iterations per epoch (1438 images, batch 32): an epoch ends inside a window of 2."""
    config = ACCUMULATING.replace("by_epoch=False, max_iters=8", "by_epoch=True, max_epochs=1").replace(
        "by_epoch=False, interval=4", "by_epoch=True, interval=1")
    (message,) = window_warnings(config, tmp_path)
    assert "saves every 1 epochs (45 iterations)" in message and "checkpoint=dict(interval=2)" in message


class LoopLength(Hook):
    """Records, at each iteration after mmengine's IterTimerHook set the ETA (priority NORMAL) and
    before the logger prints it (BELOW_NORMAL), the loop's length and the ETA."""

    def __init__(self):
        self.seen, self.time = [], 0.0

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.time += runner.message_hub.get_scalar("train/time").current()
        mean_time = self.time / (len(self.seen) + 1)
        self.seen.append((runner.iter, runner.max_iters, runner.message_hub.get_info("eta"), mean_time))


def run_to_tau(tmp_path: Path, tau: float, train_cfg: str) -> tuple[Runner, LoopLength]:
    """configs/digits_fused_sgd_adascale.py (AdaScale at scale 4: 4 micro-batches per update),
    stopping at τ = ``tau``, with the train loop ``train_cfg``."""
    config = (f"_base_ = [{str(ROOT / 'configs' / 'digits_fused_sgd_adascale.py')!r}]\n"
              f"default_hooks = dict(param_scheduler=dict(max_scale_invariant_iters={tau}),\n"
              "                     checkpoint=dict(interval=400))\n"
              f"train_cfg = {train_cfg}\nlog_level = 'WARNING'\n")
    (tmp_path / "config.py").write_text(config)
    cfg = Config.fromfile(tmp_path / "config.py")
    cfg.work_dir = str(tmp_path)
    runner = Runner.from_cfg(cfg)
    recorder = LoopLength()
    runner.register_hook(recorder, priority=55)
    runner.train()
    return runner, recorder


def test_the_loop_length_and_eta_follow_the_tau_target(tmp_path):
    """max_iters=2000, stop at τ = 20: the loop's length starts at 2000 and follows the expected
    stop, which it ends at; the ETA follows it."""
    runner, recorder = run_to_tau(tmp_path, 20, "dict(max_iters=2000, val_interval=10000)")
    stop = runner.iter
    assert runner.optim_wrapper.scale_invariant_iter >= 20 and stop < 80  # gains > 1: under 20 updates of 4
    iters, lengths, etas, mean_times = zip(*recorder.seen)
    assert iters == tuple(range(stop)) and lengths[:4] == (2000,) * 4  # no update yet: the configured length
    assert all(i + 2 <= n <= 2000 for i, n in zip(iters, lengths))
    assert all(n % 4 == 0 for n in lengths)  # the loop stops at the end of a window
    assert abs(lengths[-1] - stop) <= 4  # at the end, within one window of where it stopped
    # the ETA (IterTimerHook's) is the mean iteration time × the iterations left until that length
    assert etas == pytest.approx([t * (n - i - 1) for i, n, t in zip(iters, lengths, mean_times)], rel=1e-12)


def test_an_epoch_loop_length_follows_tau_and_ends_with_the_epoch(tmp_path):
    """An EpochBasedTrainLoop of 45 iterations per epoch stops at the end of the epoch in which τ
    reaches 20: the length then becomes that epoch's end, so it is never passed (ETA ≥ 0)."""
    runner, recorder = run_to_tau(
        tmp_path, 20, "dict(_delete_=True, type='EpochBasedTrainLoop', max_epochs=40, val_interval=100)")
    assert runner.optim_wrapper.scale_invariant_iter >= 20 and runner.iter % 45 == 0 and runner.iter < 40 * 45
    assert runner.max_iters == runner.iter
    assert all(i < n <= 40 * 45 for i, n, _, _ in recorder.seen) and recorder.seen[0][1] == 40 * 45
