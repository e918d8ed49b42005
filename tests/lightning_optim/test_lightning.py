"""lightning_optim: our optimizers in Lightning 2.6, AdaScaleCallback and the AdaScale strategies
against hand-written loops on the same micro-batches."""

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry

import fused_optim
import lightning_optim
from adascale_loops import micro_batch, model_and_groups
from fused_optim import AdaScale
from fused_optim.metrics import GAIN, LR, TAU
from fused_optim.process_group import end_process_group

FAST = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0)


class MicroBatches(torch.utils.data.Dataset):
    """Item i is micro-batch i (4 samples), so a window's micro-batches are the same items in a
    single process and across DDP ranks (DistributedSampler deals items round-robin)."""

    def __init__(self, n: int, inf_at: int | None = None):
        self.n, self.inf_at = n, inf_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = micro_batch(0, i)
        return x, y, torch.tensor(float("inf") if i == self.inf_at else 1.0)


def loader(n: int, inf_at: int | None = None):
    return torch.utils.data.DataLoader(MicroBatches(n, inf_at), batch_size=None)


class Regressor(pl.LightningModule):
    """``make_optim(params)`` returns what configure_optimizers returns (None: LightningCLI's)."""

    def __init__(self, make_optim=None):
        super().__init__()
        self.net = model_and_groups(two_groups=False)[0]
        self.make_optim = make_optim

    def training_step(self, batch, batch_idx):
        x, y, factor = batch
        return torch.nn.functional.mse_loss(self.net(x), y) * factor

    def configure_optimizers(self):
        return self.make_optim(self.net.parameters())


class DealtRegressor(Regressor):
    """Deals micro-batch items round-robin to the ranks, in order (Lightning's own sampler
    shuffles this loader): run with ``use_distributed_sampler=False``."""

    def __init__(self, make_optim, items: int):
        super().__init__(make_optim)
        self.items = items

    def train_dataloader(self):
        data = MicroBatches(self.items)
        sampler = torch.utils.data.DistributedSampler(data, self.trainer.world_size, self.global_rank, shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)


class CliRegressor(Regressor):
    def __init__(self):
        super().__init__()

    def train_dataloader(self):
        return loader(8)


class Trace(Callback):
    """After every optimizer step: (gain, τ, lr of group 0) of the AdaScale the trainer holds."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        if len(self.steps) < trainer.global_step:
            self.steps.append((opt.gain(), opt.scale_invariant_steps, opt.param_groups[0]["lr"]))


class EndProcessGroup(Callback):
    """A spawned rank ends its gloo group before its Python exits (see fused_optim/process_group.py)."""

    def teardown(self, trainer, pl_module, stage):
        end_process_group()


class SpyLogger(Logger):
    """Every ``log_metrics`` call, as ``(step, metrics)``."""

    name, version = "spy", 0

    def __init__(self):
        super().__init__()
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def series(self, key):
        """[(step, value)] of ``key``, one entry per call that logged it."""
        return [(step, float(m[key])) for step, m in self.calls if key in m]


class AppliedLr(Callback):
    """Per update: (group 0's scheduled lr just before the step, the gain the step applied = Δτ)."""

    def __init__(self):
        self.base, self.gains, self._tau = [], [], 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.base.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tau = trainer.optimizers[0].scale_invariant_steps
        if len(self.gains) < len(self.base):
            self.gains.append(tau - self._tau)
            self._tau = tau


def sgd(params):
    return fused_optim.FusedSGD(params, lr=0.1, momentum=0.9)


def hand_loop(windows: list[list[int]], accum: int, make_inner=sgd):
    """fused_optim.AdaScale by hand: window k runs the micro-batches ``windows[k]`` (losses /
    accum). Returns params and (gain, τ) after every step."""
    model = model_and_groups(two_groups=False)[0]
    opt = AdaScale(make_inner(model.parameters()), world_size=1, num_gradients_to_accumulate=accum)
    trace = []
    for items in windows:
        for item in items:
            x, y = micro_batch(0, item)
            (torch.nn.functional.mse_loss(model(x), y) / accum).backward()
        opt.step()
        opt.zero_grad()
        trace.append((opt.gain(), opt.scale_invariant_steps))
    return [p.detach().clone() for p in model.parameters()], trace


def assert_params_close(module, params):
    for p, q in zip(module.net.parameters(), params):
        torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)


