"""mmengine OptimWrappers for fused_optim: ``FusedOptimWrapper`` and ``AdaScaleOptimWrapper``.

Both keep mmengine's accumulation (``accumulative_counts``, the loss divided by the window length,
``no_sync`` inside a window, the short final window) and add what a fused optimizer makes cheap:

* clipping by the global L2 norm from one ``multi_tensor_l2norm`` pass, with the clip
  coefficient folded into the divisor the kernels apply (no pass that rewrites the grads);
* mixed precision (``loss_scale``, ``dtype``) on any device, CPU included: the loss is scaled, the
  same norm pass finds overflows, and the optimizer's kernels unscale inside their update
  (``grad_scale`` / ``found_inf``, the ``torch.amp.GradScaler`` contract).
"""

from __future__ import annotations

import logging
import numbers
from contextlib import contextmanager

import torch
from mmengine.logging import print_log
from mmengine.optim import OptimWrapper
from typing_extensions import override

from fused_optim import AdaScale, multi_tensor_l2norm
from fused_optim.metrics import GAIN, LR, TAU

from ._compat import accumulative_counts, calling_runner
from .hooks import warn_if_checkpoints_split_windows, warn_if_schedules_count_micro_batches
from .loss_scaler import LossScaler

_NORM_CLIP_KEYS = {"max_norm", "norm_type", "error_if_nonfinite", "foreach"}


