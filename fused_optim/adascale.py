"""AdaScale: gain-driven learning-rate scaling for large-batch training (fairscale's API and numerics,
robust to real training loops), on :class:`GradientStatistics`, the per-window gradient statistics it
shares with :class:`~fused_optim.NoiseScale`.

This module holds the plumbing: the gradient hooks that sum each micro-batch's ‖g‖² and count the
backward passes of a window, the window's end (in the backward pass that completes it, or in a
short window's ``step()``), the loss scales under AMP, the wrapped optimizer's step and the state
dict. The statistics' arithmetic (estimates, EWMAs, gain, noise scale) is in
:mod:`.gradient_stats_math`."""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from . import _build, _ops, sharding
from . import gradient_stats_math as stats
from .checks import positive_int
from .gradient_stats_fsdp import UnshardedGradHooks, fsdp2_units
from .gradient_stats_math import Window
from .gradient_stats_rows import SHARDED_PARAMS, SumRows, UnseenGrads, check_grad
from .norm import sum_squares_
from .optimizer import run_closure

# The window counters the gradient hooks share with Python: one int64 CPU tensor
# (``GradientStatistics._counts``) that the C++ hooks (csrc/cpu/grad_norms.cpp) read and write at
# these positions, as the Python hooks do.
PASSES = 0  # backward passes of the current window
LAST_TASK = 1  # the autograd graph task id of the last pass counted (-1: none yet)
WINDOW_PASSES = 2  # the passes that complete a window (c); the hooks end it at that count
HANDLE = 3  # the object's key in _WINDOW_OWNERS, by which the window-end op finds it


def _window_counts(handle: int) -> Tensor:
    """The counters of a new window (see PASSES ... HANDLE); the window length is set later."""
    counts = torch.zeros(4, dtype=torch.int64)
    counts[LAST_TASK], counts[HANDLE] = -1, handle
    return counts


