"""Lion: the sign of an interpolation of momentum and gradient (Chen et al. 2023; lion-pytorch)."""

from __future__ import annotations

import torch

from .checks import as_betas, check_betas, check_lr, check_nonnegative
from .optimizer import FusedOptimizer
from .param_state import state_like


class Lion(FusedOptimizer):
    r"""Lion ("EvoLved Sign Momentum"), fused over all tensors of a param group.

    Update rule, per parameter p with gradient g (η lr, λ weight_decay, m the momentum)::

        c ← β1·m + (1 − β1)·g
        p ← p·(1 − η·λ)                 (decoupled weight decay)
        p ← p − η·sign(c)               (sign(0) = sign(NaN) = 0, as torch.sign)
        m ← β2·m + (1 − β2)·g

    This is the update of Chen et al., "Symbolic Discovery of Optimization Algorithms" (2023),
    with lion-pytorch's signature, defaults (``lr=1e-4``, ``betas=(0.9, 0.99)``,
    ``weight_decay=0``), state name (``exp_avg``, zeros on a param's first step) and order of
    operations (β·m rounded first, then one fused multiply-add; bit for bit lion-pytorch's
    ``update_fn`` in fp32 on the CPU). The same update as DeepSpeed's ``DeepSpeedCPULion`` /
    ``FusedLion`` and bitsandbytes' / torchao's 32-bit Lion. Every element moves by exactly η
    (plus the decay), so Lion's lr is typically 3-10× smaller than AdamW's, its weight decay
    3-10× larger.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate η (>= 0).
        betas: (β1, β2), each in [0, 1): the interpolation of the direction and the momentum's decay.
        weight_decay: λ (>= 0), decoupled (multiplied by lr, as AdamW's).
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        master_weights: fp32 master weights of fp16/bf16 params.
        fused: None (kernels when possible), True (kernels or error), False (reference).
        state_dtype, state_rounding, stochastic_rounding: compact momentum (bf16 or ``"8bit"``;
            fp32 for fp16/bf16 params) and stochastic rounding, see :mod:`fused_optim.state_formats`.
    """

    op_name = "lion_"

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, set_grad_none: bool = True, master_weights: bool = False,
                 fused: bool | None = None, state_dtype=None, state_rounding: str = "nearest",
                 stochastic_rounding: bool = False):
        defaults = dict(lr=lr, betas=as_betas(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)

    def _validate(self, group: dict) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_nonnegative("weight_decay", group["weight_decay"])

    def _init_state(self, p, state, group) -> None:
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(state_like(p, state), memory_format=torch.contiguous_format)
