"""LAMB: FusedLAMB (apex/ColossalAI FusedLAMB = timm Lamb) and ColossalLamb (ColossalAI's non-fused
``Lamb``, also importable under that name)."""

from __future__ import annotations

import torch

from .adam import check_moments, decoupled_flag, init_moments
from . import fsdp1, sharding, zero_partition
from .norm import sum_squares_, whole_tensor_sums
from .checks import as_betas, check_betas, check_flag, check_lr, check_nonnegative, check_range, is_real
from .fallback import in_group_terms
from .optimizer import FusedOptimizer


class _LambBase(FusedOptimizer):
    """Adam's state (``step``, ``exp_avg``, ``exp_avg_sq``) and hyperparameter checks."""

    whole_tensor_rule = ("computes a trust ratio from the norms of each whole tensor", fsdp1.INSTEAD)

    def _validate(self, group: dict) -> None:
        check_lr(group["lr"])
        check_nonnegative("epsilon", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_betas(group["betas"])

    def _check_state(self, state: dict) -> None:
        check_moments(state)

    def _init_state(self, p, state, group) -> None:
        init_moments(p, state)


class FusedLAMB(_LambBase):
    r"""apex/ColossalAI ``FusedLAMB``: their signature and defaults (also timm ``Lamb``'s options).

    LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019), fused per group.

    Update rule (η lr, λ weight_decay, t the param's step, ‖·‖ the L2 norm of a whole tensor)::

        G ← ‖all grads of all groups‖                       (one multi-tensor norm per step)
        clip ← G / max_grad_norm if G > max_grad_norm else 1  (max_grad_norm None or 0: clip = 1)
        per param:  t ← t + 1 ; bc1 = 1 − β1^t, bc2 = 1 − β2^t (both 1 if not bias_correction)
                    β3 = 1 − β1 if grad_averaging else 1
            ĝ ← g / clip
            ĝ ← ĝ + λ·p                                     if not decoupled_weight_decay (L2)
            m ← β1·m + β3·ĝ ;  v ← β2·v + (1 − β2)·ĝ²
            u ← (m / bc1) / (√(v / bc2) + eps)
            u ← u + λ·p                                     if decoupled_weight_decay
            r ← ‖p‖ / ‖u‖ if (use_nvlamb or λ ≠ 0) and ‖p‖ ≠ 0 and ‖u‖ ≠ 0, else 1
            r ← min(r, 1)                                   if trust_clip
            p ← p − η·r·u

    This is apex/ColossalAI ``FusedLAMB`` and timm ``Lamb`` (``always_adapt`` is timm's name for
    ``use_nvlamb``; ``trust_clip`` is timm's option). ‖p‖ is taken before the update. Norms and
    trust ratios are computed inside the kernels: no host sync per tensor. Unlike the references
    the grads are not clipped in place (after a step with GradScaler's scale they hold the
    unscaled grads, as torch's optimizers leave them; never the clipped ones). Step counters
    are per param (torch.optim's ``step`` state).
    Built by ``ZeroRedundancyOptimizer`` over one rank's partition of the params, G sums the
    squares of every rank's partition (one all-reduce over ZeRO's process group per step).
    The CPU kernel hands fp32/fp64 ``u`` from its moment pass to its update pass in scratch buffers
    that live as long as their threads: up to 4M elements (16 MB in fp32) on the calling thread,
    up to 256K (1 MB) on each worker thread.

    Args:
        params: iterable of params or param-group dicts.
        lr, betas, eps, weight_decay: η, (β1, β2), eps, λ.
        bias_correction, grad_averaging, decoupled_weight_decay: as above (decoupled_weight_decay
            default True). ``adam_w_mode``, apex/ColossalAI's name for decoupled_weight_decay (and
            the param-group key), is accepted too; give one of them.
        max_grad_norm: clip the global grad norm to this (None or 0: no clipping).
        use_nvlamb / always_adapt: apply the trust ratio with λ = 0 too.
        trust_clip: cap the trust ratio at 1.
        amsgrad: not supported (as apex/ColossalAI); True raises.
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
        state_dtype: ``torch.bfloat16`` or ``"8bit"``: m and v in 2 or ~1 byte; ``torch.float32``:
            fp32 m and v of fp16/bf16 params (:mod:`.state_formats`). With the trust ratio the update uses them as stored: ‖u‖ is
            taken from the new moments, then u recomputed from the encoded ones (as fp16/bf16 state).
        state_rounding: ``"stochastic"`` rounds bf16 state stochastically (default ``"nearest"``).
        stochastic_rounding: round bf16 params without master weights stochastically.
    """

    op_name = "lamb_"

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool | None = None, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float | None = 1.0, use_nvlamb: bool = False, *,
                 trust_clip: bool = False, always_adapt: bool = False, decoupled_weight_decay: bool | None = None,
                 master_weights: bool = False, fused: bool | None = None, state_dtype=None,
                 state_rounding: str = "nearest", stochastic_rounding: bool = False):
        check_flag("amsgrad", amsgrad)
        if amsgrad:
            raise ValueError("Invalid amsgrad value: True (LAMB has no AMSGrad variant; apex and ColossalAI refuse it too)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=as_betas(betas), eps=eps, weight_decay=weight_decay,
                        adam_w_mode=decoupled_flag(decoupled_weight_decay, adam_w_mode), grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb or always_adapt, trust_clip=trust_clip)
        self._grad_norm = None
        self._partition_group = zero_partition.partition_group()  # ZeRO's: the grad norm sums over it
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_partition_group", None)  # unpickled or copied: no partition's optimizer

    def _validate(self, group: dict) -> None:
        super()._validate(group)
        clip = group["max_grad_norm"]
        check_range("max_grad_norm", clip, clip is None or (is_real(clip) and clip >= 0),
                    "use a norm > 0, or None / 0 for no clipping")

    def _prepare_step(self) -> None:
        """The global grad norm over every group (before unscaling: the kernel divides by the
        scale), passed to the kernels as a tensor. With one group it waits: the group's direct
        call holds every grad and takes their norm itself, in its own parallel region; the general
        path, which may split the grads over several calls, gets it from ``_step_direct``. Made by
        ``ZeroRedundancyOptimizer``, it holds one partition of the params: the norm is summed
        over the partitions (every rank's optimizer steps, so every rank takes part)."""
        self._grad_norm = None
        several = len(self.param_groups) > 1 or self._partition_group is not None
        if several and any(group["max_grad_norm"] for group in self.param_groups):
            self._grad_norm = self._global_grad_norm()

    def _global_grad_norm(self):
        where = [(gi, i) for gi, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])
                 if p.grad is not None]
        grads = [self.param_groups[gi]["params"][i].grad for gi, i in where]
        fused = False if self.fused is False else None
        if any(sharding.is_dtensor(g) for g in grads):  # shards: the norm of the whole grads
            sums = whole_tensor_sums(grads, fused=fused).sum()
        else:  # in float64, summed as the kernel sums the grads of a direct call: the same norm either way
            sums = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
            try:
                sum_squares_(sums, grads, [0] * len(grads), fused=fused)
            except RuntimeError as exc:
                raise RuntimeError(f"{type(self).__name__}: {in_group_terms(str(exc), where)}") from exc
        if self._partition_group is not None:  # ZeRO's partition: the other ranks hold the other grads
            import torch.distributed as dist  # (a partition exists: distributed is available)

            dist.all_reduce(sums, group=self._partition_group)
        return sums.sqrt()

    def _step_direct(self, group: dict, scalars: dict, amp: dict) -> bool:
        """The base's direct call; when it does not happen and the (one) group clips, the general
        path gets the global norm: its plan may split the grads over several kernel calls."""
        if super()._step_direct(group, scalars, amp):
            return True
        if group["max_grad_norm"] and scalars["global_grad_norm"] is None:
            scalars["global_grad_norm"] = self._global_grad_norm()
        return False


