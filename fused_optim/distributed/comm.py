"""Collectives over flat buckets, and the agreement checks every distributed optimizer runs.

A bucket is a run of consecutive tensors of one dtype and device, at most ``bucket_cap_mb`` MiB
(DDP's default 25), packed into one flat tensor by one ``torch.cat`` and unpacked by one
``torch._foreach_copy_``: a step costs a few collectives, not one per tensor, and no host sync.
``by_layer=True`` makes every tensor its own bucket (mlbench's per-layer aggregation).

Checks use one small ``all_gather`` that every rank runs, so a bad input raises the same error on
every rank instead of leaving some ranks waiting in a collective that never completes. A rank that
never joins a collective is caught by the process group's ``timeout`` (pass a short one to
``init_process_group`` in tests): the collective then raises on the ranks that did join.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .gloo_group import collective_group

DEFAULT_BUCKET_CAP_MB = 25.0


def params_of(model) -> list[Tensor]:
    """The params that require grad of a ``torch.nn.Module`` (mlbench's ``model`` argument), or of
    an iterable of params: frozen params are neither communicated nor stepped (as under DDP)."""
    if model is None:
        raise ValueError('"model" not set for optimizer: pass the torch.nn.Module whose parameters it trains')
    params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
    if any(isinstance(p, dict) for p in params):
        raise ValueError("param groups (dicts; mmengine's paramwise_cfg makes them) are not supported: the "
                         "distributed optimizers communicate one param list, give them the model's parameters")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameters that require grad: nothing to optimize")
    return params


def given_lr(lr: float | None) -> float:
    """``lr``, which mlbench's signatures require (their default is torch's ``required``)."""
    if lr is None:
        raise ValueError('"lr" not set for optimizer: pass lr=...')
    return lr


def world_size_of(world_size: int | None, who: str) -> int:
    """``world_size``, checked against the default process group (None: the group's size)."""
    actual = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size is None:
        return actual
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who}: world_size={world_size} but no process group: call "
                           "torch.distributed.init_process_group (or fused_optim.process_group.init_process_group) "
                           "first")
    if world_size != actual:
        raise ValueError(f"{who}: world_size={world_size} but the process group has {actual} ranks: "
                         f"pass world_size={actual} (or leave it None)")
    return world_size


