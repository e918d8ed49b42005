"""Subprocess side of tests/distributed/test_fsdp1.py: one gloo rank training a small MLP under
FSDP1 (``FullyShardedDataParallel``) with each registered optimizer, next to the same MLP whole.

    fsdp1_worker.py RANK WORLD OUT_DIR      (all ranks at once; they meet through OUT_DIR/store)

Every rank trains on the same batch, so FSDP1's gradient reduction (the ranks' grads averaged:
halved and summed on 2 ranks, exact) hands each rank the slice of the whole model's grads.
Saved to OUT_DIR/rank<r>.pt: ``{"runs": {case: {"implementation", "warnings", "params":
[(fsdp1, whole) per original param]}}, "refused": {case: message}, "statistics_refused": {AdaScale
and NoiseScale case: message}, "marks": {use_orig_params:
[(type name, _is_flat_param, _fsdp_flattened, is_fsdp1_param) per param the optimizer gets]}}``.
"""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fused_optim
from fused_optim import fsdp1
from fused_optim.process_group import end_process_group, init_process_group

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers: sharded_worker
from sharded_worker import OPTIONS, train_side_by_side  # noqa: E402 (each optimizer's options that do all it does)
from fsdp2_mlp import make_mlp  # noqa: E402 (tests/, which sharded_worker puts on the path)

TIMEOUT = timedelta(seconds=120)  # a rank that fails makes the others' collectives fail, not hang
STEPS = 3


def mlp() -> torch.nn.Module:
    return make_mlp(0, torch.float32)


def wrapped(model: torch.nn.Module, use_orig_params: bool) -> FSDP:
    """Each Linear a FSDP1 unit of its own (a FlatParameter each, 1-D, padded to the world size)
    inside the root's."""
    for i, layer in enumerate(model):
        if isinstance(layer, torch.nn.Linear):
            model[i] = FSDP(layer, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    return FSDP(model, use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def run(name: str, kwargs: dict, use_orig_params: bool) -> dict:
    whole = mlp()
    sharded = wrapped(copy.deepcopy(whole), use_orig_params)
    opt_sharded, caught = train_side_by_side(name, kwargs, whole, sharded, STEPS)
    with FSDP.summon_full_params(sharded):
        params = [(q.detach().clone(), p.detach()) for q, p in zip(sharded.module.parameters(), whole.parameters())]
    return {"implementation": opt_sharded.implementation, "warnings": caught,
            "params": params}


def marks(use_orig_params: bool) -> list[tuple]:
    return [(type(p).__name__, getattr(p, "_is_flat_param", False), getattr(p, "_fsdp_flattened", False),
             fsdp1.is_fsdp1_param(p)) for p in wrapped(mlp(), use_orig_params).parameters()]


def main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world, timeout=TIMEOUT)
    result = {"runs": {}, "refused": {}, "marks": {}, "statistics_refused": {}}
    for use_orig_params in (True, False):
        result["marks"][use_orig_params] = marks(use_orig_params)
        for name in fused_optim.list_optimizers():
            case, kwargs = f"{name}/use_orig_params={use_orig_params}", dict(lr=1e-2, **OPTIONS.get(name, {}))
            if fused_optim.registry.get_spec(name).cls.whole_tensor_rule is None:
                result["runs"][case] = run(name, kwargs, use_orig_params)
                continue
            try:
                fused_optim.create_optimizer(name, wrapped(mlp(), use_orig_params).parameters(), **kwargs)
            except ValueError as exc:
                result["refused"][case] = str(exc)
        for stats in (fused_optim.AdaScale, fused_optim.NoiseScale):  # (their hooks never see FSDP1's backward)
            try:
                stats(fused_optim.FusedSGD(wrapped(mlp(), use_orig_params).parameters(), lr=1e-2), world_size=world)
            except ValueError as exc:
                result["statistics_refused"][f"{stats.__name__}/use_orig_params={use_orig_params}"] = str(exc)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
