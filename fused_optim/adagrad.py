"""``Adagrad``: drop-in replacement for ``torch.optim.Adagrad``, fused (the algorithm and torch's
constructor; the implementation flags mean what :mod:`.torch_optim` says)."""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_lr, check_nonnegative
from .optimizer import FusedOptimizer
from .param_state import scalar_dtype, state_like
from .torch_optim import TorchOptimizer


class _AdagradUpdate(FusedOptimizer):
    """Adagrad's op, checks and state, under :class:`Adagrad`'s torch constructor."""

    op_name = "adagrad_"

    def _validate(self, group: dict) -> None:
        check_lr(group["lr"])
        check_nonnegative("lr_decay", group["lr_decay"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_nonnegative("initial_accumulator_value", group["initial_accumulator_value"])
        check_nonnegative("epsilon", group["eps"])

    def _check_state(self, state: dict) -> None:
        """A state with one of ``step`` / ``sum`` holds both: else ``KeyError`` naming the missing one
        (as torch.optim.Adagrad raises), instead of silently restarting the other."""
        present = [k for k in ("step", "sum") if k in state]
        if len(present) == 1:
            missing = "sum" if present == ["step"] else "step"
            raise KeyError(f"{missing!r}: a param's state has {present} but no {missing!r}; load a complete "
                           "state dict, or drop that param's state to restart it")

    def _init_state(self, p, state, group) -> None:
        self._check_state(state)
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
            state["sum"] = torch.full_like(state_like(p, state), group["initial_accumulator_value"],
                                           memory_format=torch.contiguous_format)


class Adagrad(TorchOptimizer, _AdagradUpdate):
    r"""Drop-in for ``torch.optim.Adagrad`` (torch's signature, defaults, group keys and state),
    fused over all tensors of a param group; step counters live in the kernel.

    Update rule, per parameter p with gradient g (η lr, λ weight_decay, t the param's step)::

        t ← t + 1
        g ← −g                                  if maximize
        g ← g + λ·p                             (L2 weight decay)
        s ← s + g²                              (state "sum", initially initial_accumulator_value)
        p ← p − η / (1 + (t − 1)·lr_decay) · g / (√s + eps)

    with torch's order of operations (g + λ·p and s + g² one fused multiply-add each): in fp32
    on the CPU the sums equal torch.optim.Adagrad's bit for bit without weight decay; the params
    agree within an ulp of p and two of η per step, because torch's fp32 CPU ``sqrt`` is not
    correctly rounded (ours is IEEE on both devices). State: ``step`` and ``sum``, made on a
    param's first step (torch makes them in its constructor), so state dicts move between the two
    in both directions. Sparse gradients are refused (torch's Adagrad takes them; use it for sparse
    embeddings). See :mod:`.torch_optim` for ``foreach`` / ``fused`` / ``differentiable``;
    ``master_weights``, ``state_dtype``, ``state_rounding`` and ``stochastic_rounding`` are this
    package's (off by default): fp32 masters of fp16/bf16 params, bf16 or ``"8bit"`` sums
    (the unsigned 8-bit code) or fp32 sums of fp16/bf16 params, stochastic rounding.
    """

    def __init__(self, params, lr: float | Tensor = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10, foreach: bool | None = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False, state_dtype=None, state_rounding: str = "nearest",
                 stochastic_rounding: bool = False):
        self._init_torch(params, dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable, fused=fused),
                         master_weights, state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)
