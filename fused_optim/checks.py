"""Checks of the optimizers' arguments: hyperparameters and boolean options.

Each raises torch.optim's ``ValueError("Invalid <name>: <value>")``, followed by what the value
needs, so code that matches torch's messages matches ours and a user reads the fix. Numbers are
taken as torch.optim takes them (int, float, numpy scalars; a one-element Tensor for an lr or a
beta); a string such as ``"False"`` is never read as a flag. The base class runs an algorithm's
checks (its ``_validate``) on the defaults, on every group added, and again before a step on a
group whose values changed since their last check.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import Tensor


def check_range(label: str, value: Any, ok: bool, need: str) -> None:
    """Raise torch-style ``ValueError("Invalid <label>: <value>")`` plus what is needed."""
    if not ok:
        raise ValueError(f"Invalid {label}: {value} ({need})")


def is_real(value: Any) -> bool:
    """A real number as torch.optim takes one: int, float, or a numpy scalar such as numpy.float32."""
    return isinstance(value, numbers.Real)


def check_lr(lr: Any) -> None:
    """A float >= 0, or (torch.optim's Tensor lr) a one-element floating tensor >= 0: the kernels
    read it when they run, so a scheduler may change it in place and a CUDA graph replays it."""
    if isinstance(lr, Tensor):
        check_range("learning rate", lr, lr.numel() == 1 and lr.is_floating_point(),
                    "Tensor lr must be 1-element and floating point")
        check_range("learning rate", lr, float(lr) >= 0.0, "lr must be >= 0")
        return
    check_range("learning rate", lr, is_real(lr) and lr >= 0.0, "lr must be a float >= 0")


def lr_missing(group: dict) -> bool:
    """Whether the group has no lr (None: the constructor's lr left to the param groups)."""
    return group.get("lr") is None


def positive_int(name: str, value: int) -> int:
    """``value`` if it is an int >= 1 (a count: ranks, backward passes, windows), else
    ``ValueError("Invalid <name>: ...")``."""
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"Invalid {name}: {value!r} (an int >= 1)")
    return value


def check_nonnegative(name: str, value: Any) -> None:
    check_range(f"{name} value", value, is_real(value) and value >= 0.0, f"{name} must be >= 0")


def check_flag(name: str, value: Any) -> None:
    """A boolean option: a bool (or numpy bool, or the int 0 / 1); a string such as "False" is
    truthy in Python, so it is refused rather than silently read as True."""
    ok = (isinstance(value, numbers.Integral) and value in (0, 1)) or type(value).__name__ == "bool_"
    check_range(f"{name} value", repr(value), ok, f"{name} must be True or False")


def as_betas(betas: Any) -> Any:
    """A constructor's ``betas`` as the tuple the group keeps; anything but a pair is left as it is,
    for :func:`check_betas` to refuse by name."""
    return tuple(betas) if isinstance(betas, (tuple, list)) else betas


def check_betas(betas: Any) -> None:
    check_range("betas", betas, isinstance(betas, (tuple, list)) and len(betas) == 2, "need (beta1, beta2)")
    for i, beta in enumerate(betas):
        number = is_real(beta) or (isinstance(beta, Tensor) and beta.numel() == 1)  # (torch takes Tensor betas)
        check_range(f"beta parameter at index {i}", beta, number and 0.0 <= float(beta) < 1.0,
                    "betas must be in [0, 1)")
