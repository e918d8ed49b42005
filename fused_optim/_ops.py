"""Schemas and fake implementations of every fused_optim op: the single source of truth for op
signatures.

Importing this module needs no compiler. The C++ files under ``csrc/`` only register
implementations for these schemas (``TORCH_LIBRARY_IMPL(fused_optim, CPU, m)``), which are loaded
lazily by :mod:`fused_optim._build`; :mod:`fused_optim._reference` implements the same signatures
in pure PyTorch. All ops are in-place (trailing underscore), take tensor lists plus keyword
scalars, and accept the optional ``grad_scale`` / ``found_inf`` tensors of ``torch.amp.GradScaler``:
grads are divided by ``grad_scale`` inside the op, and nothing at all changes when ``found_inf`` is
non-zero (step counters included).

``sgd_``'s ``first_step`` has one flag per param (True: its momentum buffer is set to the grad,
torch.optim's first step), or is empty when no param is on its first step.
"""

from __future__ import annotations

import torch

_AMP = "Tensor? grad_scale=None, Tensor? found_inf=None"

SCHEMAS = {
    "sgd_": (
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, bool[] first_step, *, "
        "float lr, float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, "
        f"bool wd_after_momentum, {_AMP}) -> ()"
    ),
    "adam_": (
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, *, float lr, float beta1, float beta2, "
        "float eps, float weight_decay, bool amsgrad, bool decoupled, bool maximize, "
        f"bool bias_correction=True, {_AMP}) -> ()"
    ),
}

_lib = torch.library.Library("fused_optim", "DEF")  # noqa: TOR901 - keeps the definitions alive


def _fake(*args, **kwargs) -> None:
    """In-place ops return nothing; shapes and dtypes of the outputs are those of the inputs."""
    return None


for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)
    torch.library.register_fake(f"fused_optim::{_name}", _fake, lib=_lib)


def op(name: str):
    """The registered op ``torch.ops.fused_optim.<name>`` (its CPU kernel needs the JIT build)."""
    return getattr(torch.ops.fused_optim, name)
