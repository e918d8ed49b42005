"""Optimizers by name: ``create_optimizer("adamw", model.parameters(), lr=1e-3)``.

Each entry is a class plus the defaults that make the named variant (``"nvlamb"`` is FusedLAMB
with ``use_nvlamb=True``), so a variant is an entry, never a new class. ``sgd`` / ``adam`` /
``adamw`` are the torch.optim drop-ins (torch's signatures and defaults), ``fused_sgd`` /
``fused_adam`` / ``fused_lamb`` the apex/ColossalAI ones. The framework adapters
read this table, so an optimizer added here needs no adapter change.

The distributed optimizers (:mod:`fused_optim.distributed`) are entries of a second table
(``list_distributed_optimizers``; ``create_optimizer`` and ``get_spec`` find both): they
communicate over ``torch.distributed`` and wrap an inner optimizer, so they stay out of
``list_optimizers``, the single-process kernels' list. Their constructors take the params first
(:mod:`fused_optim.distributed.by_params`). They are named by ``"module:attribute"`` strings,
imported on first use (as timm's registry does): the distributed package uses this registry for
its inner optimizers, so the registry does not import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from .adagrad import Adagrad
from .adam import FusedAdam
from .colossal_adam import CPUAdam, HybridAdam
from .lamb import ColossalLamb, FusedLAMB
from .lars import LARS, ColossalLars
from .lion import Lion
from .sgd import FusedSGD
from .sign_sgd import SignSGD
from .sparsified_sgd import SparsifiedSGD
from .torch_optim import SGD, Adam, AdamW


@dataclass(frozen=True)
class OptimizerSpec:
    """A named optimizer: ``target`` is its class (or params-first constructor), or a
    ``"module:attribute"`` string naming it, imported when :attr:`cls` is first read."""

    name: str
    target: type[torch.optim.Optimizer] | str
    defaults: dict = field(default_factory=dict)
    description: str = ""

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        if not isinstance(self.target, str):
            return self.target
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


_REGISTRY: dict[str, OptimizerSpec] = {}
_DISTRIBUTED: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec, distributed: bool = False) -> None:
    """Add (or replace) a named optimizer; names are case-insensitive. ``distributed``: in the
    table of the optimizers that communicate (``list_distributed_optimizers``)."""
    name = spec.name.lower()
    table, other = (_DISTRIBUTED, _REGISTRY) if distributed else (_REGISTRY, _DISTRIBUTED)
    other.pop(name, None)  # one name, one entry
    table[name] = spec


def get_spec(name: str) -> OptimizerSpec:
    spec = isinstance(name, str) and (_REGISTRY.get(name.lower()) or _DISTRIBUTED.get(name.lower()))
    if not spec:
        raise ValueError(f"Unknown optimizer name {name!r}; available: {', '.join(list_optimizers())}; "
                         f"distributed: {', '.join(list_distributed_optimizers())}")
    return spec


def create_optimizer(name: str, params, **kwargs) -> torch.optim.Optimizer:
    """Instantiate the optimizer registered as ``name``; ``kwargs`` override the entry's defaults."""
    spec = get_spec(name)
    return spec.cls(params, **{**spec.defaults, **kwargs})


def list_optimizers() -> list[str]:
    return sorted(_REGISTRY)


def list_distributed_optimizers() -> list[str]:
    return sorted(_DISTRIBUTED)


# Other class names of registered classes: ColossalAI's, under which configs written for
# ColossalAI name them (the framework adapters register the classes under these names too).
CLASS_ALIASES: dict[str, type[torch.optim.Optimizer]] = {"Lamb": ColossalLamb, "Lars": ColossalLars}


for _spec in (
    OptimizerSpec("sgd", SGD, {}, "torch.optim.SGD: its signature and defaults"),
    OptimizerSpec("fused_sgd", FusedSGD, {}, "apex/ColossalAI FusedSGD"),
    OptimizerSpec("adam", Adam, {}, "torch.optim.Adam: its signature and defaults (L2 weight decay)"),
    OptimizerSpec("adamw", AdamW, {}, "torch.optim.AdamW: its signature and defaults (weight_decay=1e-2)"),
    OptimizerSpec("fused_adam", FusedAdam, {}, "apex/ColossalAI FusedAdam (AdamW by default)"),
    OptimizerSpec("cpu_adam", CPUAdam, {}, "ColossalAI CPUAdam (AdamW by default; state offload to files)"),
    OptimizerSpec("hybrid_adam", HybridAdam, {}, "ColossalAI HybridAdam (CPU and CUDA params in one optimizer)"),
    OptimizerSpec("lamb", FusedLAMB, {}, "LAMB as apex/ColossalAI FusedLAMB and timm Lamb"),
    OptimizerSpec("fused_lamb", FusedLAMB, {}, "apex/ColossalAI FusedLAMB"),
    OptimizerSpec("nvlamb", FusedLAMB, {"use_nvlamb": True}, "LAMB with the trust ratio on every tensor"),
    OptimizerSpec("colossalai_lamb", ColossalLamb, {}, "ColossalAI's non-fused Lamb (pytorch-lamb algorithm)"),
    OptimizerSpec("lars", LARS, {}, "LARS as quadra (timm Lars options: trust_clip, always_adapt)"),
    OptimizerSpec("larc", LARS, {"trust_clip": True}, "LARS with LARC clipping of the trust ratio"),
    OptimizerSpec("colossalai_lars", ColossalLars, {}, "ColossalAI's Lars (trust ratio on the lr, clamped)"),
    OptimizerSpec("sign_sgd", SignSGD, {}, "mlbench SignSGD (momentum before the sign)"),
    OptimizerSpec("sparsified_sgd", SparsifiedSGD, {}, "mlbench SparsifiedSGD (error feedback, k coordinates)"),
    OptimizerSpec("lion", Lion, {}, "Lion (Chen et al. 2023) with lion-pytorch's defaults"),
    OptimizerSpec("adagrad", Adagrad, {}, "torch.optim.Adagrad: its signature and defaults"),
):
    register(_spec)

for _spec in (
    OptimizerSpec("centralized_sgd", "fused_optim.distributed.by_params:CentralizedSGD", {},
                  "mlbench CentralizedSGD: grads all-reduced (flat buckets; overlap=True: during the backward), SGD"),
    OptimizerSpec("centralized_adam", "fused_optim.distributed.by_params:CentralizedAdam", {},
                  "mlbench CentralizedAdam: grads all-reduced, Adam"),
    OptimizerSpec("custom_centralized", "fused_optim.distributed.by_params:CustomCentralizedOptimizer", {},
                  "mlbench CustomCentralizedOptimizer: grads all-reduced, any inner optimizer (optimizer=name)"),
    OptimizerSpec("powersgd", "fused_optim.distributed:PowerSGD", {},
                  "mlbench PowerSGD: rank-r compressed grads with error feedback, SGD"),
    OptimizerSpec("decentralized_sgd", "fused_optim.distributed.by_params:DecentralizedSGD", {},
                  "mlbench DecentralizedSGD: SGD, then gossip averaging with neighbours (ring by default)"),
    OptimizerSpec("centralized_sparsified_sgd", "fused_optim.distributed:CentralizedSparsifiedSGD", {},
                  "mlbench CentralizedSparsifiedSGD: k coordinates per param all-gathered, error feedback"),
):
    register(_spec, distributed=True)
