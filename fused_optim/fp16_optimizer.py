"""``FP16Optimizer``: fp32 master weights and dynamic loss scaling for an fp16 model, with
mlbench-core's API and loss-scale schedule (``mlbench_core/optim/pytorch/fp_optimizers.py``)."""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .norm import multi_tensor_l2norm
from .checks import is_real
from .optimizer import run_closure

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6)


class DynamicLossScaler:
    """mlbench's loss-scale schedule, one call of :meth:`update_scale` per step::

        overflow:                                    scale ← scale / factor ;  last_overflow ← iteration
        else if (iteration − last_overflow) mod window = 0:  scale ← min(scale · factor, max_scale)
        iteration ← iteration + 1                    (iteration starts at 0, last_overflow at −1)

    ``max_scale=None``: no cap. Attributes: ``loss_scale``, ``iteration``, ``last_overflow_iter``
    (mlbench's ``_iter`` and ``_last_overflow_iter``), and the hyperparameters.
    """

    def __init__(self, init_scale: float, scale_factor: float, scale_window: int, max_scale: float | None):
        self.loss_scale = float(init_scale)
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.max_scale = max_scale
        self.iteration = 0
        self.last_overflow_iter = -1

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.loss_scale /= self.scale_factor
            self.last_overflow_iter = self.iteration
        elif (self.iteration - self.last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            if self.max_scale is not None:
                self.loss_scale = min(self.loss_scale, self.max_scale)
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "iteration": self.iteration,
                "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """All or nothing: a state missing a key raises before any attribute changes."""
        values = float(state["loss_scale"]), int(state["iteration"]), int(state["last_overflow_iter"])
        self.loss_scale, self.iteration, self.last_overflow_iter = values


class FP16Optimizer:
    r"""Trains an fp16 model through fp32 master weights with dynamic loss scaling.

    One training step (s the loss scale, m ``multiplier``, D the averaging divisor: ``world_size``
    with ``average_world``, ``denom`` with ``average_custom``)::

        backward_loss(loss):  (loss · s).backward()                    → fp16 grads g of the model
        step():
            world_size > 1:   g ← all_reduce_sum(g / D if divide_before else g)     (in fp16)
            q = s·m·D  (s·m when divide_before already divided, with world_size > 1)
            N = ‖g‖ / q                         (the unscaled grad norm; ‖g‖ from the fp16 grads)
            overflow = N not finite
            overflow:  scaler.update_scale(True)     (s shrinks; see DynamicLossScaler)
                       raise if s ≤ min_scale; else change nothing more and return False
            master.grad ← fp32(g) / q
            master.grad ← master.grad · grad_clip / (N + 1e-6)     if that factor is < 1
            inner_optimizer.step()              (on the fp32 masters)
            scaler.update_scale(False)          (after the inner step: a step that raises leaves s as it was)
            fp16 params ← fp16(masters)         (round to nearest even); return True

    The masters are one fp32 tensor per fp16 param by default (``fp32_params`` is their list, in
    the order of ``fp16_model.parameters()``, frozen params left out), so a layer-wise optimizer
    (LARS, LAMB) computes one trust ratio per layer. ``flatten=True`` is mlbench's single flat
    master (``fp32_params`` one Parameter): a layer-wise optimizer then sees the whole model as
    one tensor and computes a single trust ratio. For elementwise optimizers (SGD, Adam, …) the
    two layouts give the same update. The inner optimizer is any optimizer over ``fp32_params``
    (this package's or torch.optim's), given to :meth:`set_optimizer`.

    ‖g‖ is the multi-tensor norm kernel over the fp16 grads (one pass, fp32/fp64 accumulation;
    ``fused`` as in :func:`fused_optim.multi_tensor_l2norm`): the finite check and the clipping
    norm at once, read from half the bytes of the fp32 grads. An overflow step stops there, before
    any fp32 work.

    Deviations from mlbench-core 3.0.0's ``FP16Optimizer`` (its bugs are not copied):

    * Defaults: mlbench's ``average_world=False, average_custom=False`` raise
      ``NotImplementedError``; here ``average_world=True``. Both False or both True is a
      ``ValueError`` (mlbench silently takes ``average_world``).
    * ``backward_loss`` does not multiply the caller's loss in place (mlbench's ``loss *= scale``
      leaves the caller holding the scaled loss, e.g. for logging).
    * ``step(closure)`` runs the closure first, under ``torch.enable_grad()`` (it zeroes the grads,
      runs the forward and ``backward_loss``); mlbench hands it to the inner optimizer after the
      grads were read, so its backward never reaches the masters. Its loss is not returned: ``step``
      returns whether it updated, as mlbench's.
    * A param without a grad (unused in the forward) makes mlbench fail (``p.grad.data`` of None,
      in the copy and in the aggregation), and so does a frozen param (the aggregation packs every
      param's grad). Here frozen params have no master; a missing grad counts as zero with
      ``flatten=True`` or ``world_size > 1`` (one flat tensor or one all-reduce needs every slice),
      and otherwise leaves its master's grad None, so the inner optimizer skips it.
    * mlbench copies grads with ``.view(-1)``, which fails on non-contiguous grads; here any layout.
    * Averaging by ``world_size`` or ``denom`` divides the fp32 grads (folded into the unscale q),
      not the fp16 ones: mlbench divides in fp16 even when nothing is reduced (``world_size=1``
      with ``average_custom``), where small quotients round or underflow. ``divide_before=True``
      with ``world_size > 1`` divides the fp16 grads before the all-reduce, as mlbench (its purpose
      is to keep the fp16 sum from overflowing). The model's ``.grad`` are never modified (mlbench
      replaces them by the reduced ones).
    * The norm for clipping and the overflow check is ‖g‖/q with ‖g‖ taken over the fp16 grads;
      mlbench norms the unscaled fp32 grads (``clip_grad_norm_``). Both are finite exactly when
      every grad is; the clip factor may differ in the last bits (different summation order).
    * The scale reaching ``min_scale`` raises ``RuntimeError`` with a hint (mlbench: a bare
      ``Exception``). ``step`` without :meth:`set_optimizer` (mlbench: ``AttributeError`` on None)
      and an inner optimizer over other params than the masters are clear errors.
    * Hyperparameters are validated (mlbench accepts e.g. ``scale_window=0`` and divides by zero at
      the first step), and ``world_size`` must match the process group.
    * ``state_dict()`` / ``load_state_dict()`` save and restore the scaler, the masters and the
      inner optimizer (mlbench has none: a resumed run restarts at ``init_scale`` from masters
      rounded to fp16).
    * mlbench's ``use_cuda``, ``use_horovod`` and ``by_layer`` arguments (positional there, between
      ``world_size`` and ``grad_clip``) and ``step``'s ``tracker`` are dropped: reductions run on
      the grads' device, torch.distributed only, all grads in one all-reduce.

    Args:
        fp16_model: the model, already cast to fp16 (or bf16; any floating dtype works).
        world_size: processes averaging their grads; > 1 needs ``torch.distributed`` initialized
            with that many ranks (no DDP: this all-reduces the grads itself).
        grad_clip: max L2 norm of the unscaled grads (``inf``: no clipping).
        init_scale, scale_factor, scale_window, max_scale: the loss-scale schedule above.
        min_scale: an overflow that brings the scale to ``min_scale`` or below raises.
        average_world: divide the summed grads by ``world_size``.
        average_custom: divide them by the ``denom`` given to :meth:`step` instead.
        divide_before: with ``world_size > 1``, divide the fp16 grads before the all-reduce.
        flatten: one flat fp32 master (mlbench's layout) instead of one per param.
        fused: for the norm kernel: None (kernel where it builds), True (required), False (torch).
    """

    def __init__(self, fp16_model: torch.nn.Module, world_size: int = 1, grad_clip: float = float("inf"),
                 init_scale: float = 1024, scale_factor: float = 2, scale_window: int = 128,
                 max_scale: float | None = None, min_scale: float = 1e-4, average_world: bool = True,
                 average_custom: bool = False, divide_before: bool = False, *, flatten: bool = False,
                 fused: bool | None = None):
        _check_options(world_size, grad_clip, init_scale, scale_factor, scale_window, max_scale, min_scale,
                       average_world, average_custom, divide_before, flatten, fused)
        self.fp16_model = fp16_model
        self.params = [p for p in fp16_model.parameters() if p.requires_grad]  # those with a master
        _check_params(self.params, flatten)
        self.world_size = world_size
        self.grad_clip = grad_clip
        self.min_scale = min_scale
        self.average_world = average_world
        self.average_custom = average_custom
        self.divide_before = divide_before
        self.flatten = flatten
        self.fused = fused
        self.loss_scaler = DynamicLossScaler(init_scale, scale_factor, scale_window, max_scale)
        self.optimizer = None
        with torch.no_grad():
            if flatten:
                flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
                self.fp32_params: torch.nn.Parameter | list[torch.nn.Parameter] = torch.nn.Parameter(flat)
                self._masters = [self.fp32_params]
            else:
                self.fp32_params = [torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device=p.device)
                                                       .copy_(p)) for p in self.params]
                self._masters = self.fp32_params
        # the master of each fp16 param, shaped like it (views into the flat master with flatten=True)
        self._master_views = self._views(self.fp32_params.detach()) if flatten else [m.detach() for m in self._masters]

    def _views(self, flat: Tensor) -> list[Tensor]:
        """``flat`` cut into one view per fp16 param, shaped like it."""
        return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in self.params]), self.params)]

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps the masters: built over ``fp32_params`` (e.g.
        ``FusedAdam(fp16_opt.fp32_params)``, or ``Adam([fp16_opt.fp32_params])`` with
        ``flatten=True``)."""
        masters = {id(m) for m in self._masters}
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in masters:
                    raise ValueError(
                        f"set_optimizer: param {i} of group {g} of the optimizer is not one of this FP16Optimizer's "
                        "fp32_params; build the optimizer over the fp32 masters: Optimizer(fp16_opt.fp32_params) "
                        "(with flatten=True: Optimizer([fp16_opt.fp32_params])), not over the fp16 model's params")
        self.optimizer = optimizer

    def backward_loss(self, loss: Tensor) -> None:
        """``(loss · loss_scale).backward()``: the fp16 model's grads are the scaled grads."""
        (loss * self.loss_scaler.loss_scale).backward()

    def step(self, closure: Callable[[], Any] | None = None, *, multiplier: float = 1.0,
             denom: float | Tensor | None = None) -> bool:
        """One step (the rule in the class docstring); returns whether the masters were updated
        (False: an overflow step, skipped, with a smaller loss scale).

        Args:
            closure: run first under ``torch.enable_grad()`` (zero the grads, forward,
                :meth:`backward_loss`); its return value is not used.
            multiplier: the grads are divided by ``loss_scale · multiplier`` (mlbench's).
            denom: the divisor of ``average_custom`` (a number or one-element tensor, ≠ 0).
        """
        if self.optimizer is None:
            raise RuntimeError("FP16Optimizer.step: no inner optimizer; call set_optimizer(optimizer) with an "
                               "optimizer over fp16_opt.fp32_params first")
        run_closure(closure)
        divisor = self._averaging_divisor(denom)
        if not (_number(multiplier) and math.isfinite(multiplier) and multiplier > 0):
            raise ValueError(f"FP16Optimizer.step: invalid multiplier {multiplier!r} (a finite number > 0)")
        grads = self._grads(divisor)
        q = self.loss_scaler.loss_scale * multiplier * (1.0 if self.divide_before and self.world_size > 1 else divisor)
        present = [g for g in grads if g is not None]
        norm = float(multi_tensor_l2norm(present, fused=self.fused)) / q if present else 0.0
        if not math.isfinite(norm):
            self.loss_scaler.update_scale(True)
            if self.loss_scaler.loss_scale <= self.min_scale:
                raise RuntimeError(
                    f"FP16Optimizer: the loss scale fell to {self.loss_scaler.loss_scale} <= min_scale="
                    f"{self.min_scale}: the grads are not finite even at a tiny scale (a NaN or inf in the loss, "
                    "the inputs or the weights?); check the model, or lower min_scale")
            return False
        self._unscale_into_masters(grads, q, norm)
        self.optimizer.step()
        self.loss_scaler.update_scale(False)
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], self._master_views)
        return True

    def _averaging_divisor(self, denom: float | Tensor | None) -> float:
        """D: ``world_size`` (average_world) or ``denom`` (average_custom)."""
        if not self.average_custom:
            return float(self.world_size)
        if denom is None:
            raise ValueError("FP16Optimizer.step: average_custom=True needs denom=<the divisor of the summed grads>")
        one_number = _number(denom) or (isinstance(denom, Tensor) and denom.numel() == 1)
        value = float(denom) if one_number else math.nan
        if value == 0 or not math.isfinite(value):
            raise ValueError(f"FP16Optimizer.step: invalid denom {denom!r} (average_custom divides by it: a finite "
                             "number ≠ 0, or a one-element tensor)")
        return value

    def _grads(self, divisor: float) -> list[Tensor | None]:
        """The fp16 grads of ``self.params`` (None where missing), all-reduced over the process
        group when ``world_size > 1``: packed into one buffer (zeros for missing grads), divided
        by D first with ``divide_before``, summed in place."""
        grads = [p.grad for p in self.params]
        for i, g in enumerate(grads):
            if g is not None and g.is_sparse:
                raise RuntimeError(f"FP16Optimizer: the grad of param {i} is sparse; only dense grads are supported")
        if self.world_size == 1:
            return grads
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in self.params])  # (fp16, or fp32 if mixed)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                          for p, g in zip(self.params, grads)])
        if self.divide_before:
            flat.div_(divisor)
        dist.all_reduce(flat)
        return self._views(flat)

    def _unscale_into_masters(self, grads: list[Tensor | None], q: float, norm: float) -> None:
        """master.grad ← fp32(g) / q, times the clip factor when it is < 1; masters of missing
        grads get a zero grad (flat master) or None (per-param masters)."""
        if self.flatten:
            flat = self.fp32_params
            if flat.grad is None:
                flat.grad = torch.empty_like(flat)
            targets = self._views(flat.grad)
            for t, g in zip(targets, grads):
                if g is None:
                    t.zero_()
        else:
            for m, g in zip(self._masters, grads):
                if g is None:
                    m.grad = None
                elif m.grad is None:
                    m.grad = torch.empty_like(m)
            targets = [m.grad for m in self._masters]
        pairs = [(t, g) for t, g in zip(targets, grads) if g is not None]
        if not pairs:
            return
        targets, sources = map(list, zip(*pairs))
        torch._foreach_copy_(targets, sources)
        torch._foreach_div_(targets, q)
        coef = self.grad_clip / (norm + _CLIP_EPS)
        if coef < 1.0:
            torch._foreach_mul_(targets, coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or set to None) the masters' grads and the fp16 model's grads."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        self.fp16_model.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, the masters and the inner optimizer's state dict: tensors and
        Python scalars only (``torch.load(weights_only=True)`` works)."""
        return {"loss_scaler": self.loss_scaler.state_dict(), "flatten": self.flatten,
                "fp32_params": [m.detach().clone() for m in self._masters],
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved (call :meth:`set_optimizer` first when it saved
        an inner optimizer); the fp16 params are set to the loaded masters, rounded. A state that
        does not fit raises before anything changes: the inner optimizer's state (which torch checks
        before it loads) goes in first, the masters and the scaler after it."""
        masters = state["fp32_params"]
        if bool(state["flatten"]) != self.flatten or [m.shape for m in masters] != [m.shape for m in self._masters]:
            saved = "one flat master" if state["flatten"] else f"{len(masters)} per-param masters"
            raise ValueError(f"FP16Optimizer.load_state_dict: the state holds {saved} of shapes "
                             f"{[tuple(m.shape) for m in masters]}; this optimizer has "
                             f"{[tuple(m.shape) for m in self._masters]} (flatten={self.flatten}): build it on the "
                             "same model with the same flatten")
        if state["optimizer"] is not None and self.optimizer is None:
            raise RuntimeError("FP16Optimizer.load_state_dict: the state holds an inner optimizer's state; "
                               "call set_optimizer(optimizer) first")
        copy.copy(self.loss_scaler).load_state_dict(state["loss_scaler"])  # raises for a bad scaler state
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            torch._foreach_copy_([m.detach() for m in self._masters],
                                 [s.to(m.device) for s, m in zip(masters, self._masters)])
            torch._foreach_copy_([p.detach() for p in self.params], self._master_views)
        self.loss_scaler.load_state_dict(state["loss_scaler"])


