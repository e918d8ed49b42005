"""``DecentralizedSGD``: SGD, then gossip averaging with the neighbours (mlbench_core), and the
``ring`` / ``torus`` neighbour lists."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..torch_optim import SGD
from . import comm
from .wrapper import CommunicatingOptimizer


def ring(rank: int, world_size: int) -> list[int]:
    """The neighbours of ``rank`` on a ring of ``world_size`` ranks (one for 2 ranks, none for 1)."""
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})


def torus(rank: int, rows: int, cols: int) -> list[int]:
    """The neighbours of ``rank`` on a rows × cols torus (ranks row-major): up, down, left, right,
    without repeats (a side of 2 or 1 wraps onto the same rank)."""
    r, c = divmod(rank, cols)
    around = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c, r * cols + (c - 1) % cols,
              r * cols + (c + 1) % cols}
    return sorted(around - {rank})


class DecentralizedSGD(CommunicatingOptimizer):
    r"""SGD (:class:`fused_optim.SGD`: momentum, dampening, weight decay, Nesterov), then each rank
    i averages its params with its neighbours' N(i)::

        p_i ← SGD step of p_i
        p_i ← (p_i + Σ_{j ∈ N(i)} p_j) / (|N(i)| + 1)

    The params travel in flat buckets, exchanged with each neighbour by non-blocking
    ``isend`` / ``irecv`` (tagged with the bucket's index), the next bucket's exchange started
    before this one's is waited for; the neighbours' buckets are added to the params in place, in
    the order of ``neighbors``. The neighbour lists must form an undirected graph (j ∈ N(i) ⇔ i ∈ N(j)),
    without self-loops, repeats or ranks outside the group: checked at construction on every rank
    with one all_gather, which raises the same error everywhere.

    Deviations from mlbench_core (bugs not copied): rank 0 is valid (mlbench's ``if not rank``
    rejects it); the closure runs before the step and its loss is returned (as torch's SGD);
    params are averaged in place; a rank with no neighbours takes plain SGD steps; ``rank`` must
    be this process's rank in the default group.
    """

    def __init__(self, rank: int | None = None, neighbors=None, model=None, lr: float | None = None,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 average_world: bool = True, use_cuda: bool = False, by_layer: bool = False, *,
                 bucket_cap_mb: float = comm.DEFAULT_BUCKET_CAP_MB):
        if neighbors is None:
            raise ValueError('"neighbors" not set for optimizer: pass the list of neighbour ranks '
                             "(e.g. fused_optim.distributed.ring(rank, world_size))")
        if not average_world:
            raise ValueError("DecentralizedSGD averages with its neighbours: average_world must be True")
        params = comm.params_of(model)
        super().__init__(SGD(params, lr=comm.given_lr(lr), momentum=momentum, dampening=dampening,
                             weight_decay=weight_decay, nesterov=nesterov))
        self.model = model
        self.params = params
        self.neighbors = [int(n) for n in neighbors]
        self.by_layer = by_layer
        self.bucket_cap_mb = bucket_cap_mb
        self._communicates_before = False
        self._scratch: dict = {}  # (slot, dtype, device) -> the buffers of _rows
        world = comm.world_size_of(None, "DecentralizedSGD")
        actual = dist.get_rank() if world > 1 or dist.is_initialized() else 0
        if rank is None:
            rank = actual
        self.rank = rank
        self._check_graph(world, actual)
        if world > 1:
            comm.check_same_params("DecentralizedSGD", params)

    def _adjacency_row(self, world: int, actual: int) -> list[int]:
        """This rank's row of the adjacency matrix, then two flags: a bad neighbour entry (outside
        the group, the rank itself, or named twice) and a rank argument that is not the process's."""
        row = [0] * (world + 2)
        for n in self.neighbors:
            if 0 <= n < world and n != actual and not row[n]:
                row[n] = 1
            else:
                row[world] = 1
        row[world + 1] = int(self.rank != actual)
        return row

    def _check_graph(self, world: int, actual: int) -> None:
        """One row of the adjacency matrix per rank, gathered: every rank sees every error."""
        row = self._adjacency_row(world, actual)
        rows = comm.gather_rows("DecentralizedSGD", row, self.params[0].device) if world > 1 else torch.tensor([row])
        wrong_rank = [r for r in range(world) if rows[r, world + 1]]
        if wrong_rank:
            raise ValueError(f"DecentralizedSGD: the rank argument differs from the process's rank in the group on "
                             f"rank(s) {wrong_rank}: pass rank=torch.distributed.get_rank() (or leave it None)")
        bad = [r for r in range(world) if rows[r, world]]
        if bad:
            raise ValueError(f"DecentralizedSGD: neighbours of rank(s) {bad} name a rank outside the group "
                             f"[0, {world}), the rank itself, or a rank twice"
                             + (f" (this rank's list: {self.neighbors})" if actual in bad else ""))
        adjacency = rows[:, :world]
        one_way = (adjacency != adjacency.t()).nonzero().tolist()
        if one_way:
            i, j = one_way[0]
            raise ValueError(f"DecentralizedSGD: the neighbour lists are not symmetric: rank {i} "
                             f"{'lists' if adjacency[i, j] else 'does not list'} rank {j} but rank {j} "
                             f"{'lists' if adjacency[j, i] else 'does not list'} rank {i}: every link must be "
                             "named on both ends (fused_optim.distributed.ring / torus build such lists)")

    def _rows(self, slot: int, part: list[torch.Tensor]) -> torch.Tensor:
        """1 + |N(i)| rows of the bucket's numel, its dtype and device, kept from bucket to bucket
        and step to step (a fresh 25 MiB tensor per bucket, neighbour and step costs its page
        faults): row 0 this rank's packed bucket, row 1 + k neighbour k's. Two slots: one
        bucket's exchange runs while the previous bucket is averaged."""
        numel = sum(t.numel() for t in part)
        key = (slot, part[0].dtype, part[0].device)
        rows = self._scratch.get(key)
        if rows is None or rows.shape[1] < numel:
            rows = self._scratch[key] = torch.empty(1 + len(self.neighbors), numel, dtype=part[0].dtype,
                                                    device=part[0].device)
        return rows[:, :numel]

    def _launch(self, b: int, part: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], list]:
        """Start bucket b's exchange: (the neighbours' buffers, the requests)."""
        rows = self._rows(b % 2, part)
        # a bucket of one contiguous param is sent as it is (it is not averaged before its send is done)
        mine = part[0].view(-1) if len(part) == 1 and part[0].is_contiguous() else comm.pack(part, rows[0])
        theirs = rows[1:].unbind(0)
        requests = [dist.isend(mine, n, tag=b) for n in self.neighbors]
        requests += [dist.irecv(t, n, tag=b) for t, n in zip(theirs, self.neighbors)]
        return theirs, requests

    @torch.no_grad()
    def _after_step(self) -> None:
        if not self.neighbors:
            return
        params = [p.detach() for p in self.params]
        parts = [[params[i] for i in idx] for idx in comm.buckets(params, self.by_layer, self.bucket_cap_mb)]
        pending = self._launch(0, parts[0])
        for b, part in enumerate(parts):
            theirs, requests = pending
            if b + 1 < len(parts):  # the next bucket's exchange, while this one is averaged
                pending = self._launch(b + 1, parts[b + 1])
            for request in requests:
                request.wait()
            for t in theirs:  # p ← p + p_j, in the order of the neighbour list, then ÷ (|N(i)| + 1)
                torch._foreach_add_(part, comm.views(t, [p.shape for p in part]))
            torch._foreach_div_(part, len(self.neighbors) + 1)
