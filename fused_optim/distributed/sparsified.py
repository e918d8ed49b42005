"""``CentralizedSparsifiedSGD``: sparsified SGD with error feedback whose k coordinates per tensor
are gathered from every rank (mlbench_core)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .._reference import sparse_indices
from ..optimizer import run_closure
from ..sparsified_sgd import SparsifiedSGD
from . import comm


class CentralizedSparsifiedSGD(SparsifiedSGD):
    r"""Sparsified SGD with memory (Stich et al., 2018) over N ranks.

    Per step, per param group (η lr, λ weight_decay, k sparse_grad_size), on every rank::

        memory ← memory + η·g                         (every param of the group)
        S      ← k coordinates per param, as SparsifiedSGD draws them (random, or a random block)
        s      ← memory restricted to S ;  memory[S] ← 0
        u      ← Σ_ranks scatter(s)  (one all_gather of all params' (index, value) pairs)
        u      ← u / N                                 if average_world
        p      ← p − (u + λ·p)                         (λ not multiplied by η, as the reference)

    Deviations from mlbench_core (bugs not copied): the indices travel as int64 (mlbench sends
    them as float values, exact only below 2²⁴ elements); one all_gather per group instead of one
    per param; any param shape (mlbench needs (1, D)); the block draw covers the last D mod k
    coordinates (that shorter block padded with pairs that add nothing, so every rank sends the
    same count whichever blocks it drew); the params are not re-initialised by the constructor;
    a None grad counts as zero (every rank must send the same number of coordinates); the
    coordinates come from the optimizer's own generator (``seed``; each rank may draw its own),
    saved in the state dict.
    ``get_estimated_weights`` / ``update_estimated_weights`` are SparsifiedSGD's.

    Args: as mlbench's, plus ``seed`` (the private generator's; None: random). ``world_size``:
        None uses the process group's size (mlbench master's default 1 would skip the division).
    """

    _step_supports_amp_scaling = False  # this step does not read grad_scale / found_inf

    def __init__(self, params=None, lr: float | None = None, weight_decay: float = 0.0, sparse_grad_size: int = 10,
                 random_sparse: bool = False, world_size: int | None = None, average_world: bool = True, *,
                 seed: int | None = None):
        if params is None:
            raise ValueError('"params" not set for optimizer')
        super().__init__(params, comm.given_lr(lr), weight_decay, sparse_grad_size, random_sparse, seed=seed,
                         fused=False)
        self.world_size = comm.world_size_of(world_size, type(self).__name__)
        self.average_world = average_world
        if self.world_size > 1:
            comm.check_same_params(type(self).__name__,
                                   [p for group in self.param_groups for p in group["params"]])

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) keeps its world
        return {**super().__getstate__(), "world_size": self.world_size, "average_world": self.average_world}

    def _draw(self, params: list[Tensor], group: dict) -> list[Tensor]:
        """The flat indices each param sends this step."""
        return [sparse_indices(p.numel(), group["sparse_grad_size"], group["random_sparse"], self.generator)
                for p in params]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = run_closure(closure)
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            memories = []
            for p in params:
                self._init_state(p, self.state[p], group)
                memories.append(self.state[p]["memory"])
            torch._foreach_add_(memories, grads, alpha=group["lr"])
            indices = self._draw(params, group)
            offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
            values = torch.cat([m.view(-1)[i] for m, i in zip(memories, indices)])
            for m, i in zip(memories, indices):
                m.view(-1).index_fill_(0, i.to(m.device), 0)
            flat_index, values = self._padded(indices, offsets, values, group["sparse_grad_size"])
            flat_index = flat_index.to(values.device)
            if self.world_size > 1:
                flat_index, values = self._gather(flat_index), self._gather(values)
            update = torch.zeros(offsets[-1] + 1, dtype=values.dtype, device=values.device)  # + the padding's slot
            update.index_add_(0, flat_index, values)
            update = update[:-1]
            if self.average_world:
                update.div_(self.world_size)
            update = comm.views(update, [p.shape for p in params])
            if group["weight_decay"] != 0:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_sub_(params, update)
        return loss

    @staticmethod
    def _padded(indices: list[Tensor], offsets: list[int], values: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """All params' flat (index, value) pairs, padded to Σ min(k, D) pairs: a block draw's last
        block is shorter (D mod k), so ranks drawing different blocks would send different counts,
        which all_gather cannot take. A padding pair adds 0 to the slot after the last param's
        (``offsets[-1]``), which the update drops: the params' sums are untouched."""
        sizes = [b - a for a, b in zip(offsets, offsets[1:])]
        pad = sum(min(k, d) for d in sizes) - len(values)
        flat_index = torch.cat([*(i + o for i, o in zip(indices, offsets)),
                                torch.full((pad,), offsets[-1], dtype=torch.long)])
        return flat_index, torch.cat([values, values.new_zeros(pad)])

    @staticmethod
    def _gather(t: Tensor) -> Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts)
