"""One place that turns the optimizer Lightning holds into an AdaScale matching the trainer."""

from __future__ import annotations

import torch

from fused_optim import AdaScale


def as_adascale(optimizer: torch.optim.Optimizer, world_size: int, accumulate: int,
                module: torch.nn.Module | None = None, **adascale_kwargs) -> AdaScale:
    """``optimizer`` wrapped in AdaScale for ``world_size`` ranks accumulating ``accumulate``
    micro-batches (the wrapper shares the inner ``param_groups``, so LR schedulers built on the
    raw optimizer keep acting on the right groups; ``module``: the LightningModule, whose FSDP2
    units the statistics watch). An AdaScale is returned itself, its world
    size and accumulation count set to the trainer's; a scale left at its default N·c follows."""
    if not isinstance(optimizer, AdaScale):
        try:
            return AdaScale(optimizer, world_size=world_size, num_gradients_to_accumulate=accumulate, module=module,
                            **adascale_kwargs)
        except RuntimeError as err:
            raise RuntimeError(f"{err}. In Lightning: Trainer(accumulate_grad_batches=4), or more devices") from None
    optimizer.set_window(world_size, accumulate)
    return optimizer