# ---- our optimizers without an adapter ----------------------------------------------------------
@pytest.mark.parametrize("form", ["optimizer", "dict", "lists"])
def test_fused_optimizers_from_configure_optimizers_equal_torch(form):
    def returns(cls):
        def make(params):
            opt = cls(params, lr=0.1, momentum=0.9, nesterov=True)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}} if form == "dict" \
                else ([opt], [sched]) if form == "lists" else opt
        return make

    trained = {}
    for cls in (fused_optim.FusedSGD, torch.optim.SGD):
        module = Regressor(returns(cls))
        pl.Trainer(max_epochs=2, **FAST).fit(module, loader(6))
        trained[cls] = [p.detach() for p in module.net.parameters()]
    for p, q in zip(*trained.values()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("cls, option, value, state", [
    (fused_optim.FusedLAMB, "max_grad_norm", 0.5, "step"), (fused_optim.Lion, "weight_decay", 0.1, "exp_avg"),
    (fused_optim.Adagrad, "lr_decay", 0.1, "sum")], ids=["lamb", "lion", "adagrad"])
def test_lightning_cli_takes_our_optimizer_by_class_path(cls, option, value, state):
    cli = LightningCLI(CliRegressor, run=True, save_config_callback=None, args=[
        "fit", "--optimizer", f"fused_optim.{cls.__name__}", "--optimizer.lr", "0.01", f"--optimizer.{option}",
        str(value), "--trainer.max_steps", "3", *[f"--trainer.{k}={v}" for k, v in FAST.items()]])
    opt = cli.trainer.optimizers[0]
    assert type(opt) is cls and opt.defaults["lr"] == 0.01 and opt.defaults[option] == value
    assert cli.trainer.global_step == 3 and opt.implementation == "fused"
    assert all(state in s for s in opt.state.values()) and len(opt.state) == len(list(cli.model.parameters()))
    if "step" in next(iter(opt.state.values())):
        assert all(int(s["step"]) == 3 for s in opt.state.values())


@pytest.mark.slow
def test_step_scheduler_cli_schedule_from_the_command_line_follows_floor_tau():
    """``--lr_scheduler`` becomes an ``interval="step"`` scheduler, so AdaScaleCallback drives it."""
    cli = lightning_optim.StepSchedulerCLI(CliRegressor, run=True, save_config_callback=None, args=[
        "fit", "--optimizer", "fused_optim.FusedSGD", "--optimizer.lr", "0.1",
        "--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "2", "--lr_scheduler.gamma", "0.5",
        "--trainer.callbacks+=lightning_optim.AdaScaleCallback", "--trainer.accumulate_grad_batches", "2",
        "--trainer.max_epochs", "2", *[f"--trainer.{k}={v}" for k, v in FAST.items()]])
    trainer = cli.trainer
    tau, (config,) = trainer.optimizers[0].scale_invariant_steps, trainer.lr_scheduler_configs
    assert trainer.global_step == 8 and tau > 8  # gains > 1
    assert config.scheduler.last_epoch == math.floor(tau)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (math.floor(tau) // 2), rel=1e-12)


# ---- AdaScaleCallback, one process ---------------------------------------------------------------
@pytest.mark.parametrize("returns_adascale", [False, True], ids=["wraps-plain", "module-returns-adascale"])
def test_callback_accumulating_4_equals_the_hand_loop_with_short_last_windows(returns_adascale):
    """10 micro-batches per epoch, accumulation 4: windows of 4, 4 and a short 2, twice."""

    def make(params):
        return AdaScale(sgd(params), world_size=1, num_gradients_to_accumulate=3) if returns_adascale else sgd(params)

    module, trace = Regressor(make), Trace()
    trainer = pl.Trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[lightning_optim.AdaScaleCallback(), trace],
                         **FAST)
    trainer.fit(module, loader(10))
    params, want = hand_loop([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] * 2, 4)
    opt = trainer.optimizers[0]
    assert isinstance(opt, AdaScale) and opt.num_gradients_to_accumulate == 4 and opt.scale == 4.0
    assert [x for g, t, _ in trace.steps for x in (g, t)] == pytest.approx([x for w in want for x in w], rel=1e-9)
    assert_params_close(module, params)
    assert want[-1][0] > 1.0
    assert {GAIN, TAU} <= set(trainer.progress_bar_metrics)
    last_gain = want[-1][1] - want[-2][1]  # what the short last window applied (its scale is S·2/4)
    assert trainer.callback_metrics[LR].item() == pytest.approx(0.1 * last_gain, rel=1e-6)


def test_callback_logs_once_per_update_and_nothing_with_log_false():
    """10 micro-batches, accumulation 4: updates after micro-batches 4, 8 and 10 (steps 0, 1, 2)."""
    logged = {}
    for log in (True, False):
        spy = SpyLogger()
        trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=4, log_every_n_steps=1,
                             callbacks=[lightning_optim.AdaScaleCallback(log=log)], **{**FAST, "logger": spy})
        trainer.fit(Regressor(sgd), loader(10))
        logged[log] = spy
        assert (GAIN in trainer.callback_metrics) is log
    _, want = hand_loop([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], 4)
    taus = [t for _, t in want]
    gains = [b - a for a, b in zip([0.0] + taus, taus)]
    # Lightning logs float32 tensors: a relative rounding of 2**-24 (the hand loop's are doubles)
    assert logged[True].series(TAU) == [(k, pytest.approx(t, rel=1e-6)) for k, t in enumerate(taus)]
    assert logged[True].series(GAIN) == [(k, pytest.approx(g, rel=1e-6)) for k, g in enumerate(gains)]
    assert logged[True].series(LR) == [(k, pytest.approx(0.1 * g, rel=1e-6)) for k, g in enumerate(gains)]
    assert not [m for _, m in logged[False].calls if set(m) & {GAIN, TAU, LR}]


