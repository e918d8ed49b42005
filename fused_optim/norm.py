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
    if fused is not False and tensors:  # (no tensor: nothing for the dispatcher to pick a kernel by)
        try:
            _build.load()
            result = _ops.op("l2norm")(tensors)
            return result if per_tensor else result[0]
        except _build.BuildError:
            if fused:
                raise
            warnings.warn("multi_tensor_l2norm: the kernels did not build; using torch.linalg.vector_norm",
                          stacklevel=2)
        except NotImplementedError:  # the dispatcher found no kernel for these tensors
            _refuse_or_warn(tensors, fused)
    result = _reference.l2norm(tensors)
    return result if per_tensor else result[0]


def _refuse_or_warn(tensors: list[Tensor], fused: bool | None) -> None:
    """Sparse tensors are never supported; other devices have no kernel yet (the reference runs)."""
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:
            raise RuntimeError(f"multi_tensor_l2norm: tensors[{i}] is sparse; only dense tensors are supported")
    devices = ", ".join(sorted({str(t.device) for t in tensors if t.device.type != "cpu"}))
    if fused:
        raise RuntimeError(f"multi_tensor_l2norm(fused=True): no kernel for tensors on {devices} yet; pass fused=None")
    warnings.warn(f"multi_tensor_l2norm: no kernel for tensors on {devices} yet; using torch.linalg.vector_norm",
                  stacklevel=3)
