"""mmengine hooks: schedules that count optimizer updates (or τ), and checkpoints that load with
``torch.load(weights_only=True)`` anywhere; the checks run when training starts."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from mmengine.hooks import CheckpointHook, Hook, ParamSchedulerHook
from mmengine.logging import HistoryBuffer
from mmengine.runner import EpochBasedTrainLoop
from typing_extensions import override

from ._compat import accumulative_counts, save_checkpoint_now, scheduler_steps, set_max_iters


class UpdateParamSchedulerHook(ParamSchedulerHook):
    r"""mmengine's ``ParamSchedulerHook``, but iteration-based schedulers (``by_epoch=False``)
    count optimizer updates, not micro-batches (mmengine's steps them every iteration, so with
    ``accumulative_counts=c`` a schedule runs c times too fast; mmengine issue #1308).

    After each iteration that updated the params, every iteration-based scheduler is stepped up to
    ``target``: the number of updates, or with an :class:`~mmengine_optim.AdaScaleOptimWrapper`
    ⌊τ⌋ (so milestones, warm-up and ``end`` are in scale-invariant iterations: an update with gain
    g advances the schedule by g). Epoch-based and plateau schedulers are stepped as mmengine does.
    Note that ``convert_to_iter_based=True`` converts epochs with the dataloader's length, i.e. in
    micro-batches: give iteration-based schedules in updates instead.

    Args:
        max_scale_invariant_iters: stop training once τ reaches this (AdaScale only) and save a
            checkpoint of that iteration (mmengine's CheckpointHook saves only at its interval or at
            ``max_iters``). An ``IterBasedTrainLoop`` stops at once; an ``EpochBasedTrainLoop`` at
            the end of the epoch (mmengine's loops read ``stop_training`` there). The loop's length
            (``runner.max_iters``: mmengine's ETA and the log's ``[iter/max_iters]``) then follows
            τ: after each iteration it is the iteration where τ is expected to reach the target at
            the mean gain per iteration so far (:meth:`expected_stop`), never more than the
            configured ``max_iters`` and, until τ is reached, never the current or the next
            iteration (no hook sees a last iteration that is not); then, in an
            ``EpochBasedTrainLoop``, the end of the epoch.
    """

    def __init__(self, max_scale_invariant_iters: float | None = None):
        if max_scale_invariant_iters is not None and not max_scale_invariant_iters > 0:
            raise ValueError(f"Invalid max_scale_invariant_iters: {max_scale_invariant_iters!r} (a number > 0)")
        self.max_scale_invariant_iters = max_scale_invariant_iters

    @override
    def before_train(self, runner) -> None:
        if self.max_scale_invariant_iters is not None and not hasattr(runner.optim_wrapper, "scale_invariant_iter"):
            raise ValueError(
                f"UpdateParamSchedulerHook(max_scale_invariant_iters={self.max_scale_invariant_iters}) needs τ, which "
                f"{type(runner.optim_wrapper).__name__} does not count: use "
                "optim_wrapper=dict(type='mmengine_optim.AdaScaleOptimWrapper', ...), or stop by train_cfg.max_iters")
        self._configured_max_iters = runner.max_iters

    @override
    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        self._step_schedulers(runner)
        if self.max_scale_invariant_iters is not None:
            self._maybe_stop(runner)
            self._follow_tau(runner)

    def _follow_tau(self, runner) -> None:
        """The loop's length: see the class docstring. Once τ is reached, an ``IterBasedTrainLoop``
        ends now; an ``EpochBasedTrainLoop`` at the end of this epoch, which becomes its length."""
        loop = runner.train_loop
        if not loop.stop_training:
            set_max_iters(loop, min(self._configured_max_iters, max(self.expected_stop(runner), runner.iter + 3)))
        elif isinstance(loop, EpochBasedTrainLoop):
            set_max_iters(loop, (runner.epoch + 1) * len(runner.train_dataloader))

    def expected_stop(self, runner) -> int:
        """The number of iterations after which τ is expected to reach ``max_scale_invariant_iters``:
        i iterations done with τ so far, at τ/i per iteration that is i + (target − τ)·i/τ, rounded
        up to where the loop can stop (the end of an accumulation window, or of an epoch in an
        ``EpochBasedTrainLoop``). The configured ``max_iters`` before the first update."""
        tau, done = runner.optim_wrapper.scale_invariant_iter, runner.iter + 1
        if tau <= 0:
            return self._configured_max_iters
        step = (len(runner.train_dataloader) if isinstance(runner.train_loop, EpochBasedTrainLoop)
                else accumulative_counts(runner.optim_wrapper))
        return math.ceil((done + (self.max_scale_invariant_iters - tau) * done / tau) / step) * step

    def _step_schedulers(self, runner) -> None:
        if runner.param_schedulers is None:
            return
        schedulers = runner.param_schedulers
        pairs = schedulers.items() if isinstance(schedulers, dict) else [(None, schedulers)]
        for name, group in pairs:
            wrapper = runner.optim_wrapper if name is None else runner.optim_wrapper[name]
            if not wrapper.should_update():  # the iteration only accumulated
                continue
            tau = getattr(wrapper, "scale_invariant_iter", None)
            for scheduler in group:
                if scheduler.by_epoch:
                    continue
                target = math.floor(tau) if tau is not None else scheduler_steps(scheduler) + 1
                while scheduler_steps(scheduler) < target:
                    scheduler.step()

    def _maybe_stop(self, runner) -> None:
        tau = runner.optim_wrapper.scale_invariant_iter
        if tau >= self.max_scale_invariant_iters and not runner.train_loop.stop_training:
            runner.train_loop.stop_training = True
            runner.logger.info(f"τ = {tau:.2f} reached max_scale_invariant_iters = "
                               f"{self.max_scale_invariant_iters}: training stops")
            _save_now(runner)


def warn_if_schedules_count_micro_batches(runner) -> None:
    """Warn (once per call: the Runner's ``train``) when ``runner`` has mmengine's own
    ``ParamSchedulerHook`` and an iteration-based param scheduler: that hook steps them after every
    iteration, i.e. per micro-batch, where AdaScale's schedules must follow ⌊τ⌋."""
    hooks = [h for h in runner.hooks if isinstance(h, ParamSchedulerHook)]
    if not hooks or any(isinstance(h, UpdateParamSchedulerHook) for h in hooks):
        return
    schedulers = runner.param_schedulers or []
    groups = schedulers.values() if isinstance(schedulers, dict) else [schedulers]
    if not any(not s.by_epoch for group in groups for s in group):
        return
    warnings.warn(
        "AdaScaleOptimWrapper with mmengine's ParamSchedulerHook: it steps iteration-based param schedulers "
        "once per micro-batch (every iteration, accumulation ones included), not per update or by τ, so the "
        "schedules run accumulative_counts times too fast and ignore the gain. Use "
        "default_hooks = dict(param_scheduler=dict(type='mmengine_optim.UpdateParamSchedulerHook'))",
        UserWarning, stacklevel=2)


def warn_if_checkpoints_split_windows(runner, accumulative_counts: int) -> None:
    """Warn (once per call: the Runner's ``train``) when a ``CheckpointHook`` saves inside an
    accumulation window: mmengine saves no gradients, so a run resumed there starts a new window
    without the micro-batches already accumulated and its numbers differ from the uninterrupted
    run's. A hook saves after iterations ``save_begin + k·interval`` (in epochs of
    ``len(train_dataloader)`` iterations with ``by_epoch``); they all end windows when both are
    multiples of ``accumulative_counts`` iterations. The last iteration always ends one."""
    c = accumulative_counts
    for hook in (h for h in runner.hooks if isinstance(h, CheckpointHook)):
        per = len(runner.train_dataloader) if hook.by_epoch else 1  # iterations per unit of interval
        if hook.interval <= 0 or (hook.interval * per % c == 0 and hook.save_begin * per % c == 0):
            continue
        unit = f"epochs ({hook.interval * per} iterations)" if hook.by_epoch else "iterations"
        aligned = (hook.interval * (c // math.gcd(hook.interval * per, c)) if hook.by_epoch
                   else math.ceil(hook.interval / c) * c)
        warnings.warn(
            f"CheckpointHook(interval={hook.interval}, save_begin={hook.save_begin}) saves every {hook.interval} "
            f"{unit}, inside the accumulation windows of accumulative_counts={c}: the accumulated gradients are not "
            "saved, so a run resumed from such a checkpoint differs from the uninterrupted one. Save at window ends: "
            f"default_hooks = dict(checkpoint=dict(interval={aligned})), and a save_begin that is a multiple of {c} "
            "iterations", UserWarning, stacklevel=2)


def _save_now(runner) -> None:
    """A checkpoint of this iteration, through the iteration-based CheckpointHook when there is
    one (its file name, ``last_checkpoint`` for ``--resume``, ``max_keep_ckpts``) unless it saves
    this iteration anyway; else ``iter_<n>.pth`` in the work dir."""
    hook = next((h for h in runner.hooks if isinstance(h, CheckpointHook)), None)
    if hook is not None and not hook.by_epoch:
        if not (hook.every_n_train_iters(runner, hook.interval, hook.save_begin)
                or (hook.save_last and hook.is_last_train_iter(runner))):
            save_checkpoint_now(hook, runner)
        return
    runner.save_checkpoint(runner.work_dir, f"iter_{runner.iter + 1}.pth")


class PortableCheckpointHook(Hook):
    """Checkpoints that any ``torch.load(weights_only=True)`` reads, also in a process that has not
    imported ``mmengine_optim``: the message hub is saved as plain tensors and numbers. (It keeps
    everything a checkpoint holds; it is not Lightning's ``save_weights_only``.)

    mmengine 0.10.7 saves the message hub's ``HistoryBuffer`` objects (numpy arrays and their
    statistics methods) and numpy scalars. Importing ``mmengine_optim`` allows exactly those in
    ``torch.load(weights_only=True)`` (:mod:`mmengine_optim.checkpoint_globals`), so mmengine's
    own resume works without this hook; a process without that import (a plain ``torch.load``)
    refuses them. This hook stores each buffer as a plain dict of tensors and each numpy scalar as
    a Python number before a save, and turns the buffers back after a load. ``python -m
    mmengine_optim.train`` adds it. ``WeightsOnlyCheckpointHook`` is its old name (still registered).
    """

    priority = "VERY_LOW"  # last before the save, so every other hook's additions are converted

    _KEYS = frozenset({"log_history", "count_history", "max_length"})

    @override
    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        hub = checkpoint.get("message_hub")
        if hub:
            checkpoint["message_hub"] = {**hub, "log_scalars": {
                key: self._plain(buf) if isinstance(buf, HistoryBuffer) else buf
                for key, buf in hub.get("log_scalars", {}).items()}, "runtime_info": {
                key: value.item() if isinstance(value, np.generic) else value  # e.g. the eta
                for key, value in hub.get("runtime_info", {}).items()}}

    @override
    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        hub = checkpoint.get("message_hub")
        if hub and "log_scalars" in hub:
            hub["log_scalars"] = {key: self._buffer(value) if isinstance(value, dict) and set(value) == self._KEYS
                                  else value for key, value in hub["log_scalars"].items()}

    @staticmethod
    def _plain(buf: HistoryBuffer) -> dict:
        log_history, count_history = buf.data
        return {"log_history": torch.from_numpy(log_history.copy()),
                "count_history": torch.from_numpy(count_history.copy()), "max_length": buf.max_length}

    @staticmethod
    def _buffer(plain: dict) -> HistoryBuffer:
        return HistoryBuffer(plain["log_history"].numpy(), plain["count_history"].numpy(),
                             plain["max_length"])


WeightsOnlyCheckpointHook = PortableCheckpointHook  # the old name, kept for configs that use it
