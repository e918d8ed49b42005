"""Params sharded across processes as ``DTensor`` (FSDP2's ``fully_shard``, tensor parallelism).

A DTensor param is updated through the kernels on its local tensor (``to_local()``: the shard
this process holds, or its replica), with its grad's local tensor and the local tensors of its
state. Its state tensors are made like the param, so they are DTensors with the param's mesh and
placements, which ``torch.distributed.checkpoint`` saves and reshards; step counters and rounding
keys stay plain tensors (the same on every rank).

An elementwise update of a shard is the update of those elements of the whole tensor, so a
sharded step equals the unsharded one bit for bit. A layer-wise one (LARS, LAMB: the ops whose
spec takes ``norm_sums``) needs norms of whole tensors: :func:`all_reduce_rows` sums each
tensor's local sums of squares over the mesh dimensions that shard it — a ``Replicate``
dimension holds copies, summed once — and the op is called twice (:func:`run_layerwise`):
the local sums only, then the update with the sums of the whole tensors.

``torch.distributed.tensor`` is looked up in ``sys.modules``, never imported here: where nobody
imported it, no DTensor exists, and a plain optimizer pays no import.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor


_DTENSOR: list[type] = []  # the DTensor class, once imported (is_dtensor runs per tensor per step)


def dtensor_type() -> type | None:
    """The ``DTensor`` class when ``torch.distributed.tensor`` was imported, else None."""
    if not _DTENSOR:
        cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if cls is None:
            return None
        _DTENSOR.append(cls)
    return _DTENSOR[0]


def is_dtensor(t) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (the same storage: the kernels update it in place), else ``t``.
    Its callers read it or update it under ``no_grad`` (a step), where no gradient flows through
    it: ``DTensor._local_tensor`` (torch 2.13), which ``to_local()`` returns too (a view of it for
    a Parameter), through an autograd Function's ``apply`` of ~2 µs a call even under ``no_grad``:
    a millisecond per step of ResNet-50's 161 params, whose params, grads and two moments are
    DTensors under FSDP2, 7% of its 25.6M-param Adam step."""
    return t._local_tensor if is_dtensor(t) else t


def locals_of(tensors: list) -> list:
    """:func:`local` of each element of a list of tensors (other lists, of flags, unchanged);
    inlined, as it runs for every tensor of a sharded step."""
    cls = dtensor_type()
    return list(tensors) if cls is None else [t._local_tensor if isinstance(t, cls) else t for t in tensors]


def layout(t: Tensor) -> tuple | None:
    """(mesh, placements) of a DTensor, None for a plain tensor: params of one bucket share it."""
    return (t.device_mesh, tuple(t.placements)) if is_dtensor(t) else None


def unfit_placements(p: Tensor) -> str | None:
    """Why no optimizer can step DTensor ``p`` as it is placed (a ``Partial`` placement: pending
    sums, not values), or None."""
    if is_dtensor(p):
        pending = [pl for pl in p.placements if pl.is_partial()]
        if pending:
            return (f"is a DTensor with a Partial placement ({pending[0]}): its values are pending sums; "
                    "redistribute it to Shard or Replicate placements before the optimizer steps it")
    return None


def grad_mismatch(p: Tensor, g: Tensor) -> str | None:
    """Why ``g`` cannot be the grad of ``p`` for a step on local tensors (the grad of a DTensor
    param must be a DTensor placed as the param is, so that their local tensors hold the same
    elements), or None."""
    pl, gl = layout(p), layout(g)
    if pl == gl:
        return None
    if pl is None or gl is None:
        kinds = ("a DTensor" if pl else "a plain tensor", "a DTensor" if gl else "a plain tensor")
        return f"is {kinds[0]} but its gradient is {kinds[1]}; give the param a gradient of its own kind"
    return (f"is a DTensor placed {list(pl[1])} on {pl[0]} but its gradient is placed {list(gl[1])} on {gl[0]}; "
            "redistribute the gradient to the param's placements (grad.redistribute(p.device_mesh, p.placements))")


def check_format(p: Tensor, state: dict, where: str) -> None:
    """Raises for a DTensor param with 8-bit state that the kernels do not step: its codes are
    blocked per shard (:mod:`.sharded_blocks`), and the reference implementation blocks whole
    tensors."""
    if is_dtensor(p) and any(isinstance(v, Tensor) and v.dtype == torch.uint8 for v in state.values()):
        raise ValueError(f"{where} is a DTensor with state_dtype='8bit', whose codes are blocked per shard and "
                         "stepped by the fused kernels only, which do not step this param (see the warning, or "
                         "fused=False); use state_dtype=torch.bfloat16 for its group, or a device and dtype the "
                         "kernels serve")