def _number(value: Any) -> bool:
    """A real number that is not a bool (``True`` would pass for 1)."""
    return is_real(value) and not isinstance(value, bool)


def _need(name: str, value: Any, ok: bool, what: str) -> None:
    """A ValueError naming the argument and what it needs, unless ``ok``."""
    if not ok:
        raise ValueError(f"FP16Optimizer: invalid {name}={value!r} ({what})")


def _check_options(world_size, grad_clip, init_scale, scale_factor, scale_window, max_scale, min_scale,
                   average_world, average_custom, divide_before, flatten, fused) -> None:
    """ValueErrors naming the argument and what it needs."""
    _need("world_size", world_size, isinstance(world_size, int) and not isinstance(world_size, bool)
          and world_size >= 1, "an int >= 1")
    _need("grad_clip", grad_clip, _number(grad_clip) and grad_clip > 0,
          "a number > 0; float('inf') for no clipping (mlbench's positional use_cuda is not an argument here)")
    _check_loss_scaling(init_scale, scale_factor, scale_window, max_scale, min_scale)
    for name, value in [("average_world", average_world), ("average_custom", average_custom),
                        ("divide_before", divide_before), ("flatten", flatten)]:
        _need(name, value, isinstance(value, bool), "True or False")
    _need("fused", fused, fused is None or isinstance(fused, bool), "None, True or False")
    if average_world == average_custom:
        raise ValueError(f"FP16Optimizer: average_world={average_world} and average_custom={average_custom}: give "
                         "exactly one of them True (average_world divides the summed grads by world_size, "
                         "average_custom by the denom given to step())")
    if world_size > 1:
        _check_process_group(world_size)