@pytest.mark.parametrize("returns, series", [("sgd", "lr-FusedSGD"), ("sgd+scheduler", "lr-FusedSGD"),
                                             ("adascale+scheduler", "lr-AdaScale")])
@pytest.mark.parametrize("logging_interval", [None, "step"])
def test_learning_rate_monitor_keeps_its_series_and_shows_the_applied_lr(returns, series, logging_interval):
    """LearningRateMonitor's series keeps the name it has without the callback (after the optimizer
    the module returned, or its scheduler's) and holds, per update, the lr that update applied:
    the scheduled lr × its gain."""
    scheduled = returns.endswith("scheduler")

    def make(params):
        opt = sgd(params)
        if returns.startswith("adascale"):
            opt = AdaScale(opt, world_size=1, num_gradients_to_accumulate=2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}} if scheduled else opt

    spy, applied = SpyLogger(), AppliedLr()
    monitor = LearningRateMonitor(logging_interval=logging_interval)
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=2, log_every_n_steps=1,
                         callbacks=[monitor, lightning_optim.AdaScaleCallback(), applied], **{**FAST, "logger": spy})
    trainer.fit(Regressor(make), loader(12))
    lr_keys = {k for _, m in spy.calls for k in m if k.startswith("lr-")}
    assert lr_keys == {series}
    want = [b * g for b, g in zip(applied.base, applied.gains)]
    assert len(want) == 6 and max(applied.gains) > 1.0
    if scheduled:  # the schedule follows ⌊τ⌋: the base lr halves at τ = 2, 4, ...
        assert min(applied.base) < 0.1
    # logged as float32 (relative rounding 2**-24); the monitor's own record holds the doubles, and
    # Δτ differs from the gain the step multiplied by only τ's rounding (τ·2**-53)
    assert spy.series(series) == [(k, pytest.approx(lr, rel=1e-6)) for k, lr in enumerate(want)]
    assert set(monitor.lrs) == {series} and monitor.lrs[series] == pytest.approx(want, rel=1e-12)


