r"""Where :class:`~fused_optim.adascale.GradientStatistics` sees each rank's micro-batch gradients of
params sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

Between steps FSDP2 holds each param as a ``DTensor`` shard. For each forward (and again for the
backward) it all-gathers the shards into one plain tensor per param, the *unsharded param* (made
at the first forward and reused), and puts it in the module in place of the shard; autograd
computes that tensor's gradient, the rank's micro-batch gradient g_rank of the whole tensor, and
FSDP2 then reduce-scatters it into the shard's ``.grad`` (the average over the ranks). The
statistics need ‖g_rank‖² per micro-batch, which only the unsharded param's gradient carries, so:

* each FSDP2 unit (a module ``fully_shard`` was applied to) that manages params of the optimizer
  gets a forward pre-hook, registered after FSDP2's own (which FSDP2 prepends), so its params
  are the unsharded ones when it runs;
* the pre-hook registers a gradient hook on each unsharded param the first time it sees it; the
  hook adds ‖g_rank‖² to the param group's row of whole tensors (row class 0, see
  :mod:`.gradient_stats_rows`), which the window's end all-reduces over the ranks, as under DDP;
* the ``.grad`` sums stay those of the shards, summed over the mesh at the window's end.

Only public hooks are used (``Module.register_forward_pre_hook``, ``Tensor.register_hook``).

FSDP2 over tensor parallelism (a 2-D mesh, data × tensor parallel): the unsharded param is still a
DTensor, sharded (or replicated) over the tensor-parallel ranks, which all see the same
micro-batch. Its grad's local tensor is this rank's part of the micro-batch gradient: the window's
all-reduce over every rank adds the tensor-parallel parts into the whole tensor's norm and the
data-parallel replicas into the pool, as long as a tensor-parallel replica is counted on one rank
of its mesh dimension only. N is the number of data-parallel replicas (the ranks / the
tensor-parallel mesh's size), which the first forward checks.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
from torch import Tensor

from . import sharding


def fsdp2_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``module`` (itself included) that ``fully_shard`` was applied to."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def fsdp2_units(module: torch.nn.Module | None, params: list[Tensor], indices: list[int]) -> dict[int, tuple]:
    """``{i: (unit, name)}`` for each ``params[i]``, ``i`` in ``indices``, that an FSDP2 unit of
    ``module`` manages: its innermost unit and its name there. Found by identity with the unit's
    params, so only while the units hold their shards (not between a forward and its backward
    under ``reshard_after_forward=False``: such params are refused at the step, see
    :class:`.gradient_stats_rows.UnseenGrads`)."""
    if module is None or not indices:
        return {}
    index = {id(params[i]): i for i in indices}
    unit_of: dict[int, tuple[torch.nn.Module, str]] = {}
    for unit in fsdp2_modules(module):  # (parents before children: a nested unit's claim wins)
        for name, p in unit.named_parameters():
            if id(p) in index:
                unit_of[index[id(p)]] = unit, name
    return unit_of


class UnshardedGradHooks:
    """Hooks the unsharded params of ``params[i]`` for each ``i`` of ``units`` (see
    :func:`fsdp2_units`): ``on_grad(i, grad)`` runs with each of their micro-batch gradients
    (``world_size()``: the replicas the statistics pool, checked at the first forward against the
    ranks the window's all-reduce adds, over tensor parallelism's too). :meth:`remove` removes
    every hook registered so far."""

    def __init__(self, units: dict[int, tuple], params: list[Tensor], on_grad: Callable[[int, Tensor], None],
                 world_size: Callable[[], int]):
        self.handles: list = []
        self._on_grad, self._world_size = on_grad, world_size
        self._params = {i: weakref.ref(params[i]) for i in units}
        self._seen: dict[int, weakref.ref] = {}  # the unsharded params hooked, by id
        for unit in {id(u): u for u, _ in units.values()}.values():
            owned = [(name, i) for i, (u, name) in units.items() if u is unit]
            self.handles.append(unit.register_forward_pre_hook(self._pre_forward(owned)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre_forward(self, owned: list[tuple[str, int]]):
        def hook(m: torch.nn.Module, _args) -> None:
            for name, i in owned:
                t = m.get_parameter(name)
                seen = self._seen.get(id(t))
                if (seen is not None and seen() is t) or not t.requires_grad or t is self._params[i]():
                    continue  # (hooked already; frozen; or the shard itself: not unsharded here)
                self._check_replicas(t)
                on_grad = self._tensor_parallel(i, t) if sharding.is_dtensor(t) else \
                    functools.partial(self._on_grad, i)
                self._seen[id(t)] = weakref.ref(t)
                self.handles.append(t.register_hook(on_grad))
        return hook

    def _tensor_parallel(self, i: int, t: Tensor) -> Callable[[Tensor], None]:
        """The gradient hook of unsharded param ``t`` that is itself a DTensor (FSDP2 over tensor
        parallelism): ``on_grad`` of its grad's local tensor, where the all-reduce over every rank
        at the window's end adds the tensor-parallel shards into the whole tensor's norm and the
        data-parallel replicas into the pool. A tensor-parallel replica (``Replicate``) is counted
        on the first rank of its mesh dimension only (the others pass an empty tensor: they still
        count the backward pass)."""
        mesh = t.device_mesh
        copy = any(pl.is_replicate() and mesh.get_local_rank(d) != 0 for d, pl in enumerate(t.placements))

        def on_grad(grad: Tensor) -> None:
            why = sharding.grad_mismatch(t, grad)
            if why is not None:
                raise RuntimeError(f"gradient statistics: the unsharded param {i} {why}")
            local = grad.to_local()
            self._on_grad(i, local.reshape(-1)[:0] if copy else local)
        return on_grad

    def _check_replicas(self, t: Tensor) -> None:
        """Raises where the statistics pool another number of replicas than the window's
        all-reduce over every rank adds: the data-parallel ones, the ranks (over tensor
        parallelism: the ranks / the tensor-parallel mesh's size, ``t`` being a DTensor there)."""
        import torch.distributed as dist

        world = dist.get_world_size()
        if not sharding.is_dtensor(t):
            if self._world_size() != world:
                raise RuntimeError(f"gradient statistics: world_size={self._world_size()}, but the window's all-reduce "
                                   f"pools the micro-batches FSDP2's {world} ranks unshard the params for: pass "
                                   f"world_size={world}")
            return
        tensor_parallel = t.device_mesh.size()
        if any(pl.is_partial() for pl in t.placements):
            raise RuntimeError(f"gradient statistics: an unsharded param is placed {list(t.placements)} (Partial: "
                               "pending sums); tensor-parallel params must be Shard or Replicate")
        replicas = world // tensor_parallel
        if self._world_size() != replicas:
            raise RuntimeError(f"gradient statistics: world_size={self._world_size()}, but FSDP2 over a "
                               f"tensor-parallel mesh of {tensor_parallel} ranks leaves {replicas} data-parallel "
                               f"replicas (of {world} ranks): pass world_size={replicas}")
