"""Every reach of mmengine_optim into mmengine's private internals, in one place.

Each is used because mmengine offers no public way to do it, and each names the version it was
checked against. ``tests/mmengine_optim/test_mmengine_compat.py`` asserts on the installed mmengine that each
still exists with the signature or the behaviour used here, so an upgrade that changes one fails
there, by name, instead of inside a training run.

* :func:`accumulative_counts`, :func:`set_accumulative_counts`: an ``OptimWrapper``'s accumulation
  count, which mmengine sets only in the constructor (no getter, no setter). After a change, the
  short last window follows through the public ``initialize_count_status``.
* :func:`scheduler_steps`: how many times a param scheduler was stepped (its ``last_step`` stops
  at the scheduler's ``end``).
* :func:`save_checkpoint_now`: a ``CheckpointHook``'s save (its file name, ``last_checkpoint``,
  ``max_keep_ckpts``) at an iteration its interval does not choose.
* :func:`set_max_iters`: a train loop's length in iterations, which mmengine fixes at its
  construction (``max_iters`` has no setter).
* :func:`is_resuming`: whether the runner resumes (``resume=True``) or only loads weights
  (``load_from``), as mmengine's own ``EMAHook`` tells them apart.
* :func:`calling_runner`: the ``Runner`` whose ``train`` called an optim wrapper's
  ``initialize_count_status`` (mmengine gives an optim wrapper no handle on its runner).
* :data:`amp_update_scale_`: torch's in-place dynamic loss scale update, the op
  ``torch.amp.GradScaler.update`` runs (torch 2.13), for a scaler that never unscales.
"""

from __future__ import annotations

import sys

import torch
from mmengine.hooks import CheckpointHook
from mmengine.optim import OptimWrapper
from mmengine.runner import Runner

MMENGINE_CHECKED = "0.10.7"
TORCH_CHECKED = "2.13.0"

# torch 2.13: ``_amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
# growth_interval)`` updates ``scale`` and ``growth_tracker`` in place, as GradScaler.update does.
amp_update_scale_ = torch._amp_update_scale_


def accumulative_counts(wrapper: OptimWrapper) -> int:
    """mmengine 0.10.7: ``OptimWrapper._accumulative_counts``, read by ``should_update``,
    ``should_sync``, ``scale_loss`` and ``initialize_count_status``."""
    return wrapper._accumulative_counts


def set_accumulative_counts(wrapper: OptimWrapper, counts: int) -> None:
    """mmengine 0.10.7: sets ``OptimWrapper._accumulative_counts``. A change during training
    must be followed by ``wrapper.initialize_count_status(...)`` (which derives the short last
    window from it); before ``Runner.train`` calls that, nothing else is needed."""
    wrapper._accumulative_counts = counts


def scheduler_steps(scheduler) -> int:
    """mmengine 0.10.7: ``_ParamScheduler._global_step``, the number of ``step()`` calls."""
    return scheduler._global_step


def save_checkpoint_now(hook: CheckpointHook, runner: Runner) -> None:
    """mmengine 0.10.7: ``CheckpointHook._save_checkpoint(runner)``."""
    hook._save_checkpoint(runner)


def set_max_iters(loop, max_iters: int) -> None:
    """mmengine 0.10.7: ``IterBasedTrainLoop._max_iters`` / ``EpochBasedTrainLoop._max_iters``,
    returned by their ``max_iters`` (hence ``Runner.max_iters``: ``IterTimerHook``'s ETA, the
    log's ``[iter/max_iters]``, ``Hook.is_last_train_iter``) and, in ``IterBasedTrainLoop.run``,
    the loop's condition (``EpochBasedTrainLoop`` runs by epochs)."""
    loop._max_iters = max_iters


def is_resuming(runner: Runner) -> bool:
    """mmengine 0.10.7: ``Runner._resume`` (the ``resume`` argument; mmengine's ``EMAHook`` reads it)."""
    return bool(runner._resume)


def calling_runner() -> Runner | None:
    """The Runner whose ``train`` called the function that calls this one, else None. mmengine
    0.10.7: ``Runner.train`` calls ``self.optim_wrapper.initialize_count_status(...)`` itself,
    after building the hooks and the param schedulers."""
    caller = sys._getframe(2).f_locals.get("self")
    return caller if isinstance(caller, Runner) else None