class GradientStatistics(torch.optim.Optimizer):
    r"""The gradient statistics of :class:`AdaScale` and :class:`~fused_optim.NoiseScale`: wraps
    any optimizer, takes per-micro-batch and pooled gradient norms each accumulation window and
    keeps their EWMAs; :meth:`step` steps the wrapped optimizer (subclasses change how).

    The window machinery (hooks, short windows, DDP, AMP, state, DTensor params) is described in
    :class:`AdaScale`;
    besides AdaScale's averages (``grad_var_avg``, ``grad_sqr_avg``, in units of the scale S), every
    window also updates, with the same β, the unbiased micro-batch-unit estimates (McCandlish et
    al. 2018, App. A; c' the window's backward passes, B = N·c' micro-batches)::

        noise_var = B/(B − 1) · (local/B − total)      (tr(Σ) / B_micro)
        noise_sqr = total − noise_var/B                 (|G|², may be negative for one window)

    and :meth:`noise_scale` is B_simple = B_micro · Σ_k noise_var_k / Σ_k noise_sqr_k (the ratio of
    the averages, not an average of ratios).
    """

    _step_supports_amp_scaling = True
    _name = "GradientStatistics"  # in messages (Lightning's optimizer wrappers subclass ours)
    _state_key = "gradient_statistics"  # this class's entry in the state dict

    def __init__(self, optimizer: torch.optim.Optimizer, world_size: int | None = None, scale: float | None = None,
                 smoothing: float | None = None, num_gradients_to_accumulate: int = 1, is_scaled_loss: bool = True,
                 debias_ewma: bool = True, grad_scaler: torch.amp.GradScaler | None = None,
                 module: torch.nn.Module | None = None):
        self._optimizer = optimizer
        self._grad_scaler = grad_scaler
        self._module = None if module is None else weakref.ref(module)  # (FSDP2's: see _hook)
        self._rows = SumRows(self.param_groups, self._name)
        self._fsdp2 = set(self._fsdp2_units(self._rows))  # (indices: the units are found again where hooked)
        if world_size is None:  # (the ranks of a DTensor's mesh hold one replica, unless FSDP2 shards it)
            world_size = 1 if not self._fsdp2 >= set(self._rows.sharded) \
                else (dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
        self._world_size = self._checked_world_size(world_size)
        self._is_scaled_loss = is_scaled_loss
        self._debias_ewma = debias_ewma
        self._hooks: list = []
        self._unseen = UnseenGrads(self._rows)  # DTensor grads no hook saw (refused at step)
        # The hooks count the window's backward passes in it and end the window (see _hook).
        self._counts = _window_counts(next(_handles))
        _WINDOW_OWNERS[int(self._counts[HANDLE])] = self
        self._local = self._zeros()
        # The ended window's sums, before the loss scales are known: see _end_window.
        self._pending: Window | None = None
        self._last_loss_scale: float | None = None  # the loss scale of the last AMP step
        self._warned_stale_scale = False
        # The averages (and their accumulators), one float per group (tensors in the state dict).
        self._avg: dict[str, list[float]] = stats.initial_averages(len(self.param_groups))
        self.set_num_gradients_to_accumulate(num_gradients_to_accumulate, update_smoothing=True)
        if smoothing is not None:
            self._smoothing = float(smoothing)
        if self._world_size * self._accum <= 1:
            raise RuntimeError(
                f"{self._name} needs world_size * num_gradients_to_accumulate > 1: it estimates the gradient "
                "variance from several micro-batches (use DDP with more ranks, or accumulate gradients)"
                + (f"; {SHARDED_PARAMS}" if self._rows.sharded else "")
            )
        self._scale = float(self._world_size * self._accum if scale is None else scale)
        if self._scale < 1:
            raise ValueError(f"Invalid scale: {scale} (must be >= 1)")
        self._hook()

    # ---- hooks: per-micro-batch local norms --------------------------------------------------
    def _fsdp2_units(self, rows: SumRows) -> dict[int, tuple]:
        """The DTensor params of ``rows`` that FSDP2 units of ``module`` manage (:func:`.fsdp2_units`)."""
        return fsdp2_units(None if self._module is None else self._module(), rows.params, rows.sharded)

    def _hook(self) -> None:
        """Hooks on the params that require grad, adding to their rows of the sums: C++ hooks on
        plain params where the kernels build, Python ones otherwise and on DTensor params; FSDP2's
        params are watched through the plain tensors it unshards them into (:mod:`.gradient_stats_fsdp`)."""
        hooked = [(i, row, p) for i, (row, p) in enumerate(zip(self._rows.rows, self._rows.params))
                  if p.requires_grad and i not in self._fsdp2]
        self._hooks = self._plain_hooks([(row, p) for _, row, p in hooked if not sharding.is_dtensor(p)])
        self._hooks += [p.register_hook(functools.partial(self._on_sharded_grad, i, row, weakref.ref(p)))
                        for i, row, p in hooked if sharding.is_dtensor(p)]
        if self._fsdp2:
            self._hooks.append(UnshardedGradHooks(self._fsdp2_units(self._rows), self._rows.params,
                                                  self._on_unsharded_grad, lambda: self._world_size))

    def _plain_hooks(self, plain: list[tuple[int, Tensor]]) -> list:
        """The hooks of the plain params of ``(row, param)`` pairs: C++ ones where the kernels build."""
        params, index = [p for _, p in plain], [row for row, _ in plain]
        if params and _native_hooks_work(params):
            positions = _ops.op("grad_norm_hooks")(params, index, self._local, self._counts)
            return [_NativeHook(p, pos) for p, pos in zip(params, positions)]
        return [p.register_hook(functools.partial(self._on_grad, row)) for row, p in plain]

    def unhook(self) -> None:
        """Remove the gradient hooks (no backward pass is seen any more)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad(self, row: int, grad: Tensor) -> None:
        """The Python twin of the C++ hooks (``csrc/cpu/grad_norms.cpp``), for devices or builds
        without them: ``local[row] += ‖grad‖²`` while the micro-batch grad is in cache, and a hook
        in another autograd graph task than the last one counted starts a new backward pass; the
        pass that completes the window ends it when it finishes (see ``_queue_window_end``).
        (Keeping the grads for one batched call at the end of the backward costs more: autograd
        then copies the first micro-batch's grads instead of moving them into ``.grad``, and the
        allocator cannot reuse their memory.)"""
        sum_squares_(self._local, [grad], [row])
        task = torch._C._current_graph_task_id()
        if int(self._counts[LAST_TASK]) != task:
            self._counts[LAST_TASK] = task
            self._counts[PASSES] += 1
            if int(self._counts[PASSES]) == int(self._counts[WINDOW_PASSES]):
                _queue_window_end(self._counts)

    def _on_sharded_grad(self, i: int, row: int, param: weakref.ref, grad: Tensor) -> None:
        """The hook of DTensor param ``i`` (held weakly, as the C++ hooks hold theirs):
        :meth:`_on_grad` of its grad's local tensor (the sum of the whole tensor is taken at the
        window's end, see :class:`.SumRows`)."""
        check_grad(i, param(), grad)
        self._unseen.seen.add(i)
        with torch.no_grad():
            self._on_grad(row, grad.to_local())

    def _on_unsharded_grad(self, i: int, grad: Tensor) -> None:
        """The hook of FSDP2's unsharded param of DTensor param ``i``: :meth:`_on_grad` in its group's
        row of whole tensors (pooled over the ranks)."""
        self._unseen.seen.add(i)
        self._on_grad(self._rows.plain_row(i), grad)

    @property
    def _backwards(self) -> int:
        """Backward passes of the current window."""
        return int(self._counts[PASSES])

    # ---- the averages -------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self._scale

    @property
    def smoothing(self) -> float:
        return self._smoothing

    def _current(self) -> tuple[dict[str, list[float]], float | None]:
        """The averages as of now and the scale of the window in them: between the backward pass
        that completes a window and ``step()``, with that window's statistics already in (as
        ``step()`` will take them; None: no window pending, the scale is S)."""
        if self._pending is None:
            return self._avg, None
        return self._averaged(self._pending, *self._preview_loss_scales()), self._pending.scale

    def noise_scale(self, micro_batch_size: int = 1) -> float:
        """B_simple = tr(Σ)/|G|², the gradient noise scale, in samples of micro-batches of
        ``micro_batch_size`` (in micro-batches by default): the batch size beyond which a larger
        batch stops paying off (McCandlish et al. 2018). NaN before the first window; inf while the
        averaged |G|² estimate is not positive (the noise dominates every batch measured)."""
        avg, _ = self._current()
        return stats.noise_scale(avg, micro_batch_size)

    def _preview_loss_scales(self) -> tuple[float, float]:
        """The loss scales ``step()`` will divide the pending window's sums by, as far as they are
        known before it: ``loss_scale`` if a caller set it, the scaler's current scale if
        AdaScale was given ``grad_scaler``, else the last AMP step's (with a warning: the scaler may
        have changed it since), else 1."""
        loss_scale = getattr(self, "loss_scale", None)
        if loss_scale is None and self._grad_scaler is not None and self._grad_scaler.is_enabled():
            loss_scale = self._grad_scaler.get_scale()
        if loss_scale is None and self._last_loss_scale is not None:
            if not self._warned_stale_scale:
                self._warned_stale_scale = True
                warnings.warn(f"{self._name}'s statistics read before step() under a GradScaler it was not given: "
                              f"they assume the last step's loss scale; pass {self._name}(..., grad_scaler=scaler) "
                              "for the exact values", stacklevel=4)
            loss_scale = self._last_loss_scale
        loss_scale = 1.0 if loss_scale is None else float(loss_scale)
        return loss_scale, loss_scale if self._pending.at_backward_end else 1.0

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """New S; the variance averages (and their accumulators) are rescaled by S_old/S_new."""
        self._outside_window("set_scale")
        if scale < 1:
            raise ValueError(f"Invalid scale: {scale} (must be >= 1)")
        if update_estimate:
            self._avg = stats.rescaled(self._avg, self._scale, scale)
        self._scale = float(scale)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def num_gradients_to_accumulate(self) -> int:
        return self._accum

    def set_num_gradients_to_accumulate(self, num_gradients_to_accumulate: int, update_smoothing: bool = True) -> None:
        """New c (backward passes per step); resets β to its default unless update_smoothing=False."""
        self._outside_window("set_num_gradients_to_accumulate")
        self._accum = positive_int("num_gradients_to_accumulate", num_gradients_to_accumulate)
        self._counts[WINDOW_PASSES] = self._accum
        if update_smoothing:
            self._smoothing = max(1 - self._world_size * self._accum / 1000, 0.0)

    def set_world_size(self, world_size: int, update_smoothing: bool = True) -> None:
        """New N (the ranks whose micro-batches a step pools); resets β to its default unless
        update_smoothing=False. The scale is not changed (see :meth:`set_scale`)."""
        self._outside_window("set_world_size")
        self._world_size = self._checked_world_size(world_size)
        self.set_num_gradients_to_accumulate(self._accum, update_smoothing)

    def set_window(self, world_size: int, num_gradients_to_accumulate: int) -> None:
        """New N and c together (β back to its default); a scale left at its default N·c follows."""
        if (self._world_size, self._accum) == (world_size, num_gradients_to_accumulate):
            return
        default_scale = self._scale == self._world_size * self._accum
        self.set_world_size(world_size)
        self.set_num_gradients_to_accumulate(num_gradients_to_accumulate)
        if default_scale:
            self.set_scale(float(world_size * num_gradients_to_accumulate))

    def _checked_world_size(self, world_size: int, rows: SumRows | None = None) -> int:
        """``world_size`` if it is a positive int that the params (of ``rows``, default this
        optimizer's) allow: 1 where DTensor params other than FSDP2's are measured (their mesh
        holds one replica, see :class:`.SumRows`)."""
        world_size = positive_int("world_size", world_size)
        fsdp2 = self._fsdp2 if rows is None else set(self._fsdp2_units(rows))
        rows = self._rows if rows is None else rows
        if world_size > 1 and not fsdp2 >= set(rows.sharded):
            raise ValueError(f"{self._name}: world_size={world_size} pools the micro-batches of several ranks, but "
                             f"params are DTensors; {SHARDED_PARAMS}")
        return world_size

    def _outside_window(self, what: str) -> None:
        if self._backwards:
            raise RuntimeError(
                f"{self._name}.{what} was called inside an accumulation window ({self._backwards} backward passes "
                "since the last step); call it right after step()"
            )

    # ---- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Run the closure, take the window's statistics into the averages, step the inner optimizer
        (see :meth:`_update`); returns the closure's loss. A step whose inner step raises leaves
        the averages and the window as they were (a step again takes the same window)."""
        loss = run_closure(closure)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        skipped = found_inf is not None and float(found_inf) != 0
        before = self._pending, self._avg, self._last_loss_scale
        if self._pending is None and self._backwards and not skipped:
            self._pending = self._end_window(at_backward_end=False)  # a short window (every rank steps)
        if not skipped:
            self._refuse_unseen(before[0])
        window, self._pending = self._pending, None  # (from here on the averages hold the window)
        if skipped:
            self._reset_window()
            return loss
        try:
            if window is not None:
                micro_scale, grad_scale_of_total = self._loss_scales(window, grad_scale, found_inf)
                if found_inf is not None:
                    self._last_loss_scale = micro_scale
                self._avg = self._averaged(window, micro_scale, grad_scale_of_total)
            self._update(self._scale if window is None else window.scale, grad_scale, found_inf)
        except BaseException:
            self._pending, self._avg, self._last_loss_scale = before
            raise
        self._reset_window()
        return loss

    def _refuse_unseen(self, pending: Window | None) -> None:
        """Raises, with ``pending`` the window again, where DTensor grads no hook saw would step
        (:class:`.UnseenGrads`: decided at the window's end, or here on this rank's flags where no
        backward pass reached a hook)."""
        if self._pending is None:
            self._unseen.decide(self._unseen.flags(torch.device("cpu")))
        try:
            self._unseen.refuse(self._name)
        except RuntimeError:
            self._pending = pending
            raise

    def _update(self, scale: float, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """The parameter update of a step whose statistics are in the averages (``scale``: the
        window's S): the inner optimizer's step, unchanged."""
        self._inner_step(grad_scale, found_inf)

    def scale_grad_by_num_grads_to_accum(self) -> None:
        """Divide every ``.grad`` by c, the accumulation count (fairscale's method of this name):
        with ``is_scaled_loss=False`` the grads hold the sum of the window's micro-batch grads,
        and this makes them the mean before ``step()``. Call it after the window's last backward."""
        if self._accum <= 1:
            raise RuntimeError(f"{self._name}.scale_grad_by_num_grads_to_accum: num_gradients_to_accumulate is 1, "
                               "there is nothing to scale")
        if self._is_scaled_loss:
            raise RuntimeError(f"{self._name}.scale_grad_by_num_grads_to_accum is for unscaled losses: this one has "
                               "is_scaled_loss=True (the losses were divided by c already)")
        if self._backwards and self._pending is None:
            raise RuntimeError(f"{self._name}.scale_grad_by_num_grads_to_accum was called inside an "
                               f"accumulation window ({self._backwards} of {self._accum} backward passes); call it "
                               "after the last one")
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, float(self._accum))

    def _loss_scales(self, window: Window, grad_scale: Tensor | None, found_inf: Tensor | None) -> tuple[float, float]:
        """The loss scales that the window's micro-batch sums and ``.grad`` sums carry: the
        scaler's ``grad_scale`` for both, or, after ``scaler.unscale_(self)`` (``found_inf`` alone),
        ``grad_scaler``'s for the micro-batches, and for ``.grad`` too if its sums were taken at
        the end of the backward pass (before the unscale), else 1."""
        loss_scale = getattr(self, "loss_scale", None)
        if loss_scale is not None:  # set by a caller whose grad_scale also holds a clip coefficient
            return float(loss_scale), float(loss_scale)
        if grad_scale is not None:
            return float(grad_scale), float(grad_scale)
        if found_inf is None:
            return 1.0, 1.0
        if self._grad_scaler is None:
            raise RuntimeError(
                f"{self._name}.step: the grads were unscaled before step() (scaler.unscale_(optimizer)), but "
                "the micro-batch norms were taken on the scaled grads; pass the scaler, "
                f"{self._name}(optimizer, ..., grad_scaler=scaler), or let scaler.step() unscale"
            )
        scaler_scale = float(self._grad_scaler.get_scale())
        return scaler_scale, scaler_scale if window.at_backward_end else 1.0

    def _reset_window(self) -> None:
        self._local.zero_()
        self._counts[PASSES] = 0
        self._unseen.restart()
        self._pending = None

    def _inner_step(self, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        inner = self._optimizer
        if grad_scale is None:
            inner.step()
        elif getattr(inner, "_step_supports_amp_scaling", False):
            inner.grad_scale, inner.found_inf = grad_scale, found_inf
            try:
                inner.step()
            finally:
                del inner.grad_scale, inner.found_inf
        else:  # an optimizer that expects unscaled grads
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch._foreach_mul_(grads, 1.0 / float(grad_scale))
            inner.step()

    def _window_ended_in_backward(self) -> None:
        """Called (through the ``adascale_window_end`` op) at the end of the backward pass that
        completes the window."""
        self._pending = self._end_window(at_backward_end=True)

    def _end_window(self, at_backward_end: bool) -> Window:
        """The window's sums per group: the micro-batch sums pooled over ranks (the one all-reduce)
        and ``.grad``'s, both of whole tensors (DTensors' summed over their shards, in one
        all-reduce: see :class:`.SumRows`), still carrying the loss scales (known only at ``step()``).
        Under FSDP2 the pooling all-reduce also adds the tensor-parallel parts of each unsharded
        param's sums (:mod:`.gradient_stats_fsdp`), so it runs with one data-parallel replica too.
        The flags of :class:`.UnseenGrads` ride on it, and its decision is taken here."""
        c = self._backwards
        rows = len(self._rows)
        local = torch.cat((self._local, self._unseen.flags(self._local.device)))  # (the flags ride along)
        if self._world_size > 1 or self._fsdp2:
            dist.all_reduce(local)
        local, flags = local[:rows], local[rows:]
        self._unseen.decide(flags)
        total = self._zeros(self._params_device())  # (where the .grad are)
        self._rows.add_grad_sums(total)
        local, total = self._rows.whole(local, total.to(local.device))
        # Per group, in Python floats (double, as the tensors: the same results, without ~40 small ops).
        return Window(local.tolist(), total.tolist(), c, self._scale * min(c, self._accum) / self._accum,
                       at_backward_end)

    def _averaged(self, window: Window, micro_scale: float, grad_scale: float) -> dict[str, list[float]]:
        """The averages after ``window`` (the current ones when it cannot estimate, or when its
        statistics are not finite)."""
        return stats.averaged(self._avg, window, micro_scale, grad_scale, accum=self._accum,
                              world_size=self._world_size, is_scaled_loss=self._is_scaled_loss,
                              beta=self._smoothing, debias=self._debias_ewma)

    def _zeros(self, device: torch.device | None = None) -> Tensor:
        """One float64 per row of the sums (per param group without DTensors, see
        :class:`.SumRows`), on ``device``, by default that of the micro-batch sums (so NCCL can
        all-reduce them): FSDP2's compute device where its params are watched (their unsharded
        grads are there, also where ``CPUOffloadPolicy`` keeps the shards on the CPU), else the
        params'."""
        if device is None:
            device = sharding.mesh_device(self._rows.params[next(iter(self._fsdp2))].device_mesh) if self._fsdp2 \
                else self._params_device()
        return torch.zeros(len(self._rows), dtype=torch.float64, device=device)

    def _params_device(self) -> torch.device:
        return next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    # ---- optimizer API ---------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the grads and start a new window: statistics of backward passes that no step()
        consumed (a window the loop abandoned) are dropped with their grads."""
        if set_to_none is None:
            self._optimizer.zero_grad()
        else:
            self._optimizer.zero_grad(set_to_none=set_to_none)
        self._reset_window()

    def add_param_group(self, param_group: dict) -> None:
        self._outside_window("add_param_group")
        self._optimizer.add_param_group(param_group)
        try:
            rows = SumRows(self.param_groups, self._name)
            self._checked_world_size(self._world_size, rows)
        except ValueError:
            self._optimizer.param_groups.pop()
            raise
        self._avg = stats.with_new_group(self._avg)
        self._rows, self._fsdp2 = rows, set(self._fsdp2_units(rows))
        self._unseen = UnseenGrads(rows)
        self._local = self._zeros()
        self.unhook()
        self._hook()

    # The inner optimizer's, always (its load_state_dict replaces its param_groups list).
    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self._optimizer.param_groups = groups

    @property
    def defaults(self) -> dict:
        return self._optimizer.defaults

    @property
    def state(self):
        return self._optimizer.state

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus the statistics (under ``_state_key``): tensors and
        floats only."""
        window = self._pending
        return {**self._optimizer.state_dict(), self._state_key: {
            **{name: torch.tensor(value, dtype=torch.float64) for name, value in self._avg.items()},
            "local": self._local.clone(), "backwards": self._backwards, "scale": self._scale,
            "smoothing": self._smoothing, "num_gradients_to_accumulate": self._accum,
            **({} if window is None else {
                "ended_local": torch.tensor(window.local, dtype=torch.float64),
                "ended_total": torch.tensor(window.total, dtype=torch.float64),
                "ended_passes": window.passes, "ended_scale": window.scale,
                "ended_at_backward_end": window.at_backward_end}),
        }}

    def load_state_dict(self, state_dict: dict) -> None:
        """Also takes the state dict of a plain optimizer (a run that adds AdaScale on resume): the
        statistics then start afresh, with a warning."""
        state_dict = dict(state_dict)
        if self._state_key not in state_dict:
            warnings.warn(f"{self._name}.load_state_dict: no {self._name} statistics in this state dict (saved from "
                          "the bare optimizer?); loading the optimizer state and starting the statistics afresh",
                          stacklevel=2)
            self._optimizer.load_state_dict(state_dict)
            self._reset_window()
            return
        saved = dict(state_dict.pop(self._state_key))
        local = saved.pop("local")
        if local.shape != self._local.shape and len(state_dict["param_groups"]) == len(self.param_groups):
            if local.any():
                raise ValueError(f"{self._name}.load_state_dict: the state was saved inside an accumulation window "
                                 f"with {local.numel()} rows of sums, and this optimizer has {self._local.numel()} "
                                 "(its params are sharded differently, see fused_optim.gradient_stats_rows); save "
                                 "after step() to resume with params sharded otherwise")
            local = torch.zeros_like(self._local)  # (a window boundary: no sums to carry)
        self._optimizer.load_state_dict(state_dict)  # first: torch checks the state before it loads
        self._load_extra(saved)
        self._local.copy_(local)  # in place: the hooks hold these tensors
        self._counts[PASSES] = int(saved.pop("backwards"))
        self._unseen.restart()  # (the grads as they are now start what is left of the loaded window)
        self._scale = float(saved.pop("scale"))
        self._smoothing = float(saved.pop("smoothing"))
        self._accum = int(saved.pop("num_gradients_to_accumulate"))
        self._counts[WINDOW_PASSES] = self._accum
        self._pending = None if "ended_local" not in saved else Window(
            saved.pop("ended_local").tolist(), saved.pop("ended_total").tolist(), int(saved.pop("ended_passes")),
            float(saved.pop("ended_scale")), bool(saved.pop("ended_at_backward_end")))
        self._avg = {name: value.tolist() for name, value in saved.items()}

    def __getattr__(self, name: str) -> Any:
        """Anything else comes from the wrapped optimizer."""
        if name == "_optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def _load_extra(self, saved: dict) -> None:
        """Pop a subclass's own entries from its saved state (none here)."""

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickle: everything but the hooks (torch's ``Optimizer`` would
        give the inner optimizer's keys only, and no copy could be made). One that watches FSDP2's
        params is not copied: the copy's params would be copies, which no FSDP2 unit unshards."""
        if self._fsdp2:
            raise TypeError(f"{self._name} given module= watches the params of the model's FSDP2 units, and a copy "
                            "would hold copies of them, which no unit unshards; save its state_dict() and load it "
                            f"into a {self._name} made over the model's optimizer with module=model")
        return {**self.__dict__, "_hooks": [], "_module": None}

    def __setstate__(self, state: dict) -> None:
        """The copy gets its own handle and hooks on its own params (which share its sums)."""
        if "_unseen" not in state:  # (pickled before FSDP2's params were watched)
            state.update(_fsdp2=set(), _unseen=UnseenGrads(state["_rows"]))
        self.__dict__.update(state)
        self._counts[HANDLE] = next(_handles)
        _WINDOW_OWNERS[int(self._counts[HANDLE])] = self
        self._hook()

    def __repr__(self) -> str:
        return f"{self._name}(scale={self._scale}, smoothing={self._smoothing}, optimizer={self._optimizer!r})"


class AdaScale(GradientStatistics):
    r"""Wraps any optimizer and multiplies each group's lr, for its step, by the AdaScale gain.

    Statistics (Johnson et al., "AdaScale SGD", ICML 2020; fairscale's estimator). N world size,
    c the backward passes of the window, cN = N·c, S the scale (default N·c), β the smoothing
    (default max(1 − N·c/1000, 0)). Per group k::

        local[k]  = Σ over micro-batches and ranks of Σ_p ‖g_micro(p)‖²   (before DDP averaging and
                    before accumulation into .grad; one all-reduce per step)
        total[k]  = Σ_p ‖p.grad‖²
        c > 1:      is_scaled_loss: local ·= c²      else: total /= c²
        var = local·(S/cN)/(cN − 1) − total·S/(cN − 1) ;  sqr = total − var/S
        var ← max(var, 1e−6) ; sqr ← max(sqr, 0)
        EWMA of sqr and var with β (debias_ewma: bias-corrected; else a plain mean for the
        first 1/(1 − β) windows, then the EWMA)
        gain(k) = (var_k + sqr_k) / (var_k/S + sqr_k)   (gain(): var and sqr summed over groups)
        step():     lr_k ← lr_k·gain(k) for the inner step, then restored exactly;  τ += gain()
        global_gain=True: every group's lr gets gain() (var and sqr summed over the groups)

    Where fairscale breaks in real loops, this one does not:

    * The window's statistics are taken at the end of the backward pass that completes it (the
      c-th; after DDP's gradient all-reduce, with AdaScale's one all-reduce, which every rank
      reaches there), so ``gain()`` read between that backward and ``step()`` is the gain
      ``step()`` applies (fairscale's documented ``loss.backward(); tau += opt.gain();
      opt.step()``). ``step(closure)`` runs the closure first (it may hold the window's last
      backward); a window that ended short of c backward passes (the last of an epoch, c' < c)
      is taken there instead, with c' in the formulas (and S·c'/c as its scale); a window with
      N·c' = 1 cannot estimate a variance and keeps the averages.
    * Under ``torch.amp.GradScaler`` (``_step_supports_amp_scaling``: the scaler hands over
      ``grad_scale`` / ``found_inf``) both sums are divided by the scale², the inner optimizer
      gets the grads unscaled (inside its kernel for fused_optim optimizers), and an overflow
      window changes nothing: no statistics, no step, no τ. Non-finite statistics are skipped.
      A loop that calls ``scaler.unscale_(opt)`` before ``scaler.step`` (to clip), or reads
      ``gain()`` before ``step()``, passes ``grad_scaler=scaler``: the norms were taken scaled,
      and before ``step()`` only the scaler knows the scale. A caller that divides
      the grads by more than the loss scale (a clip coefficient folded into ``grad_scale``, as
      :mod:`mmengine_optim` does) sets ``loss_scale`` next to ``grad_scale`` / ``found_inf``.
    * ``zero_grad()`` starts a new window: a window abandoned without ``step()`` leaves nothing.
    * Frozen params and params without grads are fine. Each micro-batch grad's ‖g‖² is added in
      its hook by the ``sum_squares_`` kernel (no grad is kept: autograd still moves the first
      micro-batch's grads into ``.grad`` without a copy); ``.grad``'s sums take one kernel call.
      The hooks are C++ where the kernels build (no Python call per param and backward pass);
      a backward pass is counted at its first hook, by autograd graph task.
      The local sums live on the params' device (FSDP2's compute device where its params are
      watched), so NCCL can all-reduce them.
    * ``state_dict()`` holds tensors and floats only (``torch.load(weights_only=True)`` works),
      including a window in progress, the scale, smoothing, accumulation count and τ.
    * DTensor params (tensor parallelism: the ranks of the params' mesh hold one model replica)
      are measured as their whole tensors: the hooks and the ``.grad`` sums take the local
      tensors, and at the window's end the shards' sums are added over the mesh dimensions that
      shard them, in one all-reduce per mesh dimension (:mod:`.gradient_stats_rows`). N is 1
      there (the micro-batches come from accumulation).
    * FSDP2 (``fully_shard``) reduce-scatters each backward's grads inside the backward pass and
      sets the shards' ``.grad`` to their average over the ranks; a rank's micro-batch gradient
      exists only as the gradient of the plain tensor FSDP2 unshards a param into for the
      forward. Given ``module=model``, the statistics hook those tensors (forward pre-hooks,
      :mod:`.gradient_stats_fsdp`), pool their sums over the ranks as under DDP (N: the process
      group's size), and sum ``.grad``'s over the shards: the same statistics as DDP's. Without
      ``module``, FSDP2's params are refused at the first ``step()`` (no hook saw a backward).
    * No ``__del__``: the hooks go only with :meth:`unhook` (Lightning discards optimizer
      wrappers, and a ``__del__`` there would remove the live hooks).

    ``scale_invariant_steps`` is τ, the scale-invariant iteration count (Σ of gains).

    Args:
        optimizer: the optimizer to wrap (ours or torch's); its param_groups are shared.
        world_size: N (default: the process group's size, or 1; 1 for DTensor params outside FSDP2).
        scale: S (default N·c).
        smoothing: β (default max(1 − N·c/1000, 0)).
        num_gradients_to_accumulate: c, backward passes per step.
        is_scaled_loss: whether each micro-batch loss was divided by c.
        debias_ewma: bias-corrected EWMA (fairscale's default) or the paper's Appendix B.3.
        global_gain: one gain for all groups (for group layouts that are not model structure,
            e.g. mmengine's ``paramwise_cfg``, which makes a group per param) instead of fairscale's
            gain per group.
        grad_scaler: the ``torch.amp.GradScaler``, needed only when the loop calls
            ``scaler.unscale_(optimizer)`` before ``scaler.step`` (e.g. to clip): the micro-batch
            norms were taken on scaled grads, and then only the scaler knows the scale.
        module: the model, when FSDP2 (``fully_shard``) shards its params (built before this).
    """

    _name = "AdaScale"
    _state_key = "adascale"

    def __init__(self, optimizer: torch.optim.Optimizer, world_size: int | None = None, scale: float | None = None,
                 smoothing: float | None = None, num_gradients_to_accumulate: int = 1, is_scaled_loss: bool = True,
                 debias_ewma: bool = True, grad_scaler: torch.amp.GradScaler | None = None,
                 global_gain: bool = False, module: torch.nn.Module | None = None):
        self._global_gain = global_gain
        self.scale_invariant_steps = 0.0
        self._applied_scale: float | None = None  # the scale of the last step's window (a short one's is smaller)
        super().__init__(optimizer, world_size, scale, smoothing, num_gradients_to_accumulate, is_scaled_loss,
                         debias_ewma, grad_scaler, module)

    def gain(self, pg_idx: int | None = None, scale: float | None = None) -> float:
        """(var + sqr)/(var/S + sqr) of group ``pg_idx``, or with var and sqr summed over groups.

        Between the backward pass that completes a window and ``step()``, this is the gain that
        ``step()`` applies: the window's statistics are already in the averages it reads. After a
        step (until the next window completes) it is the gain that step applied: with its
        window's scale, which is smaller than S for a short window (an epoch's last; kept in the
        state dict). Before the first step, and after :meth:`set_scale`, the scale is S."""
        avg, window_scale = self._current()
        var, sqr = avg[stats.VAR], avg[stats.SQR]
        var, sqr = (sum(var), sum(sqr)) if pg_idx is None else (var[pg_idx], sqr[pg_idx])
        if scale is not None:
            s = scale
        elif window_scale is not None:
            s = window_scale
        else:
            s = self._scale if self._applied_scale is None else self._applied_scale
        return stats.gain(var, sqr, s)

    def _update(self, scale: float, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """The inner step with each group's lr multiplied by its gain (then restored exactly); τ += gain()."""
        gains = [self.gain(None if self._global_gain else gi, scale) for gi in range(len(self.param_groups))]
        lrs = [group["lr"] for group in self.param_groups]
        for group, g in zip(self.param_groups, gains):
            group["lr"] = group["lr"] * g
        try:
            self._inner_step(grad_scale, found_inf)
        finally:
            for group, lr in zip(self.param_groups, lrs):
                group["lr"] = lr
        self.scale_invariant_steps += self.gain(scale=scale)
        self._applied_scale = scale

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        super().set_scale(scale, update_estimate)
        self._applied_scale = None  # gain() now answers for the new S

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus ``"adascale"``: tensors and floats only (the last
        step's window scale: 0 before the first step; a scale is >= 1)."""
        state = super().state_dict()
        state[self._state_key]["scale_invariant_steps"] = self.scale_invariant_steps
        state[self._state_key]["applied_scale"] = self._applied_scale or 0.0
        return state

    def _load_extra(self, saved: dict) -> None:
        self.scale_invariant_steps = float(saved.pop("scale_invariant_steps"))
        applied = float(saved.pop("applied_scale", 0.0))  # (absent from older checkpoints)
        self._applied_scale = applied or None


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer an AdaScale wraps (the one whose ``step`` applies the scaled lrs), or
    ``optimizer`` itself."""
    return optimizer._optimizer if isinstance(optimizer, AdaScale) else optimizer


_handles = itertools.count()
# The live GradientStatistics by handle (counts[HANDLE]), for the window-end op the C++ hooks call.
_WINDOW_OWNERS: weakref.WeakValueDictionary[int, GradientStatistics] = weakref.WeakValueDictionary()


def _window_end(counts: Tensor) -> None:
    """``fused_optim::adascale_window_end``: the end of the backward pass that completed a window."""
    ada = _WINDOW_OWNERS.get(int(counts[HANDLE]))
    if ada is not None:
        ada._window_ended_in_backward()


_ops._lib.impl("adascale_window_end", _window_end, "CPU")


def _queue_window_end(counts: Tensor) -> None:
    """The Python hooks' way to run the window-end op when the current backward pass ends: queued
    twice, like the C++ hooks', so it runs after the callbacks queued later in the pass (DDP's)."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(lambda: _window_end(counts)))


class _NativeHook:
    """The handle of one C++ gradient hook (``grad_norm_hooks``); holds its param weakly, like a
    ``RemovableHandle``."""

    def __init__(self, param: Tensor, position: int):
        self._param, self._position = weakref.ref(param), position

    def remove(self) -> None:
        param = self._param()
        if param is not None:
            _ops.op("remove_grad_hooks")([param], [self._position])


def _native_hooks_work(params: list[Tensor]) -> bool:
    """Whether the C++ hooks serve ``params``: all on one CPU or CUDA device whose kernels build."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        return False
    (device,) = devices
    return device.type in ("cpu", "cuda") and _build.is_available(device.type)
