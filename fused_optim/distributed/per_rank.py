"""Per-rank checkpoints: the entries of a checkpoint that differ between ranks (params under
``DecentralizedSGD``, ``PowerSGD``'s error memories, a DDP comm hook's state) gathered from every
rank into ``checkpoint["per_rank"]`` on save, and each rank's own put back on load. The
framework adapters (Lightning's strategies, mmengine's hook) call these two functions."""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

PER_RANK = "per_rank"  # the checkpoint key: a list, one dict per rank


def gather(checkpoint: dict[str, Any], keys: Sequence[str]) -> list[dict] | None:
    """Every rank's ``{key: checkpoint[key]}`` (the keys it has), as a list indexed by rank, on
    rank 0 (None elsewhere). Every rank must call it."""
    own = {key: checkpoint[key] for key in keys if key in checkpoint}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own, gathered, dst=0)
    return gathered


def restore(checkpoint: dict[str, Any], where: str, ranks_option: str) -> dict[str, Any]:
    """``checkpoint`` with ``per_rank`` removed and this rank's entries on top (unchanged without
    ``per_rank``: another saver's checkpoint loads the same on every rank); a resume on another
    number of ranks is refused, naming ``where`` (the file) and ``ranks_option`` (what sets the
    number of ranks)."""
    per_rank = checkpoint.pop(PER_RANK, None)
    if per_rank is None:
        return checkpoint
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(per_rank) != world:
        raise ValueError(f"{where}: saved by {len(per_rank)} ranks, resumed on {world}: each rank's params and "
                         f"optimizer state are its own; resume with {ranks_option} = {len(per_rank)}")
    checkpoint.update(per_rank[dist.get_rank() if world > 1 else 0])
    return checkpoint
