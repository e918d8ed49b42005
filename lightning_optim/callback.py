"""``AdaScaleCallback``: AdaScale, scale-invariant schedules and a τ target for any LightningModule."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from fused_optim import AdaScale
from fused_optim.adascale import inner_optimizer
from fused_optim.metrics import GAIN, LR, TAU

from ._compat import hand_over_scheduler, is_handed_over
from .lr_monitor import AppliedLrSeries
from .wrapping import as_adascale


class AdaScaleCallback(Callback):
    """Train with AdaScale whether the module returns an :class:`fused_optim.AdaScale` or a plain
    optimizer (then it is wrapped at ``on_fit_start``; the wrapper shares its ``param_groups``, so
    schedulers bound to it stay valid).

    * AdaScale's accumulation count follows ``trainer.accumulate_grad_batches`` (also when a
      ``GradientAccumulationScheduler`` changes it) and its world size the trainer's data-parallel
      replicas (:func:`replicas`: under ``ModelParallelStrategy`` its ``data_parallel`` mesh
      dimension; tensor-parallel and FSDP2 params are measured whole, the LightningModule passed as
      ``module``, see :class:`fused_optim.AdaScale`).
    * τ (``scale_invariant_steps``, Σ gain over real updates; an AMP-skipped step adds nothing)
      drives the schedules: with ``follow_tau`` every ``interval="step"`` scheduler is stepped by
      this callback only, after each batch, until ``scheduler.last_epoch == ⌊τ⌋`` — so a schedule
      over a budget of T steps, e.g. ``CosineAnnealingLR(opt, T_max=T)``, gives at every step the
      lr of step ⌊τ⌋ (``frequency`` is ignored for them).
    * ``tau_target``: training stops after the first step where τ ≥ target (all ranks agree).
    * Logs ``adascale/gain`` (the gain the update applied), ``adascale/tau`` and ``adascale/lr``
      (the lr the update applied to group 0: its scheduled lr × gain) once per optimizer update
      (AMP-skipped ones excepted), to the logger and (``prog_bar``) the progress bar.
    * :attr:`applied_gain`: the gain of the update this batch applied, for other callbacks and the
      module, in their ``on_train_batch_end`` whatever the order of the callbacks.
    * A scheduler stepped per epoch (``interval="epoch"``, LightningCLI's ``--lr_scheduler``) does
      not follow τ: a warning at fit start names the fix.
    * A ``LearningRateMonitor`` keeps its series names (``lr-<the module's optimizer class>``, not
      ``lr-AdaScale``), and each series shows, once per update, the lr that update applied
      (scheduled lr × gain; the gain is known only after the window's last backward, so the
      monitor's own read at the batch start would show the scheduled lr): see
      :mod:`lightning_optim.lr_monitor`.
    * Its state (τ at save time, the target) is in Lightning checkpoints; AdaScale's statistics
      are in the optimizer state. Lightning does not save gradients, so a window in progress at a
      checkpoint is dropped on resume (the rest of it counts as a short window).

    Example (runs as is)::

        import lightning.pytorch as pl, torch, fused_optim
        from lightning_optim import AdaScaleCallback

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                opt = fused_optim.FusedSGD(self.parameters(), lr=0.1, momentum=0.9)
                sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)  # a τ budget of 100
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        x = torch.randn(512, 8)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) + torch.randn(512, 1))
        trainer = pl.Trainer(accumulate_grad_batches=4, max_epochs=-1, logger=False, enable_checkpointing=False,
                             callbacks=[AdaScaleCallback(tau_target=100)])
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))

    Args:
        scale, smoothing, is_scaled_loss, debias_ewma: for the AdaScale it creates.
        tau_target: stop once τ reaches it (None: no stop).
        follow_tau: drive step-interval schedulers by ⌊τ⌋.
        log, prog_bar: log gain, τ and the applied lr (and show the first two in the progress bar).
    """

    def __init__(self, scale: float | None = None, smoothing: float | None = None, is_scaled_loss: bool = True,
                 debias_ewma: bool = True, tau_target: float | None = None, follow_tau: bool = True,
                 log: bool = True, prog_bar: bool = True):
        if tau_target is not None and not tau_target > 0:
            raise ValueError(f"Invalid tau_target: {tau_target} (a positive number of scale-invariant steps, or None)")
        self.adascale_kwargs = dict(scale=scale, smoothing=smoothing, is_scaled_loss=is_scaled_loss,
                                    debias_ewma=debias_ewma)
        self.tau_target = tau_target
        self.follow_tau = follow_tau
        # Not ``self.log``: Lightning sets ``callback.log = module.log`` on every callback at fit start.
        self.log_adascale = log
        self.prog_bar = prog_bar
        self._tau = 0.0  # as of the last batch: what a checkpoint saves
        self._restored_tau: float | None = None
        self._applied_lrs: list[float] | None = None  # each group's lr in the last inner step
        self._tau_at_batch_start = 0.0
        self._wrapped: AdaScale | None = None  # during a fit
        self._step_hook = None
        self._lr_series: AppliedLrSeries | None = None

    # ---- setup -------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, (DeepSpeedStrategy, FSDPStrategy)):
            raise RuntimeError(f"AdaScaleCallback does not work with {type(strategy).__name__}: that strategy owns "
                               "the optimizer; use DDP (strategy='ddp' or 'adascale_ddp') or a single device")
        if not pl_module.automatic_optimization or len(strategy.optimizers) != 1:
            raise RuntimeError("AdaScaleCallback needs automatic optimization with exactly one optimizer; with manual "
                               "optimization wrap your optimizer in fused_optim.AdaScale yourself")
        inner = inner_optimizer(strategy.optimizers[0])
        strategy.optimizers = [as_adascale(strategy.optimizers[0], replicas(trainer), _accumulation(trainer),
                                           module=pl_module, **self.adascale_kwargs)]
        self._wrapped = strategy.optimizers[0]
        self._step_hook = inner.register_step_post_hook(self._record_applied_lrs)
        self._lr_series = AppliedLrSeries(trainer, strategy.optimizers[0], inner)
        if self.follow_tau:
            for config in trainer.lr_scheduler_configs:
                if config.interval == "step":
                    hand_over_scheduler(config)  # from now on only this callback steps it (to ⌊τ⌋)
                elif not (config.reduce_on_plateau or is_handed_over(config)):
                    _warn_epoch_scheduler(config)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        opt = self._adascale(trainer)
        opt.zero_grad()  # a window restored from a checkpoint has lost its gradients: start afresh
        if self._restored_tau is not None and opt.scale_invariant_steps == 0.0:
            opt.scale_invariant_steps = self._restored_tau  # the optimizer state came without AdaScale's
        self._tau = opt.scale_invariant_steps
        self._lr_series.start(trainer)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        opt, accumulate = self._adascale(trainer), _accumulation(trainer)
        if opt.num_gradients_to_accumulate != accumulate:
            as_adascale(opt, replicas(trainer), accumulate)
        self._applied_lrs = None
        self._tau_at_batch_start = opt.scale_invariant_steps

    @property
    def applied_gain(self) -> float | None:
        """The gain of the update applied in the current batch (Δτ: the lr multiplier of that
        update, summed over the param groups as in τ), or None if this batch applied no update (a
        micro-batch inside an accumulation window, an AMP-skipped step). Set inside the optimizer
        step, so it is the same in every callback's (and the module's) ``on_train_batch_end``,
        listed before or after this callback; it holds until the next batch starts. The value
        logged as ``adascale/gain``."""
        if self._applied_lrs is None or self._wrapped is None:
            return None
        return self._wrapped.scale_invariant_steps - self._tau_at_batch_start

    # ---- after each batch: schedules, stop, logs -----------------------------------------------
    def _record_applied_lrs(self, optimizer, args, kwargs) -> None:
        """Step post-hook of the wrapped optimizer: its lrs are still the scaled ones here (AdaScale
        restores them after the inner step), and it runs only for updates actually applied."""
        self._applied_lrs = [group["lr"] for group in optimizer.param_groups]

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = self._adascale(trainer)
        tau = self._tau = opt.scale_invariant_steps
        for config in trainer.lr_scheduler_configs:
            if is_handed_over(config):
                while config.scheduler.last_epoch < math.floor(tau):
                    pl_module.lr_scheduler_step(config.scheduler, None)
        if self.tau_target is not None:
            reached = trainer.strategy.reduce_boolean_decision(tau >= self.tau_target, all=False)
            trainer.should_stop = trainer.should_stop or reached
        if self._applied_lrs is not None:  # this batch updated the params
            self._log_update(pl_module, self.applied_gain, tau, self._applied_lrs)

    def _log_update(self, pl_module, gain: float, tau: float, applied_lrs: list[float]) -> None:
        """The AdaScale metrics (if ``log``) and the LearningRateMonitor series of this update."""
        if self.log_adascale:
            for name, value in ((GAIN, gain), (TAU, tau), (LR, applied_lrs[0])):
                pl_module.log(name, value, prog_bar=self.prog_bar and name != LR, on_step=True, on_epoch=False,
                              batch_size=1)
        self._lr_series.log(pl_module, applied_lrs)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._lr_series.detach()
            self._step_hook = self._lr_series = self._wrapped = None

    # ---- checkpoints ---------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"scale_invariant_steps": self._tau, "tau_target": self.tau_target}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_tau = float(state_dict["scale_invariant_steps"])

    @staticmethod
    def _adascale(trainer) -> AdaScale:
        return trainer.strategy.optimizers[0]


def _warn_epoch_scheduler(config) -> None:
    """The warning for a scheduler that the trainer steps per epoch (not by τ)."""
    name = config.name or type(config.scheduler).__name__
    rank_zero_warn(f"AdaScaleCallback: the lr scheduler {name} steps per {config.interval}, not by τ (the "
                   "scale-invariant steps), so its schedule ignores the gain. For a τ-driven schedule return "
                   '{"scheduler": scheduler, "interval": "step"} from configure_optimizers, with the schedule\'s '
                   "length in steps (e.g. T_max=1000), or use lightning_optim.StepSchedulerCLI in place of "
                   "LightningCLI; to keep it per epoch, pass AdaScaleCallback(follow_tau=False)", category=UserWarning)


def replicas(trainer) -> int:
    """The data-parallel replicas whose micro-batches an update pools (AdaScale's and NoiseScale's N):
    the world size, or under ``ModelParallelStrategy`` the size of its mesh's ``data_parallel``
    dimension (the ranks of a ``tensor_parallel`` row hold one replica and see the same batches)."""
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        return strategy.device_mesh["data_parallel"].size()
    return trainer.world_size


def _accumulation(trainer) -> int:
    """The accumulation count of the current epoch (a GradientAccumulationScheduler sets
    ``trainer.accumulate_grad_batches`` only when the epoch starts, after ``on_fit_start``)."""
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler):
            return callback.get_accumulate_grad_batches(trainer.current_epoch)
    return trainer.accumulate_grad_batches