def test_callback_follows_a_gradient_accumulation_scheduler():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    module, trace = Regressor(sgd), Trace()
    trainer = pl.Trainer(max_epochs=2, callbacks=[GradientAccumulationScheduler({0: 2, 1: 4}),
                                                  lightning_optim.AdaScaleCallback(), trace], **FAST)
    trainer.fit(module, loader(8))
    params, want = hand_loop([[0, 1], [2, 3], [4, 5], [6, 7]], 2)  # epoch 0 by hand ...
    assert [t for _, t, _ in trace.steps[:4]] == pytest.approx([t for _, t in want], rel=1e-9)
    opt = trainer.optimizers[0]
    assert len(trace.steps) == 6 and (opt.num_gradients_to_accumulate, opt.scale) == (4, 4.0)  # ... epoch 1 by 4


def test_callback_refuses_a_single_device_without_accumulation():
    trainer = pl.Trainer(max_steps=1, callbacks=[lightning_optim.AdaScaleCallback()], **FAST)
    with pytest.raises(RuntimeError, match="accumulate_grad_batches"):
        trainer.fit(Regressor(sgd), loader(4))


def test_schedule_follows_floor_tau_and_training_stops_at_the_tau_target():
    budget, target = 40, 15.0

    def make(params):
        opt = sgd(params)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=budget)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module, trace = Regressor(make), Trace()
    trainer = pl.Trainer(max_epochs=-1, accumulate_grad_batches=2, callbacks=[
        lightning_optim.AdaScaleCallback(tau_target=target), trace], **FAST)
    trainer.fit(module, loader(8))
    taus = [t for _, t, _ in trace.steps]
    first = next(i for i, t in enumerate(taus) if t >= target)
    assert trainer.global_step == first + 1 == len(taus) and taus[-2] < target <= taus[-1]
    assert len(taus) < target  # gains > 1: fewer steps than the τ budget
    for _, tau, lr in trace.steps:
        assert lr == pytest.approx(0.05 * (1 + math.cos(math.pi * math.floor(tau) / budget)), rel=1e-9)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == math.floor(taus[-1])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed-cpu-scaler"])
def test_precisions_and_an_overflow_step_skipped_without_harm(precision):
    kw = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision.startswith("16") else {"precision": precision}
    overflow_item = 5 if precision.startswith("16") else None  # in the third window
    module, trace = Regressor(sgd), Trace()
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=2,
                         callbacks=[lightning_optim.AdaScaleCallback(), trace], **kw, **FAST)
    trainer.fit(module, loader(12, inf_at=overflow_item))
    gains, taus = [g for g, _, _ in trace.steps], [t for _, t, _ in trace.steps]
    assert len(taus) == 6 and all(math.isfinite(g) and g >= 1.0 for g in gains)
    assert all(torch.isfinite(p).all() for p in module.net.parameters())
    if overflow_item is None:
        assert all(b > a for a, b in zip([0.0] + taus, taus))
    else:  # the overflow step adds nothing to τ and leaves the statistics; the others count
        assert taus[2] == taus[1] and gains[2] == gains[1]
        assert all(b > a for i, (a, b) in enumerate(zip([0.0] + taus, taus)) if i != 2)


def test_clipping_under_16_mixed_is_refused_with_a_hint():
    """Our optimizers (and AdaScale) unscale inside the step, so Lightning cannot clip before it."""
    trainer = pl.Trainer(max_steps=1, accumulate_grad_batches=2, gradient_clip_val=1.0,
                         plugins=[MixedPrecision("16-mixed", "cpu")], callbacks=[lightning_optim.AdaScaleCallback()],
                         **FAST)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping.*HINT"):
        trainer.fit(Regressor(sgd), loader(4))


