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

Only public hooks are used (``Module.register_forward_pre_hook``, ``Tensor.register_hook``). An
unsharded param that is itself a ``DTensor`` (FSDP2 over tensor parallelism: each rank's gradient
is a shard of a tensor-parallel replica) is refused when the pre-hook sees it.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import Tensor

from . import sharding


def fsdp2_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``module`` (itself included) that ``fully_shard`` was applied to."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class UnshardedGradHooks:
    """Hooks the unsharded params of ``params[i]`` for each ``i`` in ``rows`` (the DTensor params
    that ``module``'s FSDP2 units manage): ``on_grad(rows[i], grad)`` runs with each of their
    micro-batch gradients. :meth:`remove` removes every hook registered so far."""

    def __init__(self, module: torch.nn.Module, params: list[Tensor], rows: dict[int, int],
                 on_grad: Callable[[int, Tensor], None]):
        index = {id(params[i]): i for i in rows}
        unit_of: dict[int, tuple[torch.nn.Module, str]] = {}  # param index -> (its innermost unit, name there)
        for unit in fsdp2_modules(module):  # (parents before children: a nested unit's claim wins)
            for name, p in unit.named_parameters():
                if id(p) in index:
                    unit_of[index[id(p)]] = unit, name
        self.watched = set(unit_of)
        self.handles: list = []
        self._rows, self._on_grad = rows, on_grad
        self._params = {i: weakref.ref(params[i]) for i in self.watched}
        self._seen: dict[int, weakref.ref] = {}  # the unsharded params hooked, by id
        for unit in {id(u): u for u, _ in unit_of.values()}.values():
            owned = [(name, i) for i, (u, name) in unit_of.items() if u is unit]
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
                if (seen is not None and seen() is t) or not t.requires_grad:
                    continue
                if sharding.is_dtensor(t):  # the shard itself (not unsharded here: nothing to watch), or
                    if t is not self._params[i]():  # FSDP2 over tensor parallelism
                        raise RuntimeError(
                            f"gradient statistics: param {i} ({name} of a {type(m).__name__}) is a DTensor inside the "
                            "forward: FSDP2 over tensor parallelism is not supported (each rank's gradient is a "
                            "shard of a tensor-parallel replica); shard with fully_shard alone")
                    continue
                self._seen[id(t)] = weakref.ref(t)
                self.handles.append(t.register_hook(lambda grad, row=self._rows[i]: self._on_grad(row, grad)))
        return hook
