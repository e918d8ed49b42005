"""The fallback policy: what an optimizer does with a param, or a grad, that the kernels cannot take.

The three-valued ``fused`` flag decides: ``fused=None`` (default) updates such a param by the
reference implementation (:mod:`._reference`) and warns once per reason; ``fused=True`` raises,
saying what failed and how to fix it (in torch's words first where torch refuses the same, see
:data:`TORCH_FUSED_REFUSAL`); ``fused=False`` never uses the kernels. The reasons are found
while a plan is built (kernels that do not build, a param the kernels cannot update in place:
:meth:`FallbackPolicy._unfusable`) or when a kernel refuses its grads (another dtype than the
param's). Inputs no implementation takes (sparse or complex, integer params, grads of another
shape) raise whatever ``fused`` says, naming the param by its index in its group; a kernel's
own error names it too (:func:`in_group_terms`).
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import Tensor

from . import _build, param_state, sharding, state_formats
from ._ops import FUSED_DEVICE_TYPES, FUSED_DTYPES
from .step_plan import Bucket

# torch.optim's words when ``fused=True`` meets a param its fused kernels do not take (a
# non-floating param, or one on a device without kernels): ours say them too, so that code
# matching torch's message matches ours.
TORCH_FUSED_REFUSAL = "`fused=True` requires all the params to be floating point Tensors of supported devices"

_build_warnings_shown: set[str] = set()  # device types whose failed build was reported
_INDEXED = re.compile(r"([A-Za-z_]+)\[(\d+)\]")  # a tensor list element in a kernel's message: grads[2]


def torch_fused_refusal(p: Tensor) -> str | None:
    """torch.optim's refusal of ``p`` under ``fused=True`` (with its devices and the param's dtype
    and device), or None when torch's check takes it."""
    if p.is_floating_point() and p.device.type in FUSED_DEVICE_TYPES:
        return None
    return f"{TORCH_FUSED_REFUSAL}: {list(FUSED_DEVICE_TYPES)} but {p.dtype} and {p.device.type}"


def in_group_terms(message: str, where: list[tuple[int, int]]) -> str:
    """A kernel's error about the tensor lists it was given (``grads[2]``: the third) in the
    user's terms: each ``name[k]`` gains ``(param i of group g)``, with ``(g, i) = where[k]``."""
    def named(m: re.Match) -> str:
        k = int(m.group(2))
        return f"{m.group(0)} (param {where[k][1]} of group {where[k][0]})" if k < len(where) else m.group(0)

    return _INDEXED.sub(named, message)


