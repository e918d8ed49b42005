"""Subprocess side of tests/distributed/test_failing_rank.py: a training loop under FSDP2
(``fully_shard``) whose step fails on one rank only: rank 1 gives one param a float64 grad, which
the kernel refuses (the param is float32).

    failing_rank_worker.py RANK WORLD OUT_DIR OPTIMIZER TIMEOUT_S TEARDOWN

No rank catches the error: it ends the failing rank, and every other rank must end too, with an
error, within the process group's timeout (TIMEOUT_S), never hang. ``TEARDOWN`` is ``exit``
(the failing rank's process ends at once: the others' next collective finds its peer gone) or
``end_process_group`` (every rank ends its group in a ``finally``, whose barrier the failing rank
enters while the others wait in the next step's collective: both sides time out).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fused_optim
from fused_optim.process_group import end_process_group, init_process_group

FAILING_RANK, FAILING_STEP, STEPS = 1, 1, 3


def train(rank: int, world: int, name: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fused_optim.create_optimizer(name, model.parameters(), lr=1e-2, weight_decay=1e-2)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    for step in range(STEPS):
        opt.zero_grad()
        model(x).square().mean().backward()
        if rank == FAILING_RANK and step == FAILING_STEP:
            weight = model[0].weight
            weight.grad_dtype = None  # (torch refuses a grad of another dtype unless told to take any)
            weight.grad = weight.grad.to(torch.float64)
        opt.step()
        print(f"rank {rank}: step {step} done", flush=True)


def main(rank: int, world: int, out_dir: str, name: str, timeout_s: float, teardown: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world,
                       timeout=timedelta(seconds=timeout_s))
    if teardown == "end_process_group":
        try:
            train(rank, world, name)
        finally:
            end_process_group()
    else:
        train(rank, world, name)
        end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]), sys.argv[6])
