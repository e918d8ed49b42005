"""Layer-wise adaptive rate scaling: LARS (quadra, with timm's options) and ColossalLars (ColossalAI's
``Lars``, also importable under that name)."""

from __future__ import annotations

from . import fsdp1
from .checks import check_nonnegative
from .sgd import MomentumOptimizer


class LARS(MomentumOptimizer):
    r"""LARS: SGD whose gradient is rescaled per tensor by a trust ratio, fused over a whole group.

    Update rule, per parameter p with gradient g (λ weight_decay, μ momentum, d dampening, η lr,
    tc trust_coefficient; ‖·‖ the L2 norm of the whole tensor)::

        if (λ ≠ 0 or always_adapt) and ‖p‖ ≠ 0 and ‖g‖ ≠ 0:
            r ← tc·‖p‖ / (‖g‖ + λ·‖p‖ + eps)
            r ← min(r/η, 1)              if trust_clip (LARC)
            g ← (g + λ·p)·r
        (otherwise g is used as it is: no decay, no scaling)
        if μ ≠ 0:
            buf ← g                      on this param's first step
            buf ← μ·buf + (1 − d)·g      afterwards
            g   ← g + μ·buf if nesterov else buf
        p ← p − η·g

    This is quadra's ``LARS`` (You et al., "Large Batch Training of Convolutional Networks",
    2017) and timm's ``Lars`` with its ``trust_clip`` / ``always_adapt`` options, except at a
    zero norm, where timm still adds the weight decay and quadra (and we) use the raw gradient.
    Groups with λ = 0 (biases, norms) are neither scaled nor decayed unless ``always_adapt``.
    The norms are computed inside the kernel (no host sync per tensor). State: ``momentum_buffer``.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate η (>= 0; None: each param group gives its own).
        momentum, dampening, weight_decay: μ, d, λ (>= 0).
        nesterov: Nesterov momentum (needs μ > 0 and d = 0).
        trust_coefficient: tc (>= 0). eps: added to the denominator (>= 0).
        trust_clip: clip the ratio to η (LARC). always_adapt: scale groups with λ = 0 too.
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
    """

    op_name = "lars_"
    whole_tensor_rule = ("computes a trust ratio from the norms of each whole tensor", fsdp1.INSTEAD)

    def __init__(self, params, lr: float | None = None, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, trust_coefficient: float = 0.001,
                 eps: float = 1e-8, *, trust_clip: bool = False, always_adapt: bool = False,
                 set_grad_none: bool = True, master_weights: bool = False, fused: bool | None = None,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, trust_coefficient=trust_coefficient, eps=eps,
                        trust_clip=trust_clip, always_adapt=always_adapt)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)

    def _validate(self, group: dict) -> None:
        super()._validate(group)
        check_nonnegative("trust_coefficient", group["trust_coefficient"])
        check_nonnegative("epsilon", group["eps"])


class ColossalLars(MomentumOptimizer):
    r"""ColossalAI's ``Lars``: the trust ratio scales the learning rate, the direction is clamped. Also
    importable as :data:`Lars`, ColossalAI's class name.

    Update rule, per parameter p with gradient g (λ weight_decay, μ momentum, η lr)::

        if the group's lars flag (default True):
            r ← eeta·‖p‖ / (‖g‖ + λ·‖p‖ + epsilon)   if ‖p‖ > 0 and ‖g‖ > 0, else 1
            η_t ← η·clamp(r, 0, 50) ;  d ← g + λ·p
        else:
            η_t ← η ;  d ← g
        d ← clamp(d, −10, 10)
        buf ← d on this param's first step, else μ·buf + d      (if μ ≠ 0; no dampening)
        p ← p − η_t·(buf if μ ≠ 0 else d)

    Unlike :class:`LARS` the ratio multiplies the lr of this step, not the gradient stored in the
    momentum buffer. Use a param group with ``lars=False`` to exclude biases and norms.
    State: ``momentum_buffer``.

    Args:
        params: iterable of params or param-group dicts (a group may set ``lars``).
        lr: learning rate η (>= 0). momentum: μ (>= 0). eeta: trust coefficient (>= 0).
        weight_decay: λ (>= 0). epsilon: added to the denominator (>= 0).
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
    """

    op_name = "colossal_lars_"
    whole_tensor_rule = ("computes a trust ratio from the norms of each whole tensor", fsdp1.INSTEAD)
    extra_flags = ("lars",)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, eeta: float = 1e-3,
                 weight_decay: float = 0.0, epsilon: float = 0.0, *, set_grad_none: bool = True,
                 master_weights: bool = False, fused: bool | None = None,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        defaults = dict(lr=lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon, lars=True)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)

    def _validate(self, group: dict) -> None:
        super()._validate(group)
        check_nonnegative("eeta", group["eeta"])
        check_nonnegative("epsilon", group["epsilon"])


# ColossalAI's class name, for code and configs written for ColossalAI (the same class).
Lars = ColossalLars
