"""fused_optim: fast PyTorch optimizers with fused C++ (CPU) kernels built on first use.

    import fused_optim
    opt = fused_optim.AdamW(model.parameters())                       # torch.optim.AdamW, fused
    opt = fused_optim.FusedAdam(model.parameters(), lr=1e-3)          # apex's: AdamW by default
    opt = fused_optim.create_optimizer("sgd", model.parameters(), lr=0.1, momentum=0.9)

The update rules are in docs/algorithms.md; the ``fused`` flag and the environment variables in README.md.
"""

from . import _ops  # noqa: F401  (defines the op schemas)
from . import testing  # noqa: F401  (fused_optim.testing.emulated_cuda)
from ._build import build_error, cpu_description, is_available
from .adagrad import Adagrad
from .adam import FusedAdam
from .adascale import AdaScale
from .noise_scale import NoiseScale
from .colossal_adam import CPUAdam, HybridAdam
from .fp16_optimizer import DynamicLossScaler, FP16Optimizer
from .lamb import ColossalLamb, FusedLAMB, Lamb
from .lars import LARS, ColossalLars, Lars
from .lion import Lion
from .norm import multi_tensor_l2norm, sum_squares_
from .optimizer import FusedOptimizer
from .registry import create_optimizer, list_optimizers
from .sgd import FusedSGD
from .sign_sgd import SignSGD
from .sparsified_sgd import SparsifiedSGD
from .torch_optim import SGD, Adam, AdamW

__all__ = [
    "Adagrad",
    "Adam",
    "AdamW",
    "AdaScale",
    "CPUAdam",
    "ColossalLamb",
    "ColossalLars",
    "DynamicLossScaler",
    "FP16Optimizer",
    "LARS",
    "FusedAdam",
    "FusedLAMB",
    "FusedOptimizer",
    "FusedSGD",
    "HybridAdam",
    "Lamb",  # = ColossalLamb (ColossalAI's class name)
    "Lars",  # = ColossalLars
    "Lion",
    "NoiseScale",
    "SGD",
    "SignSGD",
    "SparsifiedSGD",
    "build_error",
    "cpu_description",
    "create_optimizer",
    "is_available",
    "list_optimizers",
    "multi_tensor_l2norm",
    "sum_squares_",
]
__version__ = "0.1.0"
