"""``torch.distributed.optim.ZeroRedundancyOptimizer``'s partitions.

ZeRO gives each rank a partition of the whole params and builds the rank's own optimizer
(``optimizer_class``) over it: per-tensor rules (LARS's and LAMB's trust ratios) see whole
tensors and are exact, but a rule over all params (FusedLAMB's global grad-norm clip) sees only
the partition. Such an optimizer asks :func:`partition_group` when it is made and sums over the
group it returns.

ZeRO tells the optimizer it builds nothing about itself, so :func:`partition_group` looks for it
on the stack: the nearest caller that is a method of a ``ZeroRedundancyOptimizer`` (its
``self``), whose ``process_group`` holds the partitions (checked on torch 2.13, where
``_init_local_optimizer`` builds the optimizer; tests/distributed/test_zero.py fails if it stops
finding it). ``torch.distributed.optim`` is looked up in ``sys.modules``, never imported here.
"""

from __future__ import annotations

import sys

_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def partition_group():
    """The process group of the ``ZeroRedundancyOptimizer`` that is building the caller's
    optimizer now (call from an optimizer's constructor), or None when none is."""
    zero = getattr(sys.modules.get(_ZERO_MODULE), "ZeroRedundancyOptimizer", None)
    if zero is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, zero):
            return owner.process_group
        frame = frame.f_back
    return None