def shards(placement) -> bool:
    """Whether a DTensor placement splits the tensor over its mesh dimension: ``Shard`` and
    ``_StridedShard`` (FSDP2 over tensor parallelism; not an ``is_shard()`` one in torch 2.13),
    anything but ``Replicate`` and ``Partial``."""
    return not (placement.is_replicate() or placement.is_partial())


def box_offsets(p: Tensor) -> list[int]:
    """Where DTensor ``p``'s local tensor starts in its whole tensor, per dimension, by DTensor's
    own rule (the one ``torch.distributed.checkpoint`` saves shards by): the local tensor is the
    box of its shape at these offsets, also under FSDP2 over tensor parallelism (``_StridedShard``
    on the dimension tensor parallelism shards: a range of that range)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return [int(o) for o in offset]


def element_offset(p: Tensor) -> int:
    """The index in DTensor ``p``'s whole tensor (row-major) of its local tensor's first element,
    where the local tensor is a contiguous range of the whole: a box of whole rows (FSDP2's
    ``Shard(0)``, also over tensor parallelism; any replicas beside). Stochastic rounding draws
    each element's bits by that index plus its local one, so a shard rounds as the unsharded
    tensor does. 0 for a plain tensor, and for a box that cuts rows (tensor parallelism's
    ``Shard(1)``: its elements are no range of the whole, and draw their bits by the local index,
    unbiased still, but not the unsharded tensor's)."""
    if not is_dtensor(p) or not p.dim() or tuple(p.to_local().shape[1:]) != tuple(p.shape[1:]):
        return 0
    return box_offsets(p)[0] * math.prod(p.shape[1:])


def sharded_dims(p: Tensor) -> list[int]:
    """The mesh dimensions that shard DTensor ``p`` (none for a plain tensor or a replica)."""
    if not is_dtensor(p):
        return []
    return [d for d, pl in enumerate(p.placements) if shards(pl)]


def mesh_device(mesh, near: torch.device | None = None) -> torch.device:
    """The device a mesh's collectives run on for this rank: ``near`` where it is of the mesh's
    type, else the mesh's accelerator's current one. A param's local tensor may live elsewhere
    (FSDP2's ``CPUOffloadPolicy`` keeps shards on the CPU of a CUDA mesh, whose NCCL group takes
    CUDA tensors only)."""
    kind = mesh.device_type
    if near is not None and near.type == kind:
        return near
    return torch.device(kind) if kind == "cpu" else torch.device(kind, torch.get_device_module(kind).current_device())


def all_reduce_rows(sums: Tensor, params: list[Tensor]) -> None:
    """``sums[t]`` (row t: local sums of squares over param t's local tensor) becomes the sums of
    the whole tensor: for each mesh dimension, one all-reduce of the rows of the params it shards
    (over that dimension's process group, on the mesh's device: :func:`mesh_device`). Plain
    tensors and replicas keep their rows; a dimension that only replicates a param is not summed
    (its copies are equal). With every param sharded on one mesh dimension (FSDP2) that is one
    all-reduce of the whole buffer."""
    import torch.distributed as dist  # (only a DTensor's step gets here: distributed is available)

    by_group: dict[tuple, list[int]] = {}
    for t, p in enumerate(params):
        for d in sharded_dims(p):
            by_group.setdefault((p.device_mesh, d), []).append(t)
    for (mesh, d), rows in by_group.items():
        index = None if len(rows) == sums.shape[0] else torch.tensor(rows, device=sums.device)
        part = (sums if index is None else sums.index_select(0, index)).to(mesh_device(mesh, sums.device))
        dist.all_reduce(part, group=mesh.get_group(d))
        if index is None:
            sums.copy_(part)  # (part is sums where the devices agree)
        else:
            sums.index_copy_(0, index, part.to(sums.device))


def run_layerwise(op, lists: tuple, params: list[Tensor], kwargs: dict) -> None:
    """A layer-wise op over sharded params (``lists``: its tensor lists, of local tensors;
    ``params``: the DTensor params, for their meshes): the local per-tensor sums (the op's
    ``sums_only`` call, which writes nothing else), summed over the shards, then the update with
    the sums of the whole tensors. A failed collective leaves params and state as they were."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("norm_sums", "sums_only")}
    sums = torch.zeros(len(params), 2, dtype=torch.float64, device=lists[0][0].device)
    op(*lists, **kwargs, norm_sums=sums, sums_only=True)
    all_reduce_rows(sums, params)
    op(*lists, **kwargs, norm_sums=sums)
