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
only names its series after the wrapped optimizer. For the fit, each monitor becomes a
:class:`~lightning_optim._compat.SeeThroughMonitor` (a subclass of its own class, which overrides
``LearningRateMonitor``'s naming methods).
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import LearningRateMonitor

from ._compat import SeeThroughMonitor, restore, see_through


class AppliedLrSeries:
    """Takes over the lr series of ``inner`` (the optimizer that ``adascale`` wraps) from every
    ``LearningRateMonitor`` of ``trainer``; :meth:`detach` gives them back.

    Install before the monitors' ``on_train_start`` (they name their series there), i.e. at
    ``on_fit_start``."""

    def __init__(self, trainer, adascale: torch.optim.Optimizer, inner: torch.optim.Optimizer):
        self.monitors: list[SeeThroughMonitor] = [see_through(cb, adascale, inner, skip_lr=True)
                                                  for cb in _monitors(trainer)]
        self.names: list[str] = []  # one per param group of ``inner``; set by :meth:`start`

    def start(self, trainer) -> None:
        """Name the series (at ``on_train_start``, when the scheduler configs are final)."""
        self.names = self.monitors[0].inner_series_names(trainer.lr_scheduler_configs) if self.monitors else []

    def log(self, pl_module, applied_lrs: list[float]) -> None:
        """Log each group's applied lr under its series name (at the step index the monitor uses
        for this update) and append it to each monitor's ``lrs`` history (its public record)."""
        for name, lr in zip(self.names, applied_lrs):
            pl_module.log(name, lr, on_step=True, on_epoch=False, batch_size=1)
            for monitor in self.monitors:
                monitor.lrs.setdefault(name, []).append(lr)

    def detach(self) -> None:
        """Give the monitors their own class back (at the end of the fit)."""
        detach(self.monitors)


def keep_names(trainer, wrapper: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> list[LearningRateMonitor]:
    """Make every ``LearningRateMonitor`` of ``trainer`` name the series of ``wrapper`` (which shares
    the param groups of ``inner`` and applies their lrs as they are) after ``inner``, as without the
    wrapper; returns the monitors, for :func:`detach`. Install at ``on_fit_start``."""
    return [see_through(monitor, wrapper, inner, skip_lr=False) for monitor in _monitors(trainer)]


def detach(monitors: list[LearningRateMonitor]) -> None:
    """Give ``monitors`` their own class back (at the end of the fit)."""
    for monitor in monitors:
        restore(monitor)


def _monitors(trainer) -> list[LearningRateMonitor]:
    return [cb for cb in trainer.callbacks if isinstance(cb, LearningRateMonitor)]
