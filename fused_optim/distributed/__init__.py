"""Optimizers that communicate over torch.distributed (gloo on CPU, nccl on GPU): mlbench_core's
centralized, sparsified, PowerSGD and decentralized optimizers. See docs/distributed.md."""

from ..adascale import inner_optimizer
from ..fp16_optimizer import FP16Optimizer
from .centralized import CentralizedAdam, CentralizedSGD, CustomCentralizedOptimizer, GenericCentralizedOptimizer
from .decentralized import DecentralizedSGD, ring, torus
from .powersgd import PowerSGD
from .sparsified import CentralizedSparsifiedSGD
from .wrapper import CommunicatingOptimizer


def check_communicates(optimizer, where: str, otherwise: str) -> None:
    """Raise ``TypeError`` unless ``optimizer``'s step communicates: an optimizer of this package
    (or an :class:`~fused_optim.AdaScale` around one), or an :class:`~fused_optim.FP16Optimizer`
    over several ranks. ``where`` (a strategy, a model wrapper) leaves the model without a
    DistributedDataParallel wrapper, so with any other optimizer each rank would train a model of
    its own and nothing would say so; ``otherwise`` is how that framework keeps such an optimizer."""
    inner = inner_optimizer(optimizer)
    if isinstance(inner, (CommunicatingOptimizer, CentralizedSparsifiedSGD)) or (
            isinstance(inner, FP16Optimizer) and inner.world_size > 1):
        return
    name = type(inner).__name__
    raise TypeError(
        f"{where} does not wrap the model in DistributedDataParallel, and {name} does not communicate: each "
        f"rank would train its own model. Use an optimizer of fused_optim.distributed (CentralizedSGD, "
        f"CentralizedAdam, CustomCentralizedOptimizer over {name}, DecentralizedSGD, PowerSGD, "
        f"CentralizedSparsifiedSGD), or keep {name} with {otherwise}")


__all__ = [
    "CentralizedAdam",
    "CentralizedSGD",
    "CentralizedSparsifiedSGD",
    "CustomCentralizedOptimizer",
    "DecentralizedSGD",
    "GenericCentralizedOptimizer",
    "PowerSGD",
    "check_communicates",
    "ring",
    "torus",
]
