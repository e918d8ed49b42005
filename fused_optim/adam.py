"""FusedAdam: Adam / AdamW (torch.optim semantics, apex/ColossalAI FusedAdam signature)."""

from __future__ import annotations

import torch

from .checks import as_betas, check_betas, check_flag, check_lr, check_nonnegative
from .optimizer import FusedOptimizer
from .param_state import scalar_dtype, state_like


_MOMENTS = ("step", "exp_avg", "exp_avg_sq")


def check_moments(state: dict) -> None:
    """A param's state holding some of Adam's moments holds all: else ``KeyError`` naming the one
    missing (torch.optim.Adam raises ``KeyError: 'step'`` when it loads a state without ``step``),
    instead of silently restarting the moments it has."""
    present = [k for k in _MOMENTS if k in state]
    for key in _MOMENTS:
        if present and key not in state:
            raise KeyError(f"{key!r}: a param's state has {present} but no {key!r}; "
                           "load a complete state dict, or drop that param's state to restart it")


def init_moments(p, state: dict) -> None:
    """Adam's state in torch.optim's layout (also LAMB's): ``step``, a 0-dim float32 counter
    (float64 under a float64 default dtype), and zero ``exp_avg`` / ``exp_avg_sq``, for a param
    that has none of them (``check_moments``)."""
    check_moments(state)
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
        state["exp_avg"] = torch.zeros_like(state_like(p, state), memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(state_like(p, state), memory_format=torch.contiguous_format)


def decoupled_flag(decoupled_weight_decay: bool | None, adam_w_mode: bool | None) -> bool:
    """The decoupled-weight-decay flag given as torch's ``decoupled_weight_decay`` or as apex's
    ``adam_w_mode`` (the same flag; either or both, if they agree), True (AdamW) when neither is."""
    for name, flag in (("decoupled_weight_decay", decoupled_weight_decay), ("adam_w_mode", adam_w_mode)):
        if flag is not None:
            check_flag(name, flag)
    if None not in (adam_w_mode, decoupled_weight_decay) and adam_w_mode != decoupled_weight_decay:
        raise ValueError(
            f"Invalid decoupled_weight_decay value: {decoupled_weight_decay} contradicts "
            f"adam_w_mode={adam_w_mode} (they are the same flag; give one)"
        )
    return next((m for m in (decoupled_weight_decay, adam_w_mode) if m is not None), True)


class FusedAdam(FusedOptimizer):
    r"""apex/ColossalAI ``FusedAdam``: apex's signature, positional order included (params, lr,
    bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none, capturable,
    master_weights), and defaults (AdamW by default with ``weight_decay=0``). For
    ``torch.optim.Adam`` / ``AdamW``'s use :class:`Adam` / :class:`AdamW`.

    Adam and AdamW, fused over all tensors of a param group; step counters live in the kernel.

    Update rule, per parameter p with gradient g (η lr, λ weight_decay, t the param's step)::

        t ← t + 1
        g ← −g                                          if maximize
        p ← p·(1 − η·λ)                                 if decoupled_weight_decay (AdamW)
        g ← g + λ·p                                     otherwise (L2, Adam)
        m ← m + (1 − β1)·(g − m)                        (= β1·m + (1 − β1)·g)
        v ← β2·v + (1 − β2)·g²
        v̂ ← max(v̂, v) if amsgrad else v
        bc1 = 1 − β1^t, bc2 = 1 − β2^t                  (both 1 if not bias_correction)
        p ← p − (η / bc1) · m / (√v̂ / √bc2 + eps)

    This is ``torch.optim.AdamW`` (``decoupled_weight_decay=True``, the default, as in
    apex/ColossalAI FusedAdam) or ``torch.optim.Adam`` (``decoupled_weight_decay=False``), with
    torch's state names (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) and group key
    ``decoupled_weight_decay``, so state dicts move between the two in both directions.
    ``bias_correction=False`` gives ColossalAI CPUAdam/HybridAdam's option of the same name.

    Args:
        params: iterable of params or param-group dicts.
        lr, betas, eps, weight_decay, amsgrad, maximize: as in torch.optim.Adam.
        decoupled_weight_decay: decoupled weight decay (AdamW; default True). ``adam_w_mode``,
            apex/ColossalAI's name for the same flag, is accepted too; give one of them.
        bias_correction: divide the moments by 1 − β^t.
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        capturable: apex's flag, kept as a group key. On CUDA the kernels keep the step counters
            on the device and read a Tensor lr, ``grad_scale`` and ``found_inf`` there, so a fused
            step is capture-safe whatever it says; on the CPU it changes nothing.
        master_weights: fp32 master weights of fp16/bf16 params (apex's flag of the same name).
        fused: None (kernels when possible), True (kernels or error), False (reference).
    """

    op_name = "adam_"

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool | None = None,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False, *,
                 decoupled_weight_decay: bool | None = None, maximize: bool = False, fused: bool | None = None,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        check_flag("capturable", capturable)
        defaults = dict(lr=lr, betas=as_betas(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        decoupled_weight_decay=decoupled_flag(decoupled_weight_decay, adam_w_mode),
                        bias_correction=bias_correction, maximize=maximize, capturable=capturable)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)

    def _validate(self, group: dict) -> None:
        check_lr(group["lr"])
        check_nonnegative("epsilon", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_betas(group["betas"])

    def _layout(self, group: dict) -> tuple:
        return (group["amsgrad"],)

    def _check_state(self, state: dict) -> None:
        check_moments(state)

    def _init_state(self, p, state, group) -> None:
        init_moments(p, state)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state_like(p, state), memory_format=torch.contiguous_format)
