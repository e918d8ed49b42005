"""``SGD``, ``Adam``, ``AdamW``: drop-in replacements for ``torch.optim.SGD`` / ``Adam`` / ``AdamW``.

Same constructor signatures and defaults as torch 2.13 (``lr=1e-3``, AdamW's
``weight_decay=1e-2``, ``maximize``, ``foreach``, ``capturable``, ``differentiable``, ``fused``,
Adam's ``decoupled_weight_decay``, a Tensor ``lr``; plus the keyword-only ``master_weights``,
``state_dtype``, ``state_rounding`` and ``stochastic_rounding``, off by default), the same param-group keys and state (state dicts load into torch.optim and back),
``zero_grad()`` setting grads to None, and torch's ``ValueError`` / ``RuntimeError`` for bad
arguments. Each class is the algorithm class of
:mod:`.sgd` / :mod:`.adam` (``FusedSGD`` / ``FusedAdam``: same kernels, state, validation and
scalars) with torch's constructor in place of apex's: nothing of the update rule is repeated here.

The implementation flags, as torch's group keys, mean here:

* ``fused``: this package's three values, which differ from torch's at ``None``: None (default)
  uses the kernels where they build and the tensors are supported, else the reference
  implementation with one warning; True the kernels or an error; False the pure-PyTorch
  reference. (torch's ``fused=None`` means "not fused".) The constructor's value decides for the
  whole optimizer (``opt.fused``); a group's ``fused`` key is kept for torch.optim state dicts and
  a value loaded from a checkpoint does not change the implementation.
* ``foreach``: accepted and kept. The kernels are always multi-tensor (one call per group and
  device/dtype), so there is no per-tensor loop to switch to; ``foreach=True`` with ``fused=True``
  is refused as torch refuses it, and so are torch's Tensor-lr/betas cases that need
  ``capturable`` under ``foreach``.
* ``capturable``: accepted and kept. On CUDA the kernels always keep step counters on the device
  and read a Tensor lr, ``grad_scale`` and ``found_inf`` there, so a fused step is capture-safe
  whatever this flag says; the reference implementation (``fused=False``, or a fallback) reads
  them on the host and is never capturable. On the CPU the flag changes nothing.
* ``master_weights`` (not torch's): fp32 master weights for fp16/bf16 params, see
  :class:`.optimizer.FusedOptimizer`.
* ``state_dtype``, ``state_rounding``, ``stochastic_rounding`` (not torch's): bf16 or 8-bit
  moments, stochastic rounding of bf16 state and params (:mod:`.state_formats`); a state dict
  with compact state does not load into torch.optim.
* ``differentiable``: only False. ``differentiable=True`` (an autograd graph through the update)
  is refused with a ``ValueError``; use torch.optim for it.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from .adam import FusedAdam
from .optimizer import FusedOptimizer
from .sgd import FusedSGD


def _constant(value):
    """A computed scalar that is always ``value``."""
    return lambda optimizer, group: value


class TorchOptimizer(FusedOptimizer):
    """torch.optim's constructor contract over an algorithm class (the next base in the MRO).

    A subclass's ``__init__`` has torch's signature and calls :meth:`_init_torch` with torch's
    defaults dict; ``_algorithm_options`` fixes the algorithm's options torch's class lacks
    (e.g. FusedSGD's ``wd_after_momentum``) at torch's behaviour, so that groups hold exactly
    torch's keys."""

    _algorithm_options: ClassVar[dict] = {}

    def _init_torch(self, params, defaults: dict, master_weights: bool, **compact) -> None:
        if defaults["fused"] and defaults["differentiable"]:  # torch's error for this pair
            raise RuntimeError("`fused` does not support `differentiable`")
        # Not the algorithm class's __init__: that one has apex's signature and keys.
        FusedOptimizer.__init__(self, params, defaults, fused=defaults["fused"], set_grad_none=True,
                                master_weights=master_weights, **compact)
        if defaults["fused"] and defaults["foreach"]:  # torch checks this one after the params
            raise RuntimeError("`fused` and `foreach` cannot be `True` together (fused_optim's kernels are "
                               "multi-tensor already: pass fused=True alone)")

    def _validate(self, group: dict) -> None:
        super()._validate(group)
        if group.get("differentiable"):
            raise ValueError(
                f"Invalid differentiable value: True ({type(self).__name__} updates params under no_grad, in "
                f"kernels autograd cannot see through; use torch.optim.{type(self).__name__} for differentiable=True)"
            )

    def __init_subclass__(cls, **kwargs) -> None:
        """The op scalars read from ``_algorithm_options``' keys become constants (once, here: the
        groups hold no such key, and a step builds no merged dict)."""
        super().__init_subclass__(**kwargs)
        fixed = cls._algorithm_options
        cls._computed_scalars = (*cls._computed_scalars, *((name, _constant(fixed[key]))
                                                           for name, key in cls._group_scalars if key in fixed))
        cls._group_scalars = tuple((name, key) for name, key in cls._group_scalars if key not in fixed)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a torch.optim group key, which FusedOptimizer does not add
            group.setdefault("differentiable", False)


class SGD(TorchOptimizer, FusedSGD):
    r"""Drop-in for ``torch.optim.SGD`` (torch's signature, defaults, group keys and state).

    For apex/ColossalAI's signature (``lr`` required, ``wd_after_momentum``, ``set_grad_none=False``)
    use :class:`FusedSGD`. The update is FusedSGD's with ``wd_after_momentum=False``, i.e.
    torch.optim.SGD's; see the module docstring for ``foreach`` / ``capturable`` / ``fused`` /
    ``differentiable``. Unlike torch 2.13, ``weight_decay`` must be a number (not a Tensor) and
    ``dampening`` must be >= 0.
    """

    _algorithm_options = {"wd_after_momentum": False}

    def __init__(self, params, lr: float | Tensor = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        self._init_torch(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize, foreach=foreach,
                                      differentiable=differentiable, fused=fused), master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)

    def _validate(self, group: dict) -> None:
        if isinstance(group["weight_decay"], Tensor):
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']!r} (a Tensor weight_decay is not "
                             "supported here; pass float(weight_decay))")
        super()._validate(group)