def _check_loss_scaling(init_scale, scale_factor, scale_window, max_scale, min_scale) -> None:
    """The dynamic loss scaler's options."""
    _need("init_scale", init_scale, _number(init_scale) and 0 < init_scale < math.inf, "a finite number > 0")
    _need("scale_factor", scale_factor, _number(scale_factor) and 1 < scale_factor < math.inf,
          "a finite number > 1")
    _need("scale_window", scale_window, isinstance(scale_window, int) and not isinstance(scale_window, bool)
          and scale_window >= 1, "an int >= 1")
    _need("max_scale", max_scale, max_scale is None or (_number(max_scale) and max_scale > 0),
          "None or a number > 0")
    _need("min_scale", min_scale, _number(min_scale) and 0 <= min_scale < math.inf, "a finite number >= 0")


def _check_process_group(world_size: int) -> None:
    """A world size above 1 is the initialized process group's."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"FP16Optimizer: world_size={world_size} needs torch.distributed initialized first "
                           "(torch.distributed.init_process_group)")
    _need("world_size", world_size, world_size == dist.get_world_size(),
          f"the process group has {dist.get_world_size()} ranks")


def _check_params(params: list[Tensor], flatten: bool) -> None:
    if not params:
        raise ValueError("FP16Optimizer: fp16_model has no parameter that requires grad")
    for i, p in enumerate(params):
        if not p.is_floating_point():
            raise ValueError(f"FP16Optimizer: param {i} of fp16_model is {p.dtype}; only floating-point params "
                             "can have fp32 masters")
    if flatten and len({p.device for p in params}) > 1:
        raise ValueError("FP16Optimizer: flatten=True needs every param on one device; the model's are on "
                         f"{sorted({str(p.device) for p in params})} (use flatten=False)")
