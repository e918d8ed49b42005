"""torch's ``powerSGD_hook`` with a state that can be saved and restored exactly.

``PowerSGDState`` keeps its error memories and warm-start Q per DDP *bucket*, laid out in the
bucket's order of params. DDP rebuilds its buckets after a process's first step (in the order
the backward made the grads), so a resumed process's first step has another layout than the one
the state was saved in. :class:`PowerSGDKeeper` wraps the hook: it records each bucket's params,
saves the memories per param (:meth:`state_dict`: tensors and numbers, for
``torch.load(weights_only=True)``), and builds each bucket's memories from those pieces in the
layout the bucket has when it is next reduced: at the first step after a restore, and again at
the process's second step, after DDP's rebuild (all of the first step's work is done by then).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from ._compat import should_compress

_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


class PowerSGDKeeper:
    """``hook`` is ``powerSGD_hook`` on ``state``, for ``DistributedDataParallel.register_comm_hook``
    over a module whose parameters are ``params`` (in the module's order)."""

    def __init__(self, state: PowerSGDState, params: Sequence[torch.Tensor]):
        self.state = state
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._layouts: dict[int, list[int]] = {}  # bucket index -> its params (indices), as last reduced
        self._pieces: dict[str, dict[int, torch.Tensor]] = {"error": {}, "q": {}}  # per param, to build from
        self._steps, self._new_step = 0, True  # this process's steps, as the hook sees them

    def hook(self, state: PowerSGDState, bucket):
        if self._new_step:
            self._new_step = False
            self._steps += 1
            if self._steps == 2:  # DDP may have rebuilt its buckets: rebuild the memories to match
                self._to_pieces()
        b = bucket.index()
        layout = [self._index[id(p)] for p in bucket.parameters()]
        self._layouts[b] = layout
        if b not in state.error_dict and b not in state.q_memory_dict:
            self._from_pieces(b, layout)
        self._new_step = bucket.is_last()
        return powerSGD_hook(state, bucket)

    def _compressed(self, layout: list[int]) -> list[tuple[int, int, int]]:
        """(param, Q size m·r, P size n·r) of the params the hook compresses, in its Q order:
        grouped by matrix shape (first appearance first), bucket order within a group."""
        groups: dict[tuple[int, int], list] = {}
        for i in layout:
            p = self.params[i]
            n = p.shape[0]
            m = p.numel() // n
            r = min(n, m, self.state.matrix_approximation_rank)
            if should_compress(n, m, r, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((i, m * r, n * r))
        return [entry for group in groups.values() for entry in group]

    def _cut(self) -> dict[str, dict[int, torch.Tensor]]:
        """Every bucket's memories cut into per-param pieces (views), with the pieces not yet built in."""
        state = self.state
        pieces = {kind: dict(found) for kind, found in self._pieces.items()}
        for b, layout in self._layouts.items():
            if b in state.error_dict:
                sizes = [self.params[i].numel() for i in layout]
                pieces["error"].update(zip(layout, state.error_dict[b].split(sizes)))
            if b in state.q_memory_dict:
                compressed = self._compressed(layout)
                parts = state.q_memory_dict[b].split([q for _, q, _ in compressed])
                pieces["q"].update((i, part) for (i, _, _), part in zip(compressed, parts))
        return pieces

    def _to_pieces(self) -> None:
        """Keep the memories per param only: the buckets' are built again when next reduced."""
        self._pieces = {kind: {i: t.clone() for i, t in found.items()} for kind, found in self._cut().items()}
        for memories in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memories.clear()

    def _from_pieces(self, b: int, layout: list[int]) -> None:
        """Bucket ``b``'s memories from the pieces of its params, where there are any."""
        state, error, q = self.state, self._pieces["error"], self._pieces["q"]
        if all(i in error for i in layout):
            state.error_dict[b] = torch.cat([error.pop(i) for i in layout])
        compressed = self._compressed(layout)
        if compressed and all(i in q for i, _, _ in compressed):
            state.q_memory_dict[b] = torch.cat([q.pop(i) for i, _, _ in compressed])
            state.p_memory_dict[b] = torch.empty(sum(p for _, _, p in compressed), dtype=state.q_memory_dict[b].dtype,
                                                 device=state.q_memory_dict[b].device)  # recomputed before use

    def state_dict(self) -> dict:
        """The memories per param, the counters and the numpy generator's state."""
        _, keys, pos, has_gauss, cached = self.state.rng.get_state()
        pieces = {kind: {i: t.detach().clone() for i, t in found.items()} for kind, found in self._cut().items()}
        return {**pieces, **{name: int(getattr(self.state, name)) for name in _COUNTERS},
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)}}

    def load_state_dict(self, saved: dict, device) -> None:
        """Memories (onto ``device``) to be built into each bucket when it is next reduced."""
        for memories in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memories.clear()
        self._pieces = {kind: {int(i): t.to(device) for i, t in saved[kind].items()} for kind in ("error", "q")}
        for name in _COUNTERS:
            setattr(self.state, name, int(saved[name]))
        rng = saved["rng"]
        self.state.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                                  rng["cached_gaussian"]))