class FallbackPolicy:
    """The fallback policy of :class:`~fused_optim.optimizer.FusedOptimizer`, which mixes it in:
    it reads the optimizer's ``fused`` flag, its ``_warned`` reasons and its op's moments
    (``_moments``, the state a compact format may hold)."""

    fused: bool | None
    _warned: set[str]
    _moments: list[tuple[str, bool]]

    def _kernels_available(self, device_type: str) -> bool:
        """Whether the kernels for ``device_type`` built (building them now if needed); True for
        a device type without kernels, which ``_unfusable`` then names."""
        if device_type not in FUSED_DEVICE_TYPES:
            return True
        try:
            _build.load(device_type)
            return True
        except _build.BuildError:
            if self.fused:
                raise
            if device_type not in _build_warnings_shown:
                _build_warnings_shown.add(device_type)
                warnings.warn(f"{_build.build_error(device_type)} Falling back to the reference implementation.",
                              stacklevel=5)
            return False

    def _check_param(self, p: Tensor, gi: int, i: int) -> None:
        """Raises for a param with a grad that no implementation updates: not floating point, or
        sparse (before its state is made: ``zeros_like`` of a sparse param fails unclearly)."""
        if not p.is_floating_point():
            torch_words = f"(fused=True): {torch_fused_refusal(p)};" if self.fused else ":"
            raise RuntimeError(
                f"{type(self).__name__}{torch_words} param {i} of group {gi} has dtype {p.dtype}; only "
                "floating-point params can be optimized (torch.optim fails on it too); leave it out of the optimizer"
            )
        if p.layout is not torch.strided:
            raise RuntimeError(
                f"{type(self).__name__}: param {i} of group {gi} is a sparse tensor ({p.layout}); fused_optim "
                "does not support sparse gradients or params (use torch.optim.SparseAdam, or a dense param)"
            )
        unplaced = sharding.unfit_placements(p)
        if unplaced:
            raise RuntimeError(f"{type(self).__name__}: param {i} of group {gi} {unplaced}")

    def _may_fuse(self, p: Tensor, state: dict, group: dict, gi: int, i: int, kernels: dict[str, bool]) -> bool:
        """Whether param ``i`` of group ``gi`` goes to a fused bucket; when the kernels could be
        used but cannot take it, raises under ``fused=True`` or warns. ``kernels`` caches, per
        device type, whether the kernels may be used."""
        kind = p.device.type
        if kind not in kernels:
            kernels[kind] = self.fused is not False and self._kernels_available(kind)
        if not kernels[kind]:
            return False
        reason = self._unfusable(p, state, group)
        if reason:
            self._fallback(f"param {i} of group {gi} {reason}", torch_fused_refusal(p))
        return reason is None

    def _unfusable(self, p: Tensor, state: dict, group: dict) -> str | None:
        """Why the kernel cannot update ``p`` in place, or None when it can (a DTensor: its local
        tensor, which the kernel updates)."""
        p = sharding.local(p)
        if type(p) not in (Tensor, torch.nn.Parameter):
            return f"is a {type(p).__name__}, a tensor subclass the kernel cannot see through"
        if p.device.type not in FUSED_DEVICE_TYPES:
            return f"is on {p.device}, which has no fused kernel yet"
        if p.dtype not in FUSED_DTYPES:
            return f"has dtype {p.dtype}, which has no fused kernel"
        if not p.is_contiguous():
            return "is not contiguous (the kernel never updates a copy)"
        return self._unfit_state(p, state, group)

    def _unfit_state(self, p: Tensor, state: dict, group: dict) -> str | None:
        """Why the kernel cannot take a state tensor of ``p`` as it is, or None when it can."""
        values = param_state.state_like(p, state).dtype
        compact = state_formats.is_compact(group)
        if compact and values == torch.float64:
            return "is float64: compact state (state_dtype) has kernels for float32/16 and bfloat16 values only"
        keys = self._moments if compact else None
        for name, t in state.items():
            if not isinstance(t, Tensor) or name == "step":
                continue
            want, device = param_state.expected_state(name, group, p, values, keys)
            if not (sharding.local(t).is_contiguous() and t.dtype == want and t.device == device):
                return f"has state '{name}' that is not a contiguous {want} tensor on {device}"
        return None

    def _check_grads(self, bucket: Bucket, grads: list[Tensor], gi: int) -> None:
        """Raises, naming the param by its index in its group, for a grad no implementation takes:
        sparse, or not of its param's shape; with ``fused=True`` also for a grad whose dtype is
        not its param's (``fused=None`` updates such a bucket by the reference implementation)."""
        for i, p, g in zip(bucket.index, bucket.params, grads):
            if g.layout is not torch.strided:
                raise RuntimeError(
                    f"{type(self).__name__}: param {i} of group {gi} has a sparse gradient; "
                    "fused_optim does not support sparse gradients (use torch.optim.SparseAdam)"
                )
            if g.shape != p.shape:
                raise RuntimeError(
                    f"{type(self).__name__}: param {i} of group {gi} has shape {tuple(p.shape)} but its gradient "
                    f"has shape {tuple(g.shape)}; give each param a gradient of its own shape"
                )
            if bucket.sharded or sharding.is_dtensor(g):
                mismatch = sharding.grad_mismatch(p, g)
                if mismatch:
                    raise RuntimeError(f"{type(self).__name__}: param {i} of group {gi} {mismatch}")
        mismatch = self._dtype_mismatch(bucket, grads, gi)
        if mismatch is not None and self.fused:
            self._fallback(mismatch)

    @staticmethod
    def _dtype_mismatch(bucket: Bucket, grads: list[Tensor], gi: int) -> str | None:
        """Why a fused bucket's kernel cannot take these grads because of their dtype, or None."""
        if bucket.fused:
            for i, p, g in zip(bucket.index, bucket.params, grads):
                if g.dtype != p.dtype:
                    return (f"group {gi} has gradients whose dtype differs from their params' ({p.dtype}): "
                            f"param {i} of group {gi} has a {g.dtype} gradient")
        return None

    def _fallback(self, why: str, torch_words: str | None = None) -> None:
        """Under ``fused=True`` raises saying ``why`` the kernels cannot be used (after torch's
        ``torch_words`` for the same refusal, if any); else warns once per reason, which the
        reference implementation then handles."""
        hint = "make the tensors contiguous/supported, or pass fused=False"
        if self.fused:
            prefix = f"{torch_words}; " if torch_words else ""
            raise RuntimeError(f"{type(self).__name__}(fused=True): {prefix}{why}; {hint}")
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(
                f"{type(self).__name__}: {why}; it is updated by the slower reference implementation "
                f"({hint} to silence this).",
                stacklevel=4,
            )
