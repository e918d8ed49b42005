r"""Where :class:`~fused_optim.adascale.GradientStatistics` adds each param's sums of squares, so
that params sharded across processes as ``DTensor`` count as their whole tensors.

The statistics need, per param group, Σ ‖g‖² over whole tensors (each micro-batch's grads in the
hooks, ``.grad`` at the window's end). A DTensor's kernel call sees its local tensor only, so the
sums have one row per (param group, sharding class): class 0 holds plain params and DTensors that
no mesh dimension shards (a replica is its whole tensor), and each further class the params
sharded over the same mesh dimensions of the same mesh. At the window's end the rows of the
sharded classes are summed over the mesh dimensions that shard them (micro-batch and ``.grad``
sums together: :func:`.sharding.all_reduce_rows`, one all-reduce per mesh dimension; a
``Replicate`` dimension holds copies and is not summed), and the rows are folded into one sum per
group. Σ over micro-batches of Σ over shards = Σ over shards of Σ over micro-batches, so
the hooks need no collective. Without DTensors there is one class, a row per group, and no
collective here.

Which sharded params can be measured (see :data:`SHARDED_PARAMS`): those whose grads pass through
autograd to the param, one model replica held by the mesh's ranks (tensor parallelism, models
computed on DTensors), and FSDP2's (``fully_shard``), given the model: FSDP2 reduce-scatters each
backward's grads inside the backward pass, and a rank's micro-batch gradient is seen only on the
plain tensor FSDP2 unshards the param into (:mod:`.gradient_stats_fsdp`; those sums go to row
class 0 and are pooled over the ranks like DDP's). Without the model no hook sees FSDP2's grads,
and the first step refuses (:class:`UnseenGrads`).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from . import fsdp1, sharding
from .norm import grad_sum_squares_, sum_squares_

SHARDED_PARAMS = (
    "the gradient statistics of DTensor params are measured where their gradients pass through "
    "autograd to the params (tensor parallelism: the ranks of the params' mesh hold one model replica, "
    "world_size=1, and the micro-batches come from gradient accumulation, num_gradients_to_accumulate > 1), "
    "or, for FSDP2 (fully_shard), on the plain tensors it unshards them into: pass the sharded model, "
    "e.g. AdaScale(optimizer, module=model), built after fully_shard"
)

FSDP1_RULE = ("sums each rank's micro-batch gradient norms of whole tensors (in hooks on its params, which FSDP1's "
              "backward on the flat params never reaches)")
FSDP1_INSTEAD = ("shard the model with FSDP2 (torch.distributed.fsdp.fully_shard) and pass module=model, or use DDP "
                 "(DistributedDataParallel)")


def _shard_key(p: Tensor) -> tuple | None:
    """The sharding class of ``p``: (mesh, the mesh dims that shard it), None when none does."""
    dims = sharding.sharded_dims(p)
    return (p.device_mesh, tuple(dims)) if dims else None


class SumRows:
    """The rows of the sums for ``param_groups`` (see the module docstring): ``rows[i]`` is the row
    of ``params[i]``; ``len(self)`` rows, ``classes`` per group; ``sharded``: the indices of the
    DTensor params. FSDP1's params are refused (``who``: the optimizer, in the message)."""

    def __init__(self, param_groups: list[dict], who: str):
        for gi, group in enumerate(param_groups):
            fsdp1.check_whole_tensors(group["params"], gi, who, FSDP1_RULE, FSDP1_INSTEAD)
        pairs = [(gi, p) for gi, group in enumerate(param_groups) for p in group["params"]]
        first: dict[tuple, Tensor] = {}  # a param of each sharded class, for its mesh and placements
        for _, p in pairs:
            key = _shard_key(p)
            if key is not None:
                first.setdefault(key, p)
        keys = list(first)
        self.groups, self.classes = len(param_groups), 1 + len(keys)
        self.params = [p for _, p in pairs]
        self.rows = [gi * self.classes + (0 if (key := _shard_key(p)) is None else 1 + keys.index(key))
                     for gi, p in pairs]
        self.sharded = [i for i, p in enumerate(self.params) if sharding.is_dtensor(p)]
        unsharded = torch.empty(0)  # (all_reduce_rows reduces no row of a plain tensor)
        self._row_params = [unsharded if k == 0 else first[keys[k - 1]]
                            for _ in range(self.groups) for k in range(self.classes)]

    def plain_row(self, i: int) -> int:
        """The row of class 0 (whole tensors, pooled over ranks) of ``params[i]``'s group."""
        return self.rows[i] - self.rows[i] % self.classes

    def __len__(self) -> int:
        return self.groups * self.classes

    def add_grad_sums(self, total: Tensor) -> None:
        """``total[row] += ‖p.grad‖²`` over each param's local grad (the C++ kernel reads plain
        params' ``.grad``; a DTensor's grad is passed as its local tensor)."""
        if not self.sharded:
            grad_sum_squares_(total, self.params, self.rows)
            return
        plain = [i for i, p in enumerate(self.params) if not sharding.is_dtensor(p)]
        grad_sum_squares_(total, [self.params[i] for i in plain], [self.rows[i] for i in plain])
        with_grad = [i for i in self.sharded if self.params[i].grad is not None]
        for i in with_grad:
            check_grad(i, self.params[i], self.params[i].grad)
        sum_squares_(total, [self.params[i].grad.to_local() for i in with_grad], [self.rows[i] for i in with_grad])

    def whole(self, local: Tensor, total: Tensor) -> tuple[Tensor, Tensor]:
        """The per-group sums of the whole tensors from the per-row local ones: the sharded rows
        summed over their shards (one all-reduce per mesh dimension), then folded per group.
        With one class, ``local`` and ``total`` themselves."""
        if self.classes == 1:
            return local, total
        both = torch.stack((local, total), dim=1)
        sharding.all_reduce_rows(both, self._row_params)
        local, total = both.view(self.groups, self.classes, 2).sum(dim=1).unbind(dim=1)
        return local.contiguous(), total.contiguous()


