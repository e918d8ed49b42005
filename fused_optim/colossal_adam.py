"""ColossalAI's ``CPUAdam`` and ``HybridAdam``: FusedAdam under their signature, with their
``step(closure, div_scale)`` and their offload of a fraction of the state (:mod:`.state_files`)."""

from __future__ import annotations

import math
from typing import Any, Callable

from .adam import FusedAdam
from .checks import check_flag, is_real
from .state_files import StateFiles

_OFFLOADED = ("exp_avg", "exp_avg_sq")  # the state that nvme_offload_fraction puts in files


def _check_div_scale(div_scale: Any) -> float | None:
    """ColossalAI's ``div_scale``: -1 (its default) for none, else the positive number the grads
    are divided by."""
    number = is_real(div_scale) and not isinstance(div_scale, bool)
    if number and float(div_scale) == -1.0:
        return None
    if not number or not math.isfinite(float(div_scale)) or float(div_scale) <= 0:
        raise ValueError(f"Invalid div_scale value: {div_scale!r} (the grads are divided by it: a finite number > 0, "
                         "or -1 for none)")
    return float(div_scale)


class CPUAdam(FusedAdam):
    r"""ColossalAI's ``CPUAdam``: its signature and defaults (AdamW with ``adamw_mode=True``).

    Adam / AdamW fused over all tensors of a group, on CPU params by the CPU kernels and on CUDA
    params by the CUDA kernels, in one optimizer. Update rule, per parameter p with gradient g
    (η lr, λ weight_decay, t the param's step, s ``div_scale``)::

        t ← t + 1 ;  g ← g / s                          (s = 1 when div_scale = -1)
        p ← p·(1 − η·λ)                                 if adamw_mode (AdamW)
        g ← g + λ·p                                     otherwise (L2, Adam)
        m ← β1·m + (1 − β1)·g ;  v ← β2·v + (1 − β2)·g²
        bc1 = 1 − β1^t, bc2 = 1 − β2^t                  (both 1 if not bias_correction)
        p ← p − (η / bc1) · m / (√v / √bc2 + eps)

    That is :class:`FusedAdam` (state ``step``, ``exp_avg``, ``exp_avg_sq`` as torch.optim's; a
    ColossalAI state dict, whose steps are ints, loads, and ours loads into ColossalAI's).
    Deviations from ColossalAI: its bf16 path and its CUDA path are separate, slower Python code
    with the same math; ``div_scale`` applies on CUDA params too (ColossalAI's CPUAdam asserts it
    is -1 there); ``adamw_mode`` is a group option (``decoupled_weight_decay``), so groups may
    differ; a state with offloaded tensors saves and loads (ColossalAI raises
    ``NotImplementedError``). GradScaler's ``grad_scale`` and ``div_scale`` combine (the update
    divides the grads by both; the op's ``div_scale``, as ColossalAI's kernel takes it), and the
    grads left after the step are unscaled by ``grad_scale`` only (GradScaler's contract):
    ``div_scale`` alone never changes them, as in ColossalAI.

    Args:
        model_params: iterable of params or param-group dicts.
        lr, betas, eps, weight_decay: as in torch.optim.AdamW.
        bias_correction: divide the moments by 1 − β^t.
        adamw_mode: decoupled weight decay (AdamW) if True, else L2 (Adam).
        nvme_offload_fraction: the fraction of the params (by size, in group order, CPU params
            only) whose ``exp_avg`` / ``exp_avg_sq`` live in memory-mapped files instead of RAM.
        nvme_offload_dir: where those files go (a fresh folder inside it, removed with the
            optimizer); None: the system's temporary folder.
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
    """

    _div_scale: float | None = None  # during step(): the grads' divisor from div_scale

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, nvme_offload_fraction: float = 0.0, nvme_offload_dir: str | None = None,
                 *, set_grad_none: bool = True, master_weights: bool = False, fused: bool | None = None):
        check_flag("adamw_mode", adamw_mode)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=adamw_mode,
                         bias_correction=bias_correction, set_grad_none=set_grad_none,
                         master_weights=master_weights, fused=fused)
        self.state_files = StateFiles(self, nvme_offload_fraction, nvme_offload_dir, _OFFLOADED)

    def __getstate__(self) -> dict:
        files = self.state_files
        return {**super().__getstate__(), "nvme_offload": (files.fraction, files.requested_directory)}

    def __setstate__(self, state: dict) -> None:
        offload = state.pop("nvme_offload", (0.0, None))
        super().__setstate__(state)
        if "state_files" not in self.__dict__:  # unpickled (a copy): its own files, chosen anew
            self.state_files = StateFiles(self, *offload, _OFFLOADED)

    @property
    def adamw_mode(self) -> bool:
        """ColossalAI's optimizer attribute: the defaults' decoupled weight decay."""
        return self.defaults["decoupled_weight_decay"]

    def step(self, closure: Callable[[], Any] | None = None, div_scale: float = -1):
        """One update of every param with a grad, its grads divided by ``div_scale`` (-1: none);
        runs ``closure`` first and returns its loss."""
        self._div_scale = _check_div_scale(div_scale)
        try:
            return super().step(closure)
        finally:
            self._div_scale = None

    def _scalars(self, group: dict) -> dict:
        """FusedAdam's, and the op's ``div_scale`` when the step was given one."""
        scalars = super()._scalars(group)
        if self._div_scale is not None:
            scalars["div_scale"] = self._div_scale
        return scalars

    def _init_state(self, p, state, group) -> None:
        super()._init_state(p, state, group)
        self.state_files.place(p, state)


class HybridAdam(CPUAdam):
    """ColossalAI's ``HybridAdam``: :class:`CPUAdam` (which already steps CPU and CUDA params in
    one optimizer, each on its device's kernels) under the name ColossalAI gives the mix.
    Deviation: ColossalAI's CUDA path uses one step count for a whole group (its last param's),
    so a param that joined later gets the wrong bias correction; here each param keeps its own.
    ColossalAI also takes and ignores any other keyword argument; here an unknown one is an error."""
