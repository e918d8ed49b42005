"""``CommunicatingOptimizer``: an inner optimizer plus communication before and/or after its step.

The wrapper *is* a ``torch.optim.Optimizer`` (Lightning and mmengine take it as one) whose
``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, so schedulers and hooks see
one set of groups. Its own state (error-feedback memories, PowerSGD's query, a step counter, a
generator) goes into the state dict under ``"communication"``, next to the inner optimizer's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..optimizer import run_closure


class CommunicatingOptimizer(torch.optim.Optimizer):
    """Subclasses implement ``_before_step()`` (e.g. average the grads) and/or ``_after_step()``
    (e.g. average the params), and ``_comm_state`` / ``_load_comm_state`` for their own state."""

    # GradScaler must unscale the grads itself (the inner optimizer's unscaling would be skipped:
    # the scaler hands grad_scale to this object, not to the inner one).
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer):
        # torch.optim.Optimizer.__init__ is not called: the groups and state are the inner optimizer's.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def state(self):
        return self.optimizer.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, tracker=None):
        """Run ``closure`` (under ``enable_grad``), communicate, step the inner optimizer,
        communicate; returns the closure's loss. ``tracker``: mlbench's Tracker (optional)."""
        loss = run_closure(closure)
        self._before_step()
        if tracker is not None and self._communicates_before:
            tracker.record_batch_agg()
        self.optimizer.step()
        if tracker is not None:
            tracker.record_batch_opt_step()
        self._after_step()
        if tracker is not None and not self._communicates_before:
            tracker.record_batch_agg()
        return loss

    _communicates_before = True

    def _before_step(self) -> None:
        pass

    def _after_step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if set_to_none is None:
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} communicates a fixed param list, checked across ranks at "
                                  "construction: build a new optimizer over all params instead")

    def state_dict(self) -> dict:
        return {**self.optimizer.state_dict(), "communication": self._comm_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        comm = state_dict.pop("communication", None)
        self.optimizer.load_state_dict(state_dict)
        if comm is not None:
            self._load_comm_state(comm)

    def _comm_state(self) -> dict:
        return {}

    def _load_comm_state(self, state: dict) -> None:
        pass

    def __getstate__(self) -> dict:
        """Everything (torch.optim.Optimizer's would take the groups and state only, and its
        ``__setstate__`` reads them back through ``param_groups``, before ``optimizer`` is set):
        ``copy.deepcopy`` and pickling copy the inner optimizer, the params and this state."""
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:
        """Anything else comes from the inner optimizer."""
        if name == "optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__.get('optimizer')!r})"
