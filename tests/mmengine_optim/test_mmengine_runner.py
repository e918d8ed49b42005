"""mmengine_optim through mmengine's Runner: every config trains, schedules count updates (⌊τ⌋
with AdaScale), τ-target stop with a checkpoint, resume under weights_only, clear config errors."""

import itertools
import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

import fused_optim
from fused_optim.metrics import GAIN, LR, TAU
from mmengine_optim.train import main

# Every test builds an mmengine Runner, whose environment report starts the compiler (its version).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.py"))
FRAGMENTS = sorted((ROOT / "configs" / "_base_").rglob("*.py"))
BASELINE = ROOT / "configs" / "digits_fused_sgd.py"
ADASCALE = ROOT / "configs" / "digits_fused_sgd_adascale.py"
_runs = itertools.count()


def train(config, work_dir, *options, resume=None):
    """``python -m mmengine_optim.train`` in this process; quiet logs, no validation unless asked."""
    argv = [str(config), "--work-dir", str(work_dir), "--cfg-options", f"experiment_name=run{next(_runs)}",
            "log_level=WARNING", "train_cfg.val_interval=1000", *options]
    return main(argv + (["--resume", str(resume)] if resume else []))


def params(runner):
    return [p.detach().clone() for p in runner.model.parameters()]


def test_the_configs_are_there():
    assert {p.name for p in CONFIGS} >= {"digits_fused_sgd.py", "digits_fused_sgd_adascale.py",
                                         "digits_fused_lamb_amp.py", "digits_adamw_paramwise.py"}
    names = {p.stem for p in (ROOT / "configs" / "_base_" / "optimizers").glob("*.py")}
    classes = {fused_optim.registry.get_spec(n).cls for n in fused_optim.list_optimizers()}
    built = {Config.fromfile(ROOT / "configs/_base_/optimizers" / f"{n}.py").optimizer.type for n in names}
    assert {c.__name__ for c in classes} == {t.split(".")[-1] for t in built}  # a fragment per optimizer class


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_trains(config, tmp_path):
    cfg = Config.fromfile(config)
    accum = cfg.optim_wrapper.get("accumulative_counts", 1)
    runner = train(config, tmp_path, f"train_cfg.max_iters={4 * accum}", "train_cfg.val_interval=2")
    assert runner.iter == 4 * accum
    assert all(torch.isfinite(p).all() for p in params(runner))
    scalars = runner.message_hub.log_scalars
    assert math.isfinite(scalars["val/digits/loss"].current()) and 0 <= scalars["val/digits/accuracy"].current() <= 100


@pytest.mark.parametrize("fragment", sorted((ROOT / "configs/_base_/optimizers").glob("*.py")), ids=lambda p: p.stem)
def test_every_optimizer_fragment_trains(fragment, tmp_path):
    cfg = Config.fromfile(BASELINE)
    cfg.optim_wrapper.optimizer = Config.fromfile(fragment).optimizer
    cfg.dump(tmp_path / "config.py")
    runner = train(tmp_path / "config.py", tmp_path, "train_cfg.max_iters=4")
    assert type(runner.optim_wrapper.optimizer).__name__ == cfg.optim_wrapper.optimizer.type.split(".")[-1]
    assert runner.optim_wrapper.optimizer.implementation == "fused"
    assert all(torch.isfinite(p).all() for p in params(runner))


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_fragment_loads(fragment):
    assert Config.fromfile(fragment).to_dict()


def test_schedulers_step_once_per_update(tmp_path):
    """accumulative_counts=2, 10 micro-batches = 5 updates; MultiStepLR milestones at updates 2, 4."""
    runner = train(BASELINE, tmp_path, "optim_wrapper.accumulative_counts=2", "train_cfg.max_iters=10",
                   "param_scheduler.0.milestones=[2,4]")
    (scheduler,) = runner.param_schedulers
    assert scheduler._global_step == 5
    assert runner.optim_wrapper.get_lr()["lr"] == [pytest.approx(0.1 * 0.1**2)]