def check_grad(i: int, p: Tensor, grad: Tensor) -> None:
    """Raises where the grad of DTensor param ``i`` is not placed as the param (its local sums would
    not be those of the param's shard: a ``Partial`` grad holds pending sums)."""
    why = sharding.grad_mismatch(p, grad)
    if why is not None:
        raise RuntimeError(f"gradient statistics: param {i} {why}")


class UnseenGrads:
    """The DTensor params of ``rows`` whose grads a window changed that no gradient hook of any rank
    saw: their micro-batch norms would be missing from the variance. FSDP2 sets its grads after
    its reduce-scatter, seen only on the tensors it unshards the params into: without the model,
    with units that held unsharded params when the statistics were made, or for a param used
    outside its unit's forward, no hook sees them. Decided alike on every rank: each rank's flags
    (seen here, changed here) ride on the all-reduce that pools the window's sums
    (:meth:`flags`, :meth:`decide`), and a param counts as seen where any rank saw it (a rank whose
    forward left it unused adds zeros to its pool, correctly). "Changed": another grad tensor than
    at the window's start, or the same one written since (its version counter), so that a zeroed
    grad of a param no pass used (``zero_grad(set_to_none=False)``) does not count."""

    def __init__(self, rows: SumRows):
        self.rows = rows
        self.seen: set[int] = set()  # indices in rows.params whose hooks ran on this rank
        self.unseen: list[int] = []  # decided at the window's end
        self._marks: dict[int, tuple | None] = {}
        self.restart()

    def restart(self) -> None:
        """A new window: the grads as they are now are its start."""
        self.seen.clear()
        self.unseen = []
        self._marks = {i: _mark(self.rows.params[i].grad) for i in self.rows.sharded}

    def flags(self, device: torch.device) -> Tensor:
        """float64 [2·S] over the S DTensor params: seen here, then changed here (1 or 0)."""
        changed = [float(self._changed(i)) for i in self.rows.sharded]
        seen = [float(i in self.seen) for i in self.rows.sharded]
        return torch.tensor(seen + changed, dtype=torch.float64, device=device)

    def decide(self, flags: Tensor) -> None:
        """The unseen params from :meth:`flags` summed over the ranks (or this rank's alone)."""
        n = len(self.rows.sharded)
        values = flags.tolist()
        self.unseen = [i for i, seen, changed in zip(self.rows.sharded, values[:n], values[n:]) if changed and not seen]

    def refuse(self, who: str) -> None:
        if self.unseen:
            raise RuntimeError(
                f"{who}.step: DTensor params {self.unseen} (in the order of the param groups) have gradients, but no "
                f"gradient hook saw them in this window's backward passes; {SHARDED_PARAMS}, and while its FSDP2 units "
                "hold their shards (before the first forward, or after model.reshard())")

    def _changed(self, i: int) -> bool:
        grad = self.rows.params[i].grad
        if grad is None:
            return False
        mark, local = self._marks.get(i), sharding.local(grad)
        return mark is None or mark[0]() is not local or local._version != mark[1]

    def __getstate__(self) -> dict:
        """For copies: the marks (weak references to this run's grads) are not copied; a copy's
        grads present at its window's end count as changed."""
        return {**self.__dict__, "_marks": {}}


def _mark(grad: Tensor | None) -> tuple | None:
    """(weak reference, version) of a grad's local tensor: held weakly, so that a new grad made
    where a freed one was is not taken for it."""
    if grad is None:
        return None
    local = sharding.local(grad)
    return weakref.ref(local), local._version
