"""Subprocess side of tests/distributed/test_zero.py: one gloo rank stepping params through
``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=<ours>)``, next to the same
params stepped by the optimizer alone.

    zero_worker.py RANK WORLD OUT_DIR      (all ranks at once; they meet through OUT_DIR/store)

Every rank gives every param the same grads (ZeRO reduces none itself: DDP would); ZeRO steps
each rank's partition with the rank's own optimizer and broadcasts the updated params. Saved to
OUT_DIR/rank<r>.pt: ``{"runs": {name: {"implementation", "warnings", "owned" (how many params
this rank's optimizer holds), "partition_group" (FusedLAMB: whether it found ZeRO's group),
"params": [(zero, whole) per param]}}, "errors": {name: message}}``.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

import fused_optim
from fused_optim.process_group import end_process_group, init_process_group

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers: sharded_worker
from sharded_worker import OPTIONS, whole_tensors  # noqa: E402

TIMEOUT = timedelta(seconds=120)  # a rank that fails makes the others' collectives fail, not hang
STEPS = 4


def run(name: str, kwargs: dict) -> dict:
    """``name`` stepped STEPS times on the params alone and under ZeRO, the same grads in both."""
    init = whole_tensors(0)
    grads = [whole_tensors(1 + k) for k in range(STEPS)]
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    zero_params = [torch.nn.Parameter(t.clone()) for t in init]
    spec = fused_optim.registry.get_spec(name)
    opt_whole = fused_optim.create_optimizer(name, whole, **kwargs)
    zero = ZeroRedundancyOptimizer(zero_params, optimizer_class=spec.cls, **{**spec.defaults, **kwargs})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(STEPS):
            for p, q, g in zip(whole, zero_params, grads[k]):
                p.grad, q.grad = g.clone(), g.clone()
            opt_whole.step()
            zero.step()
    return {"implementation": zero.optim.implementation, "warnings": [str(w.message) for w in caught],
            "owned": sum(len(group["params"]) for group in zero.optim.param_groups),
            "partition_group": getattr(zero.optim, "_partition_group", None) is zero.process_group,
            "params": [(q.detach(), p.detach()) for p, q in zip(whole, zero_params)]}


def main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world, timeout=TIMEOUT)
    result = {"runs": {}, "errors": {}}
    for name in fused_optim.list_optimizers():
        try:
            result["runs"][name] = run(name, dict(lr=1e-2, **OPTIONS.get(name, {})))
        except Exception as exc:  # noqa: BLE001 (saved for the test, which says what was expected)
            result["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
