"""CentralizedSparsifiedSGD with default arguments (k = 10, block draws, a random seed per rank) on
params whose sizes are not multiples of k: the ranks' blocks differ in length (the last block of a
param is shorter), yet every rank sends the same count and every param moves by the exact average
of what the ranks sent.

Run as a script, this file is one gloo rank: ``test_sparsified_ranks.py RANK WORLD OUT_DIR``; it
saves its grads, its params and memories after each step to OUT_DIR/rank<r>.pt."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

SIZES = (23, 15, 4)  # k = 10: blocks of 10, 10, 3 and 10, 5; one smaller than k
STEPS = 5
LR = 0.1


def worker(rank: int, world: int, out_dir: str) -> None:
    from fused_optim import distributed as d
    from fused_optim.process_group import end_process_group, init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world,
                       timeout=timedelta(seconds=60))
    init = torch.Generator().manual_seed(0)  # the same params on every rank (the constructor checks)
    params = [torch.nn.Parameter(torch.randn(n, generator=init, dtype=torch.float64)) for n in SIZES]
    opt = d.CentralizedSparsifiedSGD(params, lr=LR)  # every other argument its default
    grads = torch.Generator().manual_seed(100 + rank)
    record = {"init": [p.detach().clone() for p in params], "steps": []}
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads, dtype=torch.float64)
        opt.step()
        record["steps"].append({"grads": [p.grad.clone() for p in params],
                                "params": [p.detach().clone() for p in params],
                                "memories": [opt.state[p]["memory"].clone() for p in params]})
    torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_blocks_of_different_lengths_on_each_rank_average_exactly(world, tmp_path):
    from processes import run_ranks

    run_ranks(Path(__file__), lambda r: (r, world, tmp_path), world, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    params = [p.clone() for p in ranks[0]["init"]]
    memories = [[torch.zeros_like(p) for p in params] for _ in ranks]
    for t in range(STEPS):
        update = [torch.zeros_like(p) for p in params]
        for r, record in enumerate(ranks):  # the ranks' sums in rank order, as index_add_ of the gather
            step = record["steps"][t]
            for i, (memory, grad, left) in enumerate(zip(memories[r], step["grads"], step["memories"])):
                memory.add_(grad, alpha=LR)
                sent = memory - left  # the coordinates sent: memory there, 0 elsewhere
                block = sent.nonzero().flatten()
                assert len(block) == min(10, SIZES[i]) or block.max() == SIZES[i] - 1, (r, t, i, block)
                assert torch.equal(block, torch.arange(block[0], block[0] + len(block))), (r, t, i, block)
                update[i] += sent
                memory.copy_(left)
        for p, u in zip(params, update):
            p -= u / world
        for r, record in enumerate(ranks):
            for i, (ours, expected) in enumerate(zip(record["steps"][t]["params"], params)):
                assert torch.equal(ours, expected), f"rank {r}, step {t}, param {i}"


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
