"""The distributed optimizers as params-first constructors, for what fills an optimizer's first
argument with the model's params: :mod:`fused_optim.registry` (``create_optimizer("centralized_sgd",
model.parameters(), lr=0.1)``) and mmengine's optimizer constructor (:mod:`mmengine_optim`).
``PowerSGD`` and ``CentralizedSparsifiedSGD`` take their params first already; ``world_size``
defaults to the process group's."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..registry import create_optimizer
from . import centralized, decentralized
from .comm import params_of


def CentralizedSGD(params, world_size: int | None = None, **kwargs) -> centralized.CentralizedSGD:  # noqa: N802
    """:class:`.centralized.CentralizedSGD` over ``params``."""
    return centralized.CentralizedSGD(world_size, params, **kwargs)


def CentralizedAdam(params, world_size: int | None = None, **kwargs) -> centralized.CentralizedAdam:  # noqa: N802
    """:class:`.centralized.CentralizedAdam` over ``params``."""
    return centralized.CentralizedAdam(world_size, params, **kwargs)


def CustomCentralizedOptimizer(params, optimizer: str | dict | Callable[[list], torch.optim.Optimizer],  # noqa: N802
                               world_size: int | None = None, **kwargs) -> centralized.CustomCentralizedOptimizer:
    """:class:`.centralized.CustomCentralizedOptimizer` over ``params``; ``optimizer``: the inner
    optimizer over the same params, as a name of
    :mod:`fused_optim.registry`, ``{"type": name, **options}``, or a callable params → optimizer."""
    params = params_of(params)
    if isinstance(optimizer, str):
        optimizer = {"type": optimizer}
    if isinstance(optimizer, dict):
        options = dict(optimizer)
        name = options.pop("type")
        inner = create_optimizer(name, params, **options)
    else:
        inner = optimizer(params)
    return centralized.CustomCentralizedOptimizer(params, world_size, inner, **kwargs)


def DecentralizedSGD(params, neighbors="ring", **kwargs) -> decentralized.DecentralizedSGD:  # noqa: N802
    """:class:`.decentralized.DecentralizedSGD` over ``params``; ``neighbors``: ``"ring"``,
    ``{"type": "torus", "rows": .., "cols": ..}`` (for this process's rank) or a list of ranks."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if neighbors == "ring":
        neighbors = decentralized.ring(rank, world)
    elif isinstance(neighbors, dict) and neighbors.get("type") == "torus":
        neighbors = decentralized.torus(rank, neighbors["rows"], neighbors["cols"])
    return decentralized.DecentralizedSGD(rank, neighbors, params, **kwargs)

