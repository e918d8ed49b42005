"""Subprocess side of tests/core/test_fp16_optimizer.py, and the tiny fp16 model its tests share.

    fp16_worker.py RANK OUT_DIR     (both ranks at once; they meet through a file store in OUT_DIR)

Each rank trains FP16Optimizer(world_size=2) over SGD on grads of its own (``rank_grads``), in
every mode of ``MODES``, and saves {mode: {"updated", "masters"}} to OUT_DIR/rank<r>.pt.
"""

from __future__ import annotations

import sys

import torch

STEPS = 4
BAD = {2}  # steps where rank 1's grads hold an inf: both ranks must skip
MODES = {  # FP16Optimizer options; "denom" selects average_custom
    "average_world": {},
    "divide_before": {"divide_before": True},
    "average_custom": {"denom": 3.0},
}


def tiny_model(seed: int) -> torch.nn.Module:
    """Linear(5, 4) - Tanh - Linear(4, 3) in fp16."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).half()


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """8 inputs (fp16) and fp32 targets for tiny_model."""
    return torch.randn(8, 5, generator=gen).half(), torch.randn(8, 3, generator=gen)


def rank_grads(rank: int, step: int) -> list[torch.Tensor]:
    """The fp16 grads (of a loss scaled by ~1e3) that ``rank`` feeds tiny_model's params at ``step``."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    grads = [(1e3 * torch.randn(p.shape, generator=gen)).half() for p in tiny_model(0).parameters()]
    if rank == 1 and step in BAD:
        grads[1][0] = float("inf")
    return grads


def main(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from fused_optim import FP16Optimizer

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    results = {}
    for mode, options in MODES.items():
        model = tiny_model(0)
        custom = "denom" in options
        opt = FP16Optimizer(model, world_size=2, average_world=not custom, average_custom=custom,
                            divide_before=options.get("divide_before", False))
        opt.set_optimizer(torch.optim.SGD(opt.fp32_params, lr=0.1, momentum=0.9))
        updated, masters = [], []
        for t in range(STEPS):
            for p, g in zip(model.parameters(), rank_grads(rank, t)):
                p.grad = g
            updated.append(opt.step(denom=options.get("denom")))
            masters.append(torch.cat([m.detach().reshape(-1) for m in opt.fp32_params]))
        results[mode] = {"updated": updated, "masters": masters}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
