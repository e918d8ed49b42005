"""Subprocess side of tests/core/test_noise_scale.py: one of 2 gloo ranks training the AdaScale tests'
model under DDP with NoiseScale, accumulation 2 (rank r takes micro-batches 2r and 2r+1 of each
step), saving B_simple after every step.

    noise_scale_worker.py RANK PORT OUT
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: adascale_loops
from adascale_loops import micro_batch, model_and_groups  # noqa: E402

STEPS = 8


def train(model, opt, steps: int, micros_of, accum: int, no_sync=None) -> list[float]:
    """B_simple after each of ``steps`` steps; losses divided by ``accum``; all but the window's
    last backward inside ``no_sync()`` when given."""
    history = []
    for step in range(steps):
        micros = micros_of(step)
        for i, m in enumerate(micros):
            x, y = micro_batch(step, m)
            loss = torch.nn.functional.mse_loss(model(x), y) / accum
            if no_sync is not None and i < len(micros) - 1:
                with no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(opt.b_simple)
    return history


def main(rank: int, port: int, out: str) -> None:
    from fused_optim import NoiseScale
    from fused_optim.process_group import end_process_group, init_process_group

    torch.set_default_dtype(torch.float64)
    init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                       timeout=timedelta(seconds=600))
    model, groups = model_and_groups(two_groups=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = NoiseScale(torch.optim.SGD(groups, lr=0.1), micro_batch_size=4, num_gradients_to_accumulate=2)
    assert opt.world_size == 2
    history = train(ddp, opt, STEPS, lambda step: (2 * rank, 2 * rank + 1), 2, ddp.no_sync)
    if rank == 0:
        torch.save(history, out)
    del ddp, opt
    end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