class FusedOptimWrapper(OptimWrapper):
    r"""``OptimWrapper`` whose clipping and mixed precision run inside fused_optim's kernels.

    Per update, with loss scale s (1 without ``loss_scale``) and the grads g as backward left
    them (scaled by s)::

        n = ‖g‖₂ / s                               (one fused pass; logged as train/grad_norm)
        found_inf = n is not finite                (the step is skipped; a dynamic s backs off)
        c = min(1, max_norm / (n + 1e-6))          (clip_grad=dict(max_norm=...), as torch)
        optimizer.step() with grad_scale = s / c   (the kernels update with g·c/s)

    and the kernels leave g·c/s in ``.grad`` (what mmengine's ``AmpOptimWrapper`` leaves after its
    unscale and in-place clip), written in their update pass.

    ``clip_grad=dict(type='value', clip_value=v)`` clamps the scaled grads at ±v·s first.

    Args:
        optimizer: a fused_optim optimizer (or any whose step honours ``grad_scale`` /
            ``found_inf``, e.g. torch's with ``fused=True``; others only without clipping and
            loss scaling).
        accumulative_counts: micro-batches per update (mmengine's meaning).
        clip_grad: ``dict(max_norm=..., norm_type=2)`` (L2 only) or ``dict(type='value',
            clip_value=...)``.
        loss_scale: None (no scaling), ``'dynamic'``, a float (static), or a dict of
            ``torch.amp.GradScaler`` arguments; the state is saved as ``'loss_scaler'``.
        dtype: autocast dtype in :meth:`optim_context` (``'float16'``, ``'bfloat16'`` or a
            ``torch.dtype``); default float16 when ``loss_scale`` is set, else no autocast.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accumulative_counts: int = 1, clip_grad: dict | None = None,
                 loss_scale: str | float | dict | None = None, dtype: str | torch.dtype | None = None):
        super().__init__(optimizer, accumulative_counts, dict(clip_grad) if clip_grad else clip_grad)
        self._clip_norm = bool(self.clip_grad_kwargs) and self.grad_name == "grad_norm"
        if self._clip_norm:
            _check_norm_clip(self.clip_grad_kwargs)
        self.loss_scaler = None if loss_scale is None else LossScaler.from_config(loss_scale)
        self.cast_dtype = _dtype(dtype, torch.float16 if loss_scale is not None else None)
        if (self._clip_norm or self.loss_scaler) and not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise TypeError(
                f"{type(self).__name__}: clip_grad by norm and loss_scale need an optimizer that unscales inside "
                f"its step (grad_scale / found_inf); {type(optimizer).__name__} does not. Use a fused_optim "
                "optimizer (type='mmengine_optim.FusedSGD', ...) or mmengine's OptimWrapper"
            )

    @contextmanager
    @override
    def optim_context(self, model: torch.nn.Module):
        """mmengine's (``no_sync`` inside a window) plus autocast to ``dtype`` when set."""
        with super().optim_context(model):
            if self.cast_dtype is None:
                yield
            else:
                device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
                with torch.autocast(device.type, dtype=self.cast_dtype):
                    yield

    @override
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """mmengine's, on the loss times the loss scale (when there is one)."""
        super().backward(loss if self.loss_scaler is None else self.loss_scaler.scale(loss), **kwargs)

    @override
    def step(self, **kwargs) -> None:
        """Clip and unscale inside the optimizer's step (see the class docstring)."""
        if not self._clip_norm and self.loss_scaler is None:
            super().step(**kwargs)  # mmengine's: clipping by value (if asked), then the optimizer's step
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        if not grads:
            self.optimizer.step(**kwargs)
            return
        s = (self.loss_scaler.scale_tensor(grads[0].device) if self.loss_scaler is not None
             else torch.ones((), device=grads[0].device))
        norm = multi_tensor_l2norm(grads).to(s) / s
        found_inf = (~torch.isfinite(norm)).to(s)
        divisor = s
        if self._clip_norm:
            self._check_finite(norm)
            self.message_hub.update_scalar("train/grad_norm", float(norm))
            divisor = s / (self.clip_grad_kwargs["max_norm"] / (norm + 1e-6)).clamp(max=1.0)
        elif self.clip_grad_kwargs:  # by value, on the scaled grads
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_kwargs["clip_value"] * float(s))
        self._amp_step(divisor, found_inf, s, **kwargs)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)

    def _amp_step(self, divisor: torch.Tensor, found_inf: torch.Tensor, loss_scale: torch.Tensor, **kwargs) -> None:
        opt = self.optimizer
        opt.grad_scale, opt.found_inf, opt.loss_scale = divisor, found_inf, loss_scale
        try:
            opt.step(**kwargs)
        finally:
            del opt.grad_scale, opt.found_inf, opt.loss_scale

    def _check_finite(self, norm: torch.Tensor) -> None:
        """Without a loss scale (where overflow is routine) a non-finite norm raises with
        ``error_if_nonfinite``, else skips the update with a warning (torch's clipping would write
        NaN into every param)."""
        if self.loss_scaler is not None or bool(torch.isfinite(norm)):
            return
        if self.clip_grad_kwargs.get("error_if_nonfinite", False):
            raise RuntimeError(f"The total norm of the gradients is {float(norm)} (error_if_nonfinite=True in "
                               "clip_grad); this update is not applied")
        print_log(f"FusedOptimWrapper: the gradient norm is {float(norm)}; this update is skipped",
                  logger="current", level=logging.WARNING)

    @override
    def initialize_count_status(self, model: torch.nn.Module, init_counts: int, max_counts: int) -> None:
        """mmengine's; called by ``Runner.train`` once its hooks and schedulers are built, where the
        checks of :meth:`check_runner` run. An optim wrapper gets no handle on the runner:
        :func:`~mmengine_optim._compat.calling_runner` finds it."""
        super().initialize_count_status(model, init_counts, max_counts)
        runner = calling_runner()
        if runner is not None:
            self.check_runner(runner)

    def check_runner(self, runner) -> None:
        """Warn about what the runner's hooks would get wrong with this wrapper: checkpoints saved
        inside accumulation windows (:func:`~mmengine_optim.hooks.warn_if_checkpoints_split_windows`)."""
        warn_if_checkpoints_split_windows(runner, accumulative_counts(self))

    @override
    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        """The optimizer's state (torch checks it before loading), then the loss scaler's: a state
        that does not fit raises before either changes."""
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop("loss_scaler", None)
        if scaler_state is not None and self.loss_scaler is not None:
            LossScaler().load_state_dict(scaler_state)  # raises for a bad scaler state
        super().load_state_dict(state_dict)
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler_state)


