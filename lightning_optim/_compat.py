"""Every reach of lightning_optim into Lightning's (and torch's) private internals, in one place.

Each is used because Lightning (torch) offers no public extension point for it, and each names the
version it was checked against. ``tests/lightning_optim/test_lightning_compat.py`` asserts on the installed
versions that each still exists with the signature or the behaviour used here, so an upgrade that
changes one fails there, by name, instead of inside a training run.

* :class:`SeeThroughMonitor`: ``LearningRateMonitor``'s naming (``_find_names_from_schedulers``,
  ``_find_names_from_optimizers``) and lr extraction (``_extract_lr``) — no public hook names a
  series or filters a group's lr (Lightning 2.6.6).
* :func:`hand_over_scheduler`: an ``LRSchedulerConfig.interval`` Lightning does not define, so that
  its loop leaves the scheduler to us (Lightning 2.6.6 steps only ``"step"`` / ``"epoch"`` ones).
* :func:`sync_module_states`: Lightning's broadcast of rank 0's params and buffers, which honours
  DDP's list of params to ignore (Lightning 2.6.6).
* :func:`should_compress`: torch's rule for which tensors ``powerSGD_hook`` compresses (torch 2.13).
* :class:`FailureAwareSpawn` (a ``DDPStrategy`` overriding ``_configure_launcher``) and
  :class:`FailureAwareSpawnLauncher`: ``DDPStrategy._configure_launcher`` and Lightning's spawn
  launcher (``_MultiProcessingLauncher``), whose ranks run the fit without Lightning's exception
  handling — no strategy or callback hook runs in a spawned rank that raises (Lightning 2.6.6).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
from typing_extensions import override

LIGHTNING_CHECKED = "2.6.6"
TORCH_CHECKED = "2.13.0"

# Lightning 2.6.6: ``_TrainingEpochLoop._update_learning_rates`` steps a scheduler config only when
# its ``interval`` is the loop's ("step" after an update, "epoch" at the epoch end).
SCALE_INVARIANT_INTERVAL = "scale_invariant_step"

# Lightning 2.6.6: ``lightning.pytorch.overrides.distributed._sync_module_states(module)``.
sync_module_states = _sync_module_states

# torch 2.13: ``_should_compress(num_rows, num_cols, matrix_approximation_rank, min_compression_rate)``
# returns ``(compress, uncompressed size, compressed size)``.
should_compress = _should_compress


# Lightning 2.6.6: ``DDPStrategy._configure_launcher()`` sets ``self._launcher``, for start methods
# other than "popen" a ``_MultiProcessingLauncher(strategy, start_method=...)``, whose
# ``launch(function, *args, trainer=None, **kwargs)`` runs ``function(*args, **kwargs)`` in each rank.


class FailureAwareSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher whose ranks call ``on_failure()`` (a picklable function) when the
    launched function raises, then re-raise: in a spawned rank Lightning calls no
    ``on_exception`` or ``teardown`` hook, the exception goes straight to torch's process wrapper."""

    def __init__(self, strategy, start_method: str, on_failure) -> None:
        super().__init__(strategy, start_method=start_method)
        self.on_failure = on_failure

    @override
    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        return super().launch(functools.partial(_run_or_fail, function, self.on_failure), *args, trainer=trainer,
                              **kwargs)


class FailureAwareSpawn(DDPStrategy):
    """A ``DDPStrategy`` (base of ours) whose spawned ranks call ``self.on_rank_failure()`` when the
    fit raises (:class:`FailureAwareSpawnLauncher`); the popen launcher is left as it is."""

    @staticmethod
    def on_rank_failure() -> None:
        """What a spawned rank does when its fit raised, before the error leaves it."""

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":
            self._launcher = FailureAwareSpawnLauncher(self, self._start_method, self.on_rank_failure)


def _run_or_fail(function, on_failure, *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except BaseException:
        on_failure()
        raise


def hand_over_scheduler(config) -> None:
    """From now on Lightning's loop does not step ``config``'s scheduler: the caller does."""
    config.interval = SCALE_INVARIANT_INTERVAL


def is_handed_over(config) -> bool:
    return config.interval == SCALE_INVARIANT_INTERVAL


class SeeThroughMonitor(LearningRateMonitor):
    """A ``LearningRateMonitor`` that names the series of ``wrapper`` (an optimizer sharing the
    param groups of ``inner``) after ``inner``, unless a scheduler bound to ``wrapper`` named them
    already, and with ``skip_lr`` leaves the lr of ``inner``'s groups to the caller.

    An instance the user made is turned into one by :func:`see_through` (its class becomes a
    subclass of its own class, its state stays) and back by :func:`restore`."""

    see_through_args: tuple[Any, torch.optim.Optimizer, bool]  # (wrapper, inner, skip_lr)

    @override
    def _find_names_from_optimizers(self, optimizers: list[Any], seen_optimizers, seen_optimizer_types):
        wrapper, inner, _ = self.see_through_args
        optimizers = [inner if opt is wrapper and wrapper not in seen_optimizers else opt for opt in optimizers]
        return super()._find_names_from_optimizers(optimizers, seen_optimizers, seen_optimizer_types)

    @override
    def _extract_lr(self, param_group: dict[str, Any], name: str) -> dict[str, Any]:
        _, inner, skip_lr = self.see_through_args
        if skip_lr and any(param_group is group for group in inner.param_groups):
            return {}
        return super()._extract_lr(param_group, name)

    def inner_series_names(self, lr_scheduler_configs) -> list[str]:
        """The names of ``inner``'s series (one per param group), as this monitor gives them."""
        wrapper, inner, _ = self.see_through_args
        names, seen, seen_types = self._find_names_from_schedulers(lr_scheduler_configs)
        for config, config_names in zip(lr_scheduler_configs, names):
            if config.scheduler.optimizer is wrapper or config.scheduler.optimizer is inner:
                return config_names
        (inner_names,), _ = self._find_names_from_optimizers([inner], seen, seen_types)
        return inner_names


@functools.cache
def _see_through_class(cls: type) -> type:
    """``cls`` (a LearningRateMonitor class) with :class:`SeeThroughMonitor`'s overrides, under
    ``cls``'s name (Lightning keys a callback's checkpoint state by it)."""
    if issubclass(cls, SeeThroughMonitor):
        return cls
    return type(cls.__name__, (SeeThroughMonitor, cls), {"__qualname__": cls.__qualname__,
                                                          "__module__": cls.__module__})


def see_through(monitor: LearningRateMonitor, wrapper, inner: torch.optim.Optimizer,
                skip_lr: bool) -> SeeThroughMonitor:
    """``monitor`` as a :class:`SeeThroughMonitor` of ``wrapper`` over ``inner`` (same object)."""
    monitor.__class__ = _see_through_class(type(monitor))
    monitor.see_through_args = (wrapper, inner, skip_lr)
    return monitor


def restore(monitor: LearningRateMonitor) -> None:
    """``monitor`` back to the class it had before :func:`see_through`."""
    if isinstance(monitor, SeeThroughMonitor) and type(monitor) is not SeeThroughMonitor:
        monitor.__class__ = type(monitor).__bases__[1]  # (SeeThroughMonitor, the monitor's own class)
        del monitor.see_through_args
