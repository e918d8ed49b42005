"""The process group the distributed optimizers' all-reduces run on.

gloo runs a group's collectives on worker threads, two per device in torch's ``ProcessGroupGloo``,
each collective start to end on one thread. The many small all-reduces of ``by_layer=True`` (161
for ResNet-50) wait on latency, a few message round trips each, so two at a time leave the ranks
mostly idle: at 4 ranks on this project's 2-core machine, launching the 161 at once took ~1 s on
the default group, ~0.47 s on a group with 4 or 8 threads (16: no better), while one flat
all-reduce of the same 102 MB took the same ~0.25 s on either. Hence, with a gloo default group,
the optimizers' all-reduces run on a gloo group of the same ranks and devices with
:data:`GLOO_THREADS` worker threads. A collective sums each tensor alone whichever thread runs it,
so results do not depend on the group.

The group is made through ``torch.distributed.new_group`` (a backend registered under
:data:`BACKEND`), so ``destroy_process_group()`` ends it with the default group; it is made once
per default group, at the first all-reduce of any of the optimizers (a point of the program every
rank reaches in the same order, as it does the collectives), and this module holds it only weakly.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

GLOO_THREADS = 8
BACKEND = "fused_optim_gloo"

_made: tuple[weakref.ref, weakref.ref] | None = None  # (the default group, ours)


def _default_gloo():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _create(store, rank: int, size: int, timeout):
    """The registered backend's constructor: gloo on the default group's devices, with
    :data:`GLOO_THREADS` worker threads and the default group's timeout."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = _default_gloo().options._devices
    options._threads = GLOO_THREADS
    options._timeout = timeout
    return ProcessGroupGloo(store, rank, size, options)


def collective_group() -> ProcessGroup | None:
    """The group for the optimizers' all-reduces: None (the default group) unless the default
    group's backend is gloo; then the threaded gloo group of the module docstring, made on the
    first call after the default group was (a collective: every rank must call this at the same
    point of its program)."""
    global _made
    world = dist.group.WORLD
    if _made is not None and _made[0]() is world and _made[1]() is not None:
        return _made[1]()
    if dist.get_backend() != "gloo":
        return None
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    group = dist.new_group(backend=BACKEND, timeout=_default_gloo().options._timeout)
    _made = (weakref.ref(world), weakref.ref(group))
    return group