class AdaScaleOptimWrapper(FusedOptimWrapper):
    r"""AdaScale (:class:`fused_optim.AdaScale`) for mmengine: ``accumulative_counts`` is its
    accumulation count c, the process group gives N, and every param group gets one global gain
    (mmengine's ``paramwise_cfg`` makes a group per param; fairscale's per-group gains would then
    be per-tensor noise). Per update the lr is multiplied by the gain for the step, then restored;
    τ (``scale_invariant_iter``) += gain. The logged ``lr`` stays the scheduled one; per update the
    message hub gets ``train/adascale/gain``, ``train/adascale/tau`` and ``train/adascale/lr`` (the
    first group's lr × gain; the names of :mod:`fused_optim.metrics`, which the loggers show without
    ``train/``). The statistics, τ and the loss scale are in the checkpoint; a
    resumed run starts a new accumulation window (mmengine does not save grads).

    Use :class:`mmengine_optim.UpdateParamSchedulerHook` so iteration-based schedules follow ⌊τ⌋;
    with mmengine's ``ParamSchedulerHook`` (they would count micro-batches) training warns once.

    Args:
        optimizer: the optimizer to scale (the config's ``optimizer``).
        accumulative_counts: c, micro-batches per update (N·c > 1 is needed).
        scale: S (default N·c).
        smoothing: β (default max(1 − N·c/1000, 0)).
        debias_ewma: bias-corrected EWMA (fairscale's default) or the paper's Appendix B.3.
        world_size: N (default: the process group's size, or 1).
        clip_grad, loss_scale, dtype: as :class:`FusedOptimWrapper` (AdaScale's statistics use
            the unclipped, unscaled grads).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accumulative_counts: int = 1, scale: float | None = None,
                 smoothing: float | None = None, debias_ewma: bool = True, world_size: int | None = None,
                 clip_grad: dict | None = None, loss_scale: str | float | dict | None = None,
                 dtype: str | torch.dtype | None = None):
        try:
            adascale = AdaScale(optimizer, world_size=world_size, scale=scale, smoothing=smoothing,
                                num_gradients_to_accumulate=accumulative_counts, is_scaled_loss=True,
                                debias_ewma=debias_ewma, global_gain=True)
        except RuntimeError as err:
            raise RuntimeError(f"{err}. In mmengine: optim_wrapper=dict(type='mmengine_optim.AdaScaleOptimWrapper', "
                               "accumulative_counts=4, ...), or more ranks") from None
        super().__init__(adascale, accumulative_counts, clip_grad, loss_scale, dtype)

    @property
    def scale_invariant_iter(self) -> float:
        """τ: the sum of the gains of all updates so far."""
        return self.optimizer.scale_invariant_steps

    @property
    def gain(self) -> float:
        """The current global gain estimate."""
        return self.optimizer.gain()

    @override
    def step(self, **kwargs) -> None:
        tau = self.scale_invariant_iter
        super().step(**kwargs)
        gain = self.scale_invariant_iter - tau
        if gain:  # 0 when an overflow skipped the update
            for name, value in ((GAIN, gain), (TAU, self.scale_invariant_iter),
                                (LR, self.optimizer.param_groups[0]["lr"] * gain)):
                self.message_hub.update_scalar(f"train/{name}", value)

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.optimizer.zero_grad()  # the saved window's grads are not in the checkpoint

    @override
    def check_runner(self, runner) -> None:
        """Also: iteration-based schedules stepped per micro-batch
        (:func:`~mmengine_optim.hooks.warn_if_schedules_count_micro_batches`)."""
        super().check_runner(runner)
        warn_if_schedules_count_micro_batches(runner)


def _check_norm_clip(kwargs: dict) -> None:
    unknown = set(kwargs) - _NORM_CLIP_KEYS
    if unknown or "max_norm" not in kwargs:
        raise TypeError(f"clip_grad: takes max_norm (required), norm_type, error_if_nonfinite; got {sorted(kwargs)}")
    max_norm = kwargs["max_norm"]
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ValueError(f"clip_grad: max_norm={max_norm!r} is not a number > 0 (the largest L2 norm of the grads)")
    if float(kwargs.get("norm_type", 2.0)) != 2.0:
        raise ValueError(f"clip_grad: norm_type={kwargs['norm_type']!r} is not supported: the fused norm is the L2 "
                         "norm (norm_type=2); use mmengine's OptimWrapper for other norms")


def _dtype(dtype: str | torch.dtype | None, default: torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return default
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float16, torch.bfloat16):
        raise ValueError(f"Invalid dtype: {dtype!r} ('float16' or 'bfloat16', the autocast dtype)")
    return resolved