class Adam(TorchOptimizer, FusedAdam):
    r"""Drop-in for ``torch.optim.Adam`` (torch's signature, defaults, group keys and state).

    For apex/ColossalAI's signature (AdamW by default, ``adam_w_mode``, ``bias_correction``) use
    :class:`FusedAdam`. The update is FusedAdam's with bias correction, L2 weight decay unless
    ``decoupled_weight_decay=True``; see the module docstring for ``foreach`` / ``capturable`` /
    ``fused`` / ``differentiable``. Tensor betas are read on the host each step.
    """

    _algorithm_options = {"bias_correction": True}

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False, master_weights: bool = False,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        betas = tuple(b.squeeze() if isinstance(b, Tensor) else b for b in betas)  # as torch: 0-dim Tensors
        self._init_torch(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                                      differentiable=differentiable, fused=fused,
                                      decoupled_weight_decay=decoupled_weight_decay), master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)

    def _validate(self, group: dict) -> None:
        _check_tensor_hyperparameters(group)  # first: the range checks need 1-element Tensors
        super()._validate(group)


class AdamW(Adam):
    r"""Drop-in for ``torch.optim.AdamW``: :class:`Adam` with decoupled weight decay, default 1e-2.

    For apex/ColossalAI's FusedAdam (AdamW by default too, but ``weight_decay=0``) use
    :class:`FusedAdam`."""

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, master_weights: bool = False,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)


def _check_tensor_hyperparameters(group: dict) -> None:
    """torch.optim.Adam's rules for a Tensor lr and Tensor betas (same errors and wording)."""
    refused = group.get("foreach") and not group.get("capturable")
    hint = " (as in torch.optim; pass capturable=True or foreach=None: fused_optim reads the Tensor either way)"
    if isinstance(group["lr"], Tensor) and refused:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True" + hint)
    betas = group["betas"]
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, Tensor) for b in betas)):
        raise ValueError(f"betas must be either both floats or both Tensors (got {betas!r})")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor):
            if refused:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True"
                                 + hint)
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element (got {beta.numel()} elements)")
