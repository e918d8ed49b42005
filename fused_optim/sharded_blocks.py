r"""8-bit state of DTensor params: blocks of 256 elements of each shard.

A plain param's 8-bit moments are cut into blocks of 256 elements of the whole tensor, one fp32
absmax each (:mod:`.state_formats`). A shard generally starts inside a block of the whole tensor
(a ``Shard(0)`` split falls between rows, not at multiples of 256), and a block split between two
ranks would need their collective maximum at every step. So a DTensor's codes are blocked by its
local tensor instead: each rank cuts its shard into blocks of 256 and keeps their absmaxes, the
kernels' format for a plain tensor of the shard's elements. The codes are a DTensor placed as the
param; the absmaxes are one DTensor per moment of shape [S, B] (S shards, B the blocks of the
largest shard), ``Shard(0)`` over every mesh dimension that shards the param and ``Replicate``
over the others, so each rank holds one row of B (its first ``blocks_of(local numel)`` in use,
the rest zero). ``torch.distributed.checkpoint`` saves and restores them on the same mesh exactly.

Where each shard's elements start and end defines its blocks, so the codes of one sharding mean
nothing under another. ``state["block_layout"]`` (int64 [S, B, h], h a hash of the param's shape,
the mesh's shape and the placements; the same on every rank) records the sharding the codes
were made under, and loading them for a param sharded otherwise is refused (:func:`check_layout`;
``torch.distributed.checkpoint`` already refuses another [S, B] by its own size check). Where each
shard is one range of the whole tensor's elements (rows: ``Shard(0)``) whose bounds are multiples
of 256, its blocks are those of the whole tensor and the sharded step equals the unsharded one bit
for bit; shards of columns hold elements of many whole-tensor blocks, and match per shard only.
"""

from __future__ import annotations

import hashlib
import math
import sys

import torch
from torch import Tensor

from .sharding import shards
from .state_formats import blocks_of, decode_8bit, encode_8bit

LAYOUT_KEY = "block_layout"


def _shard_placement():
    return sys.modules["torch.distributed.tensor"].Shard


def largest_local_numel(t: Tensor) -> int:
    """The elements of DTensor ``t``'s largest shard: each sharded dimension split in turn by the
    mesh dimensions that shard it, whose first chunk (⌈n / k⌉) is the largest."""
    shape = list(t.shape)
    for mesh_dim, pl in enumerate(t.placements):
        if shards(pl):
            d = pl.dim % t.dim()
            shape[d] = -(-shape[d] // t.device_mesh.size(mesh_dim))
    return math.prod(shape)


def shard_count(t: Tensor) -> int:
    """S: the shards of DTensor ``t`` (the product of the sizes of the mesh dimensions that shard it)."""
    return math.prod(t.device_mesh.size(d) for d, pl in enumerate(t.placements) if shards(pl))


def layout_of(t: Tensor) -> Tensor:
    """``state["block_layout"]`` for DTensor param (or state tensor) ``t``: int64 [S, B, h]."""
    text = repr((tuple(t.shape), tuple(t.device_mesh.shape), [str(pl) for pl in t.placements]))
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    return torch.tensor([shard_count(t), blocks_of(largest_local_numel(t)), h], dtype=torch.int64)


def wrap_absmax(local_absmax: Tensor, like: Tensor) -> Tensor:
    """The absmax DTensor of a shard's ``local_absmax`` (its blocks), for DTensor ``like`` (the
    param or one of its state tensors): [S, B], this shard's row zero-padded to B, placed
    ``Shard(0)`` where ``like`` is sharded and ``Replicate`` elsewhere."""
    dtensor = sys.modules["torch.distributed.tensor"]
    s, b, _ = layout_of(like).tolist()
    padded = torch.zeros(1, b, dtype=torch.float32, device=local_absmax.device)
    padded.view(-1)[:local_absmax.numel()] = local_absmax
    placements = [_shard_placement()(0) if shards(pl) else dtensor.Replicate() for pl in like.placements]
    return dtensor.DTensor.from_local(padded, like.device_mesh, placements, run_check=False, shape=(s, b),
                                      stride=(b, 1))


def local_absmax(absmax: Tensor, like: Tensor) -> Tensor:
    """The absmaxes in use of this rank's shard (a view: the kernels update them in place)."""
    return absmax.to_local().view(-1)[:blocks_of(like.to_local().numel())]


def wrap_like(local_values: Tensor, like: Tensor) -> Tensor:
    """``local_values`` (a shard's tensor) as a DTensor placed as ``like``."""
    dtensor = sys.modules["torch.distributed.tensor"]
    return dtensor.DTensor.from_local(local_values, like.device_mesh, like.placements, run_check=False,
                                      shape=like.shape, stride=like.stride())


def encode_shards(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """:func:`.state_formats.encode_8bit` of each shard of DTensor ``x``: (codes placed as ``x``,
    absmax DTensor)."""
    codes, absmax = encode_8bit(x.to_local(), signed)
    return wrap_like(codes, x), wrap_absmax(absmax, x)


def decode_shards(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """The fp32 values of DTensor 8-bit ``codes`` (placed as their param) and their ``absmax``."""
    return wrap_like(decode_8bit(codes.to_local(), local_absmax(absmax, codes), signed), codes)


def check_layout(saved: Tensor, param: Tensor, key: str, where: str) -> None:
    """Raises ``ValueError`` where 8-bit ``key`` saved for DTensor ``param`` was made under another
    sharding (its ``block_layout`` ``saved`` differs from the param's)."""
    current = layout_of(param)
    saved = torch.as_tensor(saved).cpu().reshape(-1)
    if not torch.equal(saved, current):
        raise ValueError(
            f"the loaded state of {where} has 8-bit {key!r} made for S={int(saved[0])} shards of B={int(saved[1])} "
            f"blocks, and the param is sharded otherwise (S={int(current[0])}, B={int(current[1])}; mesh "
            f"{tuple(param.device_mesh.shape)}, placements {list(param.placements)}): 8-bit codes are blocked per "
            "shard and cannot be resharded; resume on the mesh and placements they were saved with, or from a "
            "checkpoint saved with state_dtype=torch.bfloat16")