def test_schedulers_follow_tau_with_adascale_and_stop_at_the_target(tmp_path):
    runner = train(ADASCALE, tmp_path, "default_hooks.param_scheduler.max_scale_invariant_iters=9",
                   "param_scheduler.0.milestones=[3,6]")
    tau = runner.optim_wrapper.scale_invariant_iter
    (scheduler,) = runner.param_schedulers
    updates = runner.iter // 4
    assert 9 <= tau < 9 + 4 and updates < tau  # gains > 1: fewer updates than τ
    assert scheduler._global_step == math.floor(tau)
    assert runner.optim_wrapper.get_lr()["lr"] == [pytest.approx(0.1 * 0.1**2)]
    assert runner.iter % 4 == 0 and runner.iter < 1600  # stopped early, after an update
    saved = tmp_path / f"iter_{runner.iter}.pth"
    assert (tmp_path / "last_checkpoint").read_text().strip() == str(saved)
    checkpoint = torch.load(saved)  # weights_only (torch's default)
    assert checkpoint["optimizer"]["adascale"]["scale_invariant_steps"] == tau


def test_adascale_metrics_reach_the_loggers_under_the_shared_names(tmp_path):
    """The message hub's ``train/adascale/...`` scalars reach the visualizer's scalars.json (and the
    text log) as ``adascale/gain``, ``adascale/tau``, ``adascale/lr``, every logger interval."""
    runner = train(ADASCALE, tmp_path, "train_cfg.max_iters=16", "default_hooks.logger.interval=2",
                   "log_level=INFO")
    (scalars,) = tmp_path.rglob("vis_data/scalars.json")
    records = [json.loads(line) for line in scalars.read_text().splitlines()]
    logged = [r for r in records if GAIN in r]
    assert [r["iter"] for r in logged] == list(range(4, 17, 2))  # the first update is at iteration 4
    assert all({TAU, LR} <= set(r) for r in logged)
    assert logged[-1][TAU] == runner.optim_wrapper.scale_invariant_iter  # the last update is at iteration 16
    (text_log,) = tmp_path.rglob("*.log")
    assert f"{GAIN}: " in text_log.read_text()


