"""Optimizers that communicate over torch.distributed (gloo on CPU, nccl on GPU): mlbench_core's
centralized, sparsified, PowerSGD and decentralized optimizers. See docs/distributed.md."""

from .centralized import CentralizedAdam, CentralizedSGD, CustomCentralizedOptimizer, GenericCentralizedOptimizer
from .decentralized import DecentralizedSGD, ring, torus
from .powersgd import PowerSGD
from .sparsified import CentralizedSparsifiedSGD
from .wrapper import CommunicatingOptimizer

COMMUNICATING = (CommunicatingOptimizer, CentralizedSparsifiedSGD)
"""The classes of every optimizer here: ``isinstance(opt, COMMUNICATING)`` says its ``step``
communicates, so the model needs no DistributedDataParallel wrapper."""

__all__ = [
    "COMMUNICATING",
    "CentralizedAdam",
    "CentralizedSGD",
    "CentralizedSparsifiedSGD",
    "CustomCentralizedOptimizer",
    "DecentralizedSGD",
    "GenericCentralizedOptimizer",
    "PowerSGD",
    "ring",
    "torus",
]
