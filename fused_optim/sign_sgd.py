"""SignSGD: the sign of torch.optim.SGD's momentum direction (mlbench_core's SignSGD)."""

from __future__ import annotations

from .sgd import MomentumOptimizer


class SignSGD(MomentumOptimizer):
    r"""SGD that steps by the sign of the momentum direction, fused over all tensors of a group.

    Update rule, per parameter p with gradient g (λ weight_decay, μ momentum, d dampening, η lr)::

        g ← g + λ·p                      if λ ≠ 0
        if μ ≠ 0:
            buf ← g                      on this param's first step
            buf ← μ·buf + (1 − d)·g      afterwards
            g   ← g + μ·buf if nesterov else buf
        p ← p − η·sign(g)                (sign(0) = sign(NaN) = 0, as torch.sign)

    This is mlbench_core's ``SignSGD`` (Bernstein et al., "signSGD: Compressed Optimisation for
    Non-Convex Problems", 2018; with momentum taken before the sign, i.e. Signum). State:
    ``momentum_buffer``, as torch.optim.SGD. A NaN in the direction leaves its element unchanged (the
    reference's ``torch.sign``), while the NaN stays in the momentum buffer.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate η (>= 0; None: each param group gives its own).
        momentum, weight_decay, dampening: μ, λ, d (>= 0).
        nesterov: Nesterov momentum (needs μ > 0 and d = 0).
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
    """

    op_name = "sign_sgd_"

    def __init__(self, params, lr: float | None = None, momentum: float = 0.0, weight_decay: float = 0.0,
                 dampening: float = 0.0, nesterov: bool = False, *, set_grad_none: bool = True,
                 master_weights: bool = False, fused: bool | None = None,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, dampening=dampening, nesterov=nesterov)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)