class ColossalLamb(_LambBase):
    r"""ColossalAI's (non-fused) ``Lamb``, the pytorch-lamb algorithm, here fused per group; also
    importable as :data:`Lamb`, ColossalAI's class name.

    Update rule (η lr, λ weight_decay, t the param's step)::

        t ← t + 1
        m ← β1·m + (1 − β1)·g ;  v ← β2·v + (1 − β2)·g²
        s ← η·√(1 − β2^t) / (1 − β1^t) if bias_correction else η
        a ← m / (√v + eps) + λ·p
        r ← ‖p‖ / ‖a‖ (1 if either is 0, and 1 if adam)
        p ← p − s·r·a

    Differs from :class:`FusedLAMB`: no gradient clipping, eps added outside the bias
    correction, the ratio always applied (also for λ = 0), ``adam=True`` turns it off. Same as
    torch-optimizer's ``Lamb`` with ``debias=bias_correction`` and no weight-norm clamp.

    Args:
        params: iterable of params or param-group dicts.
        lr, betas, eps, weight_decay: η, (β1, β2), eps, λ.
        adam: skip the trust ratio (plain Adam with decoupled decay), for comparisons.
        bias_correction: fold the bias corrections into the step size.
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
        state_dtype, state_rounding, stochastic_rounding: compact state (see :class:`FusedLAMB`).
    """

    op_name = "colossal_lamb_"

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, adam: bool = False, bias_correction: bool = False, *,
                 set_grad_none: bool = True, master_weights: bool = False, fused: bool | None = None,
                 state_dtype=None, state_rounding: str = "nearest", stochastic_rounding: bool = False):
        defaults = dict(lr=lr, betas=as_betas(betas), eps=eps, weight_decay=weight_decay, adam=adam,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights,
                         state_dtype=state_dtype, state_rounding=state_rounding,
                         stochastic_rounding=stochastic_rounding)


# ColossalAI's class name, for code and configs written for ColossalAI (the same class).
Lamb = ColossalLamb
