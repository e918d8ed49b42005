"""``LossScaler``: the loss scale of mixed-precision training, without an unscale pass.

``torch.amp.GradScaler``'s algorithm and state dict (so a checkpoint of mmengine's
``AmpOptimWrapper`` loads), but the grads are never unscaled here: the wrapper hands the scale to
a fused_optim kernel, which divides inside its update, and finds overflows from the one norm pass
it makes anyway. Works on any device, CPU included.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._compat import amp_update_scale_


class LossScaler:
    r"""Static or dynamic loss scale s.

    ``scale(loss)`` = loss·s. ``update(found_inf)`` after each step: dynamic — on overflow
    s ← s·backoff_factor and the growth count restarts, after ``growth_interval`` clean steps in a
    row s ← s·growth_factor (GradScaler's rule, its ``_amp_update_scale_`` op); static — s stays.

    Args:
        init_scale: s at the start.
        dynamic: grow and back off, or keep s fixed.
        growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.
    """

    def __init__(self, init_scale: float = 2.0**16, dynamic: bool = True, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0:
            raise ValueError(f"Invalid loss_scale: {init_scale} (a float > 0, 'dynamic', or a dict of "
                             "GradScaler arguments)")
        _check_schedule(growth_factor, backoff_factor, growth_interval)
        self.dynamic = dynamic
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = torch.tensor(float(init_scale))
        self._growth_tracker = torch.zeros((), dtype=torch.int32)

    @classmethod
    def from_config(cls, loss_scale) -> LossScaler:
        """mmengine's ``loss_scale`` values: ``'dynamic'``, a float (static), or a dict of
        ``GradScaler`` arguments (``init_scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``)."""
        if loss_scale == "dynamic":
            return cls()
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            return cls(float(loss_scale), dynamic=False)
        if isinstance(loss_scale, dict):
            return cls(**loss_scale)
        raise ValueError(f"Invalid loss_scale: {loss_scale!r} ('dynamic', a float for a static scale, or a dict "
                         "of GradScaler arguments)")

    def get_scale(self) -> float:
        return float(self._scale)

    def scale_tensor(self, device: torch.device) -> Tensor:
        """s as a 0-dim float32 tensor on ``device`` (kept there from then on)."""
        if self._scale.device != device:
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)
        return self._scale

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.scale_tensor(loss.device).to(loss.dtype)

    def update(self, found_inf: Tensor) -> None:
        """After a step; ``found_inf`` (0-dim, nonzero on overflow) from this step's grads."""
        if self.dynamic:
            amp_update_scale_(self._scale, self._growth_tracker, found_inf.to(self._scale),
                                     self.growth_factor, self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        """``torch.amp.GradScaler.state_dict()``'s keys and types."""
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": int(self._growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        """All or nothing: a state missing a key, or with a schedule GradScaler refuses, raises
        before anything changes."""
        scale, tracker = float(state["scale"]), int(state["_growth_tracker"])
        schedule = state["growth_factor"], state["backoff_factor"], state["growth_interval"]
        _check_schedule(*schedule)
        self._scale.fill_(scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = schedule
        self._growth_tracker.fill_(tracker)


def _check_schedule(growth_factor, backoff_factor, growth_interval) -> None:
    """``torch.amp.GradScaler``'s conditions (growth > 1, backoff < 1), and an interval of at
    least one step, as ValueErrors naming the argument."""
    for name, value, ok, what in (
            ("growth_factor", growth_factor, isinstance(growth_factor, (int, float)) and growth_factor > 1, "> 1"),
            ("backoff_factor", backoff_factor, isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1,
             "in (0, 1)"),
            ("growth_interval", growth_interval, isinstance(growth_interval, int) and growth_interval >= 1,
             "an int >= 1")):
        if isinstance(value, bool) or not ok:
            raise ValueError(f"Invalid loss_scale {name}: {value!r} (GradScaler's {name}: {what})")
