"""FusedSGD: torch.optim.SGD's update (and apex/ColossalAI FusedSGD's) in one kernel call per bucket."""

from __future__ import annotations

import torch

from .checks import check_flag, check_lr, check_nonnegative
from .optimizer import FusedOptimizer
from .param_state import state_like


class MomentumOptimizer(FusedOptimizer):
    """Base of the SGD family (SGD, SignSGD, LARS, ColossalLars): torch.optim.SGD's ``momentum_buffer``
    state and first-step flags, and validation of lr, momentum, dampening, weight decay and
    nesterov (the keys a group has)."""

    def _validate(self, group: dict) -> None:
        check_lr(group["lr"])
        for name in ("momentum", "dampening", "weight_decay"):
            if name in group:
                check_nonnegative(name, group[name])
        if group.get("nesterov") and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                f"Invalid nesterov value: True with momentum={group['momentum']}, dampening={group['dampening']} "
                "(Nesterov momentum requires momentum > 0 and dampening = 0)"
            )

    def _layout(self, group: dict) -> tuple:
        return (group["momentum"] != 0,)

    def _init_state(self, p, state, group) -> None:
        # None is torch.optim.SGD's "no buffer yet" (a param that never stepped with momentum).
        if group["momentum"] != 0 and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.empty_like(state_like(p, state), memory_format=torch.contiguous_format)


def _master_weights_flag(master_weights: bool | None, materialize_master_grads: bool) -> bool:
    """``master_weights``, or apex's ``materialize_master_grads=False`` saying the same; both
    given, they must agree."""
    check_flag("materialize_master_grads", materialize_master_grads)
    if master_weights is None:
        return not materialize_master_grads
    check_flag("master_weights", master_weights)
    if not materialize_master_grads and not master_weights:
        raise ValueError("Invalid master_weights value: False contradicts materialize_master_grads=False (which "
                         "means master weights); give one of them")
    return bool(master_weights)


class FusedSGD(MomentumOptimizer):
    r"""apex/ColossalAI ``FusedSGD``: their signature and defaults (``lr`` required,
    ``set_grad_none=False``, ``wd_after_momentum``). For ``torch.optim.SGD``'s use :class:`SGD`.

    Stochastic gradient descent with momentum, fused over all tensors of a param group.

    Update rule, per parameter p with gradient g (λ weight_decay, μ momentum, d dampening, η lr)::

        g ← −g                            if maximize
        g ← g + λ·p                       if λ ≠ 0 and not wd_after_momentum
        if μ ≠ 0:
            buf ← g                       on this param's first step (no dampening)
            buf ← μ·buf + (1 − d)·g       afterwards
            g   ← g + μ·buf if nesterov else buf
        g ← g + λ·p                       if λ ≠ 0 and wd_after_momentum (not stored in buf)
        p ← p − η·g

    With ``wd_after_momentum=False`` (default) this is ``torch.optim.SGD`` exactly (same state
    name ``momentum_buffer``, interchangeable state dicts). Deviation from apex/ColossalAI: the
    first step is detected per parameter, not from the last param of a launch, so a param whose
    grad appears late does not reset the others' buffers.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate η (>= 0; None: each param group gives its own).
        momentum, dampening, weight_decay: μ, d, λ (>= 0).
        nesterov: Nesterov momentum (needs μ > 0 and d = 0).
        wd_after_momentum: add the weight decay after the momentum update (apex option).
        materialize_master_grads: apex/ColossalAI's flag: False means master weights (the kernel
            reads the fp16 grads and updates fp32 masters, materializing no fp32 grads), i.e.
            ``master_weights=True``; True (default) leaves ``master_weights`` to decide.
        set_grad_none: default of ``zero_grad(set_to_none=None)`` (apex's default: False).
        maximize: maximize the objective instead of minimizing it.
        master_weights: fp32 master weights for fp16/bf16 params (see :class:`FusedOptimizer`);
            None (default): ``not materialize_master_grads``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
    """

    op_name = "sgd_"
    extra_flags = ("materialize_master_grads",)

    def __init__(self, params, lr: float | None = None, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False, *,
                 maximize: bool = False, master_weights: bool | None = None, fused: bool | None = None,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, wd_after_momentum=wd_after_momentum, maximize=maximize,
                        materialize_master_grads=materialize_master_grads)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none,
                         master_weights=_master_weights_flag(master_weights, materialize_master_grads),
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)
