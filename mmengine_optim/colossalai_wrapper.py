"""``ColossalAIOptimWrapper`` without ColossalAI: configs written for mmengine's ColossalAI
strategy train with fused_optim's optimizers.

mmengine's ``ColossalAIOptimWrapper(optimizer, booster=None, accumulative_counts=1)`` needs a
ColossalAI ``Booster`` (its plugin decides ``no_sync`` and its optimizer does the backward). Ours
takes the same arguments and is :class:`FusedOptimWrapper`: mmengine's accumulation and
``no_sync``, plus the fused clipping and loss scaling as keyword options. A booster is ignored,
with one warning. The seven optimizer names that wrapper lists (``CPUAdam``, ``FusedAdam``,
``FusedLAMB``, ``FusedSGD``, ``HybridAdam``, ``Lamb``, ``Lars``) are ours in the
``mmengine_optim`` scope, with ColossalAI's signatures and defaults. Where ColossalAI is not
installed (mmengine's wrapper then cannot work), the bare name ``ColossalAIOptimWrapper`` is ours
too; where it is, it stays mmengine's and ours is ``mmengine_optim.ColossalAIOptimWrapper``.
"""

from __future__ import annotations

import warnings

import torch

from .optim_wrapper import FusedOptimWrapper

COLOSSALAI_OPTIMIZERS = ("CPUAdam", "FusedAdam", "FusedLAMB", "FusedSGD", "HybridAdam", "Lamb", "Lars")


class ColossalAIOptimWrapper(FusedOptimWrapper):
    """mmengine's ``ColossalAIOptimWrapper`` signature over :class:`FusedOptimWrapper` (see the
    module docstring); ``clip_grad``, ``loss_scale`` and ``dtype`` as there."""

    def __init__(self, optimizer: torch.optim.Optimizer, booster=None, accumulative_counts: int = 1, *,
                 clip_grad: dict | None = None, loss_scale: str | float | dict | None = None,
                 dtype: str | torch.dtype | None = None):
        if booster is not None:
            warnings.warn(f"ColossalAIOptimWrapper: the booster ({type(booster).__name__}) is ignored: fused_optim "
                          "runs without ColossalAI (accumulation and no_sync are mmengine's, clipping and loss "
                          "scaling this wrapper's own options)", UserWarning, stacklevel=2)
        super().__init__(optimizer, accumulative_counts, clip_grad=clip_grad, loss_scale=loss_scale, dtype=dtype)