def test_checkpoint_resume_continues_identically(tmp_path):
    def make(params):
        opt = sgd(params)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def fit(epochs, ckpt_path=None, **kw):
        module, trace = Regressor(make), Trace()
        trainer = pl.Trainer(max_epochs=epochs, accumulate_grad_batches=2,
                             callbacks=[lightning_optim.AdaScaleCallback(), trace], **{**FAST, **kw})
        trainer.fit(module, loader(8), ckpt_path=ckpt_path)
        return module, trainer

    whole, whole_trainer = fit(3)
    fit(1, enable_checkpointing=True, default_root_dir=tmp_path)
    (ckpt,) = tmp_path.rglob("*.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    assert saved["callbacks"]["AdaScaleCallback"]["scale_invariant_steps"] > 4.0
    resumed, resumed_trainer = fit(3, ckpt_path=str(ckpt))
    opt, ref = resumed_trainer.optimizers[0], whole_trainer.optimizers[0]
    assert opt.scale_invariant_steps == pytest.approx(ref.scale_invariant_steps, rel=1e-12)
    assert resumed_trainer.lr_scheduler_configs[0].scheduler.last_epoch == math.floor(ref.scale_invariant_steps)
    for p, q in zip(resumed.net.parameters(), whole.net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"],
                                   rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"], rel=1e-12)


# ---- strategies and DDP ------------------------------------------------------------------------
def test_strategies_are_registered_with_their_options():
    assert {"adascale_ddp", "adascale_ddp_spawn"} <= set(StrategyRegistry.available_strategies())
    StrategyRegistry.register("adascale_ddp_scale8", lightning_optim.AdaScaleDDPStrategy, start_method="spawn",
                              scale=8.0, override=True)
    strategy = StrategyRegistry.get("adascale_ddp_scale8")
    assert isinstance(strategy, lightning_optim.AdaScaleDDPStrategy) and strategy.adascale_kwargs["scale"] == 8.0
    trainer = pl.Trainer(strategy="adascale_ddp_spawn", devices=2, **FAST)
    assert isinstance(trainer.strategy, lightning_optim.AdaScaleDDPStrategy)
    assert trainer.strategy._start_method == "spawn"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["adascale_ddp_spawn", "ddp_spawn"])
def test_ddp_spawn_accumulating_2_equals_one_process_accumulating_4(strategy, tmp_path):
    """2 ranks (gloo) × accumulation 2 == 1 process × accumulation 4 on the same micro-batches,
    stopping at the same τ target on both ranks. In float64: the two pool the micro-batch
    gradients in different orders (an all-reduce, an accumulation), which in float64 differ by
    ~1e-16 relative, and stay far below 1e-9 over the few steps to τ = 6 (in float32 they would
    depend on the CPU's reduction order)."""
    target = 6.0

    def run(devices, accum, strategy):
        module = DealtRegressor(sgd, items=16)
        trainer = pl.Trainer(max_epochs=-1, devices=devices, accumulate_grad_batches=accum, strategy=strategy,
                             precision="64-true",
                             use_distributed_sampler=False,
                             callbacks=[lightning_optim.AdaScaleCallback(tau_target=target), EndProcessGroup()],
                             **{**FAST, "logger": True, "default_root_dir": tmp_path})
        trainer.fit(module)
        return module, {k: float(v) for k, v in trainer.callback_metrics.items()}

    single, single_metrics = run(1, 4, "auto")
    ddp, ddp_metrics = run(2, 2, strategy)  # spawn: rank 0's weights and metrics come back
    assert single_metrics["adascale/tau"] >= target
    assert ddp_metrics == pytest.approx(single_metrics, rel=1e-9)
    # The spawned run's weights come back into this process's float32 module: one rounding to fp32.
    for p, q in zip(ddp.net.parameters(), single.net.parameters()):
        torch.testing.assert_close(p.double(), q.double(), rtol=2**-24 + 1e-9, atol=1e-9)