@pytest.mark.parametrize("hook", ["ParamSchedulerHook", "mmengine_optim.UpdateParamSchedulerHook"])
def test_adascale_with_mmengines_scheduler_hook_warns_once_naming_ours(hook, tmp_path):
    """mmengine's hook (an mmpretrain-style runtime's) steps iteration schedules per micro-batch."""
    cfg = Config.fromfile(ADASCALE)
    cfg.default_hooks.param_scheduler = dict(type=hook)
    cfg.dump(tmp_path / "config.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path / "config.py", tmp_path, "train_cfg.max_iters=8")
    ours = [w for w in caught if "UpdateParamSchedulerHook" in str(w.message)]
    assert len(ours) == (1 if hook == "ParamSchedulerHook" else 0)
    if ours:
        assert "micro-batch" in str(ours[0].message) and "mmengine_optim.UpdateParamSchedulerHook" in str(ours[0].message)


def test_resume_continues_identically_under_weights_only(tmp_path):
    assert os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") is None
    options = ["train_cfg.max_iters=24", "default_hooks.checkpoint.interval=12",
               "default_hooks.param_scheduler.max_scale_invariant_iters=None", "param_scheduler.0.milestones=[5,9]"]
    whole = train(ADASCALE, tmp_path / "whole", *options)
    resumed = train(ADASCALE, tmp_path / "resumed", *options, resume=tmp_path / "whole" / "iter_12.pth")
    assert resumed.optim_wrapper.scale_invariant_iter == whole.optim_wrapper.scale_invariant_iter
    for a, b in zip(params(resumed), params(whole)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    end_whole, end_resumed = (torch.load(tmp_path / d / "iter_24.pth") for d in ("whole", "resumed"))
    torch.testing.assert_close(end_resumed["optimizer"], end_whole["optimizer"], rtol=0, atol=0)
    assert end_resumed["param_schedulers"] == end_whole["param_schedulers"]


def test_unknown_optimizer_name_is_a_registry_error(tmp_path):
    with pytest.raises(KeyError, match="FusedSGDD is not in the mmengine_optim::optimizer registry"):
        train(BASELINE, tmp_path, "optim_wrapper.optimizer.type=mmengine_optim.FusedSGDD")


def test_wrong_optimizer_argument_names_the_key(tmp_path):
    with pytest.raises(TypeError, match="FusedSGD.*unexpected keyword argument 'lrr'"):
        train(BASELINE, tmp_path, "optim_wrapper.optimizer.lrr=0.1")


def test_bad_optimizer_value_is_the_optimizer_error(tmp_path):
    with pytest.raises(ValueError, match="Invalid learning rate: -0.1"):
        train(BASELINE, tmp_path, "optim_wrapper.optimizer.lr=-0.1")


def test_a_tau_target_without_adascale_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_scale_invariant_iters=5.*AdaScaleOptimWrapper"):
        train(BASELINE, tmp_path, "default_hooks.param_scheduler.max_scale_invariant_iters=5")


def test_a_half_model_with_master_weights_trains_and_resumes_exactly(tmp_path):
    """configs/digits_fused_adam_fp16_master.py: fp16 params, fp32 masters and moments in the
    optimizer state (also in the checkpoint), a dynamic loss scale; resumed at iter 6, iter 12
    equals the uninterrupted run bit for bit."""
    config = ROOT / "configs" / "digits_fused_adam_fp16_master.py"
    options = ["train_cfg.max_iters=12", "default_hooks.checkpoint.interval=6"]
    whole = train(config, tmp_path / "whole", *options)
    resumed = train(config, tmp_path / "resumed", *options, resume=tmp_path / "whole" / "iter_6.pth")
    assert all(p.dtype == torch.float16 for p in params(whole))
    for a, b in zip(params(resumed), params(whole)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    end_whole, end_resumed = (torch.load(tmp_path / d / "iter_12.pth", weights_only=True) for d in ("whole", "resumed"))
    states = end_whole["optimizer"]["state"].values()
    assert all(s["master_param"].dtype == s["exp_avg"].dtype == torch.float32 for s in states)
    torch.testing.assert_close(end_resumed["optimizer"], end_whole["optimizer"], rtol=0, atol=0)


def test_8bit_adamw_state_trains_and_resumes_exactly(tmp_path):
    """configs/digits_adamw_8bit_state.py: the optimizer's state_dtype from the config; the
    checkpoint holds uint8 codes and their fp32 absmaxes; resumed at iter 6, iter 12 equals the
    uninterrupted run bit for bit."""
    config = ROOT / "configs" / "digits_adamw_8bit_state.py"
    options = ["train_cfg.max_iters=12", "default_hooks.checkpoint.interval=6"]
    whole = train(config, tmp_path / "whole", *options)
    resumed = train(config, tmp_path / "resumed", *options, resume=tmp_path / "whole" / "iter_6.pth")
    for a, b in zip(params(resumed), params(whole)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    end_whole, end_resumed = (torch.load(tmp_path / d / "iter_12.pth", weights_only=True) for d in ("whole", "resumed"))
    states = end_whole["optimizer"]["state"].values()
    assert all(s["exp_avg"].dtype == torch.uint8 and s["exp_avg_absmax"].dtype == torch.float32 for s in states)
    assert end_whole["optimizer"]["param_groups"][0]["state_dtype"] == "8bit"
    assert end_resumed["optimizer"]["param_groups"] == end_whole["optimizer"]["param_groups"]
    torch.testing.assert_close(end_resumed["optimizer"]["state"], end_whole["optimizer"]["state"], rtol=0, atol=0)
