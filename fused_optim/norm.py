"""``multi_tensor_l2norm``: per-tensor and global L2 norms of a tensor list in one kernel pass."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

from . import _build, _ops, _reference


def multi_tensor_l2norm(tensors: Iterable[Tensor], per_tensor: bool = False, *, fused: bool | None = None):
    r"""The global L2 norm of ``tensors`` (and, with ``per_tensor=True``, each tensor's norm).

    ::

        norms[i] = ‖tensors[i]‖₂ = √(Σ x²)        global = √(Σᵢ norms[i]²)

    One parallel pass over all tensors; squares accumulate in fp32 for fp16/bf16/fp32 inside
    16K-element work items and in double across items and tensors, always in the same order, so the
    result does not depend on the number of threads. Tensors may mix floating dtypes; results are
    float32 (float64 when any input is float64). ``fused`` as for the optimizers: None uses the
    kernel when it builds and the tensors are on the CPU (else ``torch.linalg.vector_norm``, with a
    warning), True requires the kernel, False never uses it.

    Returns:
        ``global_norm`` (0-dim tensor), or ``(global_norm, norms)`` with ``per_tensor=True``.
    """
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:
            raise RuntimeError(f"multi_tensor_l2norm: tensors[{i}] is sparse; only dense tensors are supported")
    result = (_ops.op("l2norm")(tensors) if _use_kernel(tensors, fused) else _reference.l2norm(tensors))
    return result if per_tensor else result[0]


def _use_kernel(tensors: list[Tensor], fused: bool | None) -> bool:
    if fused is False or not tensors:  # no tensor: nothing for the dispatcher to pick a kernel by
        return False
    why = next((f"a tensor is on {t.device}" for t in tensors if t.device.type != "cpu"), None)
    if why is None:
        try:
            _build.load()
            return True
        except _build.BuildError:
            if fused:
                raise
            why = "the kernels did not build"
    if fused:
        raise RuntimeError(f"multi_tensor_l2norm(fused=True): {why}, and there is no kernel for that; pass fused=None")
    warnings.warn(f"multi_tensor_l2norm: {why}; using torch.linalg.vector_norm", stacklevel=3)
    return False