def buckets(tensors: Sequence[Tensor], by_layer: bool, cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> list[list[int]]:
    """Indices of ``tensors`` in buckets: consecutive, one dtype and device, ≤ cap_mb MiB each."""
    out: list[list[int]] = []
    size = 0
    cap = cap_mb * 2**20
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if (by_layer or not out or size + nbytes > cap or t.dtype != tensors[out[-1][0]].dtype
                or t.device != tensors[out[-1][0]].device):
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def pack(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """One flat tensor holding ``tensors`` in order (a copy; written into ``out`` if given)."""
    return torch.cat([t.reshape(-1) for t in tensors], out=out)


def reusable(buffers: list, b: int, part: Sequence[Tensor]) -> Tensor:
    """``buffers[b]``, a flat buffer for bucket ``part`` kept from call to call (a fresh 25 MiB
    tensor each step costs its page faults: as much as packing it); made, or remade when the
    bucket's size, dtype or device changed."""
    buffers.extend([None] * (b + 1 - len(buffers)))
    numel, buf = sum(t.numel() for t in part), buffers[b]
    if buf is None or buf.numel() != numel or buf.dtype != part[0].dtype or buf.device != part[0].device:
        buf = buffers[b] = torch.empty(numel, dtype=part[0].dtype, device=part[0].device)
    return buf


def views(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """``flat`` cut into consecutive views of the given shapes."""
    sizes = [math.prod(s) for s in shapes]
    return [v.view(s) for v, s in zip(flat.split(sizes), shapes)]


def unpack_(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (one foreach call; any memory layout)."""
    torch._foreach_copy_(list(tensors), views(flat, [t.shape for t in tensors]))


def start_sum(part: Sequence[Tensor], divisor: float | Tensor, divide_before: bool, in_place: bool = False,
              out: Tensor | None = None):
    """Pack ``part`` (one bucket; into ``out`` if given) and launch its all-reduce (``async_op``);
    ``divide_before`` divides this rank's share first. ``in_place``: a bucket of one contiguous
    tensor is reduced in it, without the copies (only when nothing writes to it until
    :func:`finish_mean_`). Returns (the flat buffer, the collective's work)."""
    flat = part[0].view(-1) if in_place and len(part) == 1 and part[0].is_contiguous() else pack(part, out)
    if divide_before:
        flat.div_(divisor)
    return flat, all_reduce_async(flat)


def all_reduce_async(t: Tensor):
    """Launch ``t ← Σ_ranks t`` on the optimizers' group (:mod:`.gloo_group`); returns its work."""
    return dist.all_reduce(t, async_op=True, group=collective_group())


def finish_mean_(flat: Tensor, work, part: Sequence[Tensor], divisor: float | Tensor, divide_before: bool) -> None:
    """Wait for :func:`start_sum`'s all-reduce, divide (unless done before), unpack into ``part``
    (unless it was reduced in place); dividing and unpacking are one pass (``div(out=)``)."""
    work.wait()
    if len(part) == 1 and flat.data_ptr() == part[0].data_ptr():
        if not divide_before:
            flat.div_(divisor)
    elif divide_before:
        unpack_(flat, part)
    else:
        for t, v in zip(part, views(flat, [t.shape for t in part])):
            torch.div(v, divisor, out=t)


def all_reduce_mean_(tensors: Sequence[Tensor], divisor: float | Tensor, *, divide_before: bool = False,
                     by_layer: bool = False, cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                     buffers: list | None = None) -> None:
    """``t ← (Σ_ranks t) / divisor`` in place, per bucket; ``divide_before`` divides each rank's
    share first (mlbench's guard against fp16 overflow). A bucket of one contiguous tensor is
    reduced in place. Every bucket's all-reduce is launched before the first is waited for (all
    in flight at once: with ``by_layer``, one per tensor, their latencies overlap). ``buffers``: a
    list the caller keeps, holding the packed buckets' buffers from call to call (:func:`reusable`)."""
    start_mean_(tensors, divisor, divide_before=divide_before, by_layer=by_layer, cap_mb=cap_mb, buffers=buffers)()


def start_mean_(tensors: Sequence[Tensor], divisor: float | Tensor, *, divide_before: bool = False,
                by_layer: bool = False, cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                buffers: list | None = None) -> Callable[[], None]:
    """:func:`all_reduce_mean_` launched: returns the function that waits for it and finishes
    it (``tensors`` must not be written in between; other work can run meanwhile)."""
    parts = [[tensors[i] for i in idx] for idx in buckets(tensors, by_layer, cap_mb)]
    started = [start_sum(part, divisor, divide_before, in_place=True,
                         out=None if buffers is None or len(part) == 1 else reusable(buffers, b, part))
               for b, part in enumerate(parts)]

    def finish() -> None:
        for (flat, work), part in zip(started, parts):
            finish_mean_(flat, work, part, divisor, divide_before)

    return finish


def gather_rows(who: str, row: Sequence[int], device=None) -> Tensor:
    """Every rank's ``row`` (equal lengths), as an int64 [world, len] tensor on every rank. A rank
    that never joins makes the others raise once the process group's timeout has passed."""
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(rows, mine)
    except RuntimeError as e:
        raise RuntimeError(f"{who}: the ranks' agreement check at construction failed: every rank of the process "
                           f"group must construct this optimizer; is a rank missing, or did it fail? ({e})") from e
    return torch.stack(rows)


def fingerprint(tensors: Iterable[Tensor]) -> list[int]:
    """[count, elements, crc32 of the shapes and dtypes] of a param list."""
    tensors = list(tensors)
    text = ";".join(f"{tuple(t.shape)}{t.dtype}" for t in tensors)
    return [len(tensors), sum(t.numel() for t in tensors), zlib.crc32(text.encode())]


def check_same_params(who: str, params: Sequence[Tensor]) -> None:
    """Raise on every rank unless every rank has the same param shapes and dtypes, in order (the
    flat buckets would silently mix different params, or wait forever for a longer one)."""
    rows = gather_rows(who, fingerprint(params), params[0].device)
    if bool((rows == rows[0]).all()):
        return
    described = ", ".join(f"rank {r}: {int(c)} tensors of {int(n)} elements"
                          for r, (c, n, _) in enumerate(rows.tolist()))
    raise ValueError(f"{who}: the parameter lists differ across ranks ({described}; or same counts, different "
                     "shapes/dtypes): every rank must build the same model and pass its params in the same order")
