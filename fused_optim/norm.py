"""The multi-tensor norm kernels: ``multi_tensor_l2norm`` (per-tensor and global L2 norms of a tensor
list in one pass), ``sum_squares_`` (per-group sums of squares, for AdaScale) and
``grad_sum_squares_`` (the same of the params' ``.grad``); ``whole_tensor_sums``, the sums of
squares of tensors that may be DTensor shards, over the whole tensors."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

from . import _build, _ops, _reference, sharding


def multi_tensor_l2norm(tensors: Iterable[Tensor], per_tensor: bool = False, *, fused: bool | None = None):
    r"""The global L2 norm of ``tensors`` (and, with ``per_tensor=True``, each tensor's norm).

    ::

        norms[i] = ‖tensors[i]‖₂ = √(Σ x²)        global = √(Σᵢ norms[i]²)

    One parallel pass over all tensors; squares accumulate in fp32 for fp16/bf16/fp32 inside
    16K-element work items and in double across items and tensors, always in the same order, so the
    result does not depend on the number of threads. Tensors may mix floating dtypes; results are
    float32 (float64 when any input is float64). ``fused`` as for the optimizers: None uses the
    kernel when it builds and the tensors are on the CPU or a GPU (else ``torch.linalg.vector_norm``,
    with a warning), True requires the kernel, False never uses it. Tensors on several devices are
    normed per device and gathered on the first tensor's device. DTensors are normed as whole
    tensors (:func:`whole_tensor_sums`: one all-reduce of per-tensor sums; float64 results).

    Returns:
        ``global_norm`` (0-dim tensor), or ``(global_norm, norms)`` with ``per_tensor=True``.
    """
    tensors = list(tensors)
    if any(sharding.is_dtensor(t) for t in tensors):
        sums = whole_tensor_sums(tensors, fused=fused)
        result = sums.sum().sqrt(), sums.sqrt()
    elif len({t.device for t in tensors}) > 1:
        result = _l2norm_per_device(tensors, fused)
    else:
        result = _kernel_or_reference("multi_tensor_l2norm", "l2norm", _reference.l2norm, fused, tensors, tensors)
    return result if per_tensor else result[0]


def _l2norm_per_device(tensors: list[Tensor], fused: bool | None) -> tuple[Tensor, Tensor]:
    """Tensors on several devices (CPU-offloaded params next to GPU ones): one call per device,
    the norms gathered on the first tensor's device, global = √(Σᵢ norms[i]²)."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = torch.empty(len(tensors), dtype=dtype, device=tensors[0].device)
    for device in dict.fromkeys(t.device for t in tensors):
        index = [i for i, t in enumerate(tensors) if t.device == device]
        _, per = multi_tensor_l2norm([tensors[i] for i in index], per_tensor=True, fused=fused)
        norms[torch.tensor(index, device=norms.device)] = per.to(norms.device, dtype)
    return norms.square().sum().sqrt(), norms


def whole_tensor_sums(tensors: list[Tensor], *, fused: bool | None = None) -> Tensor:
    r"""``sums[i] = Σ tensors[i]²`` over the whole tensor, in float64: a DTensor's local sums
    (:func:`sum_squares_` of the local tensors) are summed over the mesh dimensions that shard it
    (:func:`.sharding.all_reduce_rows`: one all-reduce for FSDP2's params); every rank gets the
    same sums. Plain tensors are summed as they are."""
    local = sharding.locals_of(tensors)
    sums = torch.zeros(len(local), dtype=torch.float64, device=local[0].device if local else None)
    sum_squares_(sums, local, list(range(len(local))), fused=fused)
    sharding.all_reduce_rows(sums, tensors)
    return sums


def sum_squares_(sums: Tensor, tensors: list[Tensor], index: list[int], *, fused: bool | None = None) -> None:
    r"""``sums[index[i]] += Σ tensors[i]²`` for every i: one pass over all tensors.

    ``sums`` is a 1-D float64 tensor (say one entry per param group); squares accumulate as in
    :func:`multi_tensor_l2norm` and are added in tensor order, independent of the thread count.
    ``fused`` as there.
    """
    _kernel_or_reference("sum_squares_", "sum_squares_", _reference.sum_squares_, fused, tensors, sums, tensors, index)


def grad_sum_squares_(sums: Tensor, params: list[Tensor], index: list[int], *, fused: bool | None = None) -> None:
    r"""``sums[index[i]] += Σ params[i].grad²`` for the params that have a grad, as
    :func:`sum_squares_` (the kernel reads the grads on the C++ side). ``fused`` as there."""
    _kernel_or_reference("grad_sum_squares_", "grad_sum_squares_", _reference.grad_sum_squares_, fused, params, sums,
                         params, index)


def _kernel_or_reference(name: str, op: str, reference, fused: bool | None, tensors: list[Tensor], *args):
    """The op ``op(*args)`` when the build and the device of ``tensors`` allow, else
    ``reference(*args)`` (with a warning, or an error under ``fused=True``). (Called once per
    parameter by AdaScale's hooks: no closures here.)"""
    if fused is not False and tensors:  # (no tensor: nothing for the dispatcher to pick a kernel by)
        try:
            _build.load("cuda" if any(t.is_cuda for t in tensors) else "cpu")
            return _ops.op(op)(*args)
        except _build.BuildError:
            if fused:
                raise
            warnings.warn(f"{name}: the kernels did not build; using the PyTorch reference", stacklevel=3)
        except NotImplementedError:  # the dispatcher found no kernel for these tensors
            _refuse_or_warn(name, tensors, fused)
    return reference(*args)


def _refuse_or_warn(name: str, tensors: list[Tensor], fused: bool | None) -> None:
    """Sparse tensors are never supported; other devices have no kernel yet (the reference runs)."""
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:
            raise RuntimeError(f"{name}: tensors[{i}] is sparse; only dense tensors are supported")
    devices = ", ".join(sorted({str(t.device) for t in tensors if t.device.type != "cpu"}))
    if fused:
        raise RuntimeError(f"{name}(fused=True): no kernel for tensors on {devices} yet; pass fused=None")
    warnings.warn(f"{name}: no kernel for tensors on {devices} yet; using the PyTorch reference", stacklevel=4)
