"""``LearningRateMonitor`` series for an AdaScale-wrapped optimizer: the user's name, the applied lr.

Lightning's ``LearningRateMonitor`` names a series ``lr-<optimizer class>`` (or the scheduler
config's ``name``; ``/pg<i>`` or the group's ``name`` per param group) and logs each group's
``param_groups[i]["lr"]`` at the start of each batch. With AdaScale both go wrong: the optimizer
Lightning holds is the wrapper (a new ``lr-AdaScale`` series, the user's lost), and the lr a step
applies is the scheduled lr × the gain, which is known only after the window's last backward —
after the monitor has read the (unscaled) scheduled lr. So for the AdaScale optimizer the monitor
names the series after the wrapped optimizer but logs no lr itself; :class:`AppliedLrSeries`
logs, once per update, the lrs that update applied, under those names (momentum and weight decay
stay the monitor's). A :class:`~fused_optim.NoiseScale` wrapper changes no lr: :func:`keep_names`
only names its series after the wrapped optimizer. Relies on ``LearningRateMonitor``'s naming
methods (Lightning 2.6).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import LearningRateMonitor


class AppliedLrSeries:
    """Takes over the lr series of ``inner`` (the optimizer that ``adascale`` wraps) from every
    ``LearningRateMonitor`` of ``trainer``; :meth:`detach` gives them back.

    Install before the monitors' ``on_train_start`` (they name their series there), i.e. at
    ``on_fit_start``."""

    def __init__(self, trainer, adascale: torch.optim.Optimizer, inner: torch.optim.Optimizer):
        self.monitors = [cb for cb in trainer.callbacks if isinstance(cb, LearningRateMonitor)]
        self._optimizers = (adascale, inner)
        self.names: list[str] = []  # one per param group of ``inner``; set by :meth:`start`
        for monitor in self.monitors:
            _see_through(monitor, adascale, inner)

    def start(self, trainer) -> None:
        """Name the series (at ``on_train_start``, when the scheduler configs are final)."""
        self.names = self._names(trainer) if self.monitors else []

    def log(self, pl_module, applied_lrs: list[float]) -> None:
        """Log each group's applied lr under its series name (at the step index the monitor uses
        for this update) and append it to each monitor's ``lrs`` history (its public record)."""
        for name, lr in zip(self.names, applied_lrs):
            pl_module.log(name, lr, on_step=True, on_epoch=False, batch_size=1)
            for monitor in self.monitors:
                monitor.lrs.setdefault(name, []).append(lr)

    def _names(self, trainer) -> list[str]:
        monitor = self.monitors[0]
        names, seen, seen_types = _original(monitor, "_find_names_from_schedulers")(trainer.lr_scheduler_configs)
        for config, config_names in zip(trainer.lr_scheduler_configs, names):
            if any(config.scheduler.optimizer is opt for opt in self._optimizers):
                return config_names
        (inner_names,), _ = _original(monitor, "_find_names_from_optimizers")([self._optimizers[1]], seen, seen_types)
        return inner_names

    def detach(self) -> None:
        """Give the monitors their own methods back (at the end of the fit)."""
        detach(self.monitors)


def keep_names(trainer, wrapper: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> list[LearningRateMonitor]:
    """Make every ``LearningRateMonitor`` of ``trainer`` name the series of ``wrapper`` (which shares
    the param groups of ``inner`` and applies their lrs as they are) after ``inner``, as without the
    wrapper; returns the monitors, for :func:`detach`. Install at ``on_fit_start``."""
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, LearningRateMonitor)]
    for monitor in monitors:
        _see_through(monitor, wrapper, inner, skip_lr=False)
    return monitors


def detach(monitors: list[LearningRateMonitor]) -> None:
    """Give ``monitors`` their own methods back (at the end of the fit)."""
    for monitor in monitors:
        for method in _OVERRIDDEN:
            monitor.__dict__.pop(method, None)


_OVERRIDDEN = ("_find_names_from_optimizers", "_extract_lr")


def _original(monitor: LearningRateMonitor, method: str):
    return getattr(type(monitor), method).__get__(monitor)


def _see_through(monitor: LearningRateMonitor, wrapper, inner, skip_lr: bool = True) -> None:
    """Make ``monitor`` name ``wrapper`` after ``inner`` (unless a scheduler bound to ``wrapper``
    named it already) and, with ``skip_lr``, skip the lr of ``inner``'s groups."""
    find_names, extract_lr = _original(monitor, _OVERRIDDEN[0]), _original(monitor, _OVERRIDDEN[1])

    def find_names_from_optimizers(optimizers: list[Any], seen_optimizers, seen_optimizer_types):
        optimizers = [inner if opt is wrapper and wrapper not in seen_optimizers else opt for opt in optimizers]
        return find_names(optimizers, seen_optimizers, seen_optimizer_types)

    def skip_inner_lr(param_group: dict, name: str) -> dict:
        if any(param_group is group for group in inner.param_groups):
            return {}
        return extract_lr(param_group, name)

    monitor._find_names_from_optimizers = find_names_from_optimizers
    if skip_lr:
        monitor._extract_lr = skip_inner_lr
