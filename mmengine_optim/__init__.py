"""fused_optim for mmengine: optimizers, wrappers and hooks by config name.

No ``custom_imports`` is needed for scoped names::

    optim_wrapper = dict(type='mmengine_optim.AdaScaleOptimWrapper', accumulative_counts=4,
                         optimizer=dict(type='mmengine_optim.FusedSGD', lr=0.1, momentum=0.9))
    default_hooks = dict(param_scheduler=dict(type='mmengine_optim.UpdateParamSchedulerHook'))
    custom_hooks = [dict(type='mmengine_optim.NoiseScaleHook')]  # the gradient noise scale, logged

Bare names (``type='FusedLAMB'``) work after ``custom_imports=dict(imports=['mmengine_optim'])``
(see :mod:`.optimizers` for the names left to other libraries). Train with
``python -m mmengine_optim.train CONFIG``.
"""

from .colossalai_wrapper import ColossalAIOptimWrapper
from .hooks import UpdateParamSchedulerHook, WeightsOnlyCheckpointHook
from .loss_scaler import LossScaler
from .noise_scale import NoiseScaleHook
from .optim_wrapper import AdaScaleOptimWrapper, FusedOptimWrapper
from .optimizers import register_optimizers
from .registry import HOOKS, OPTIM_WRAPPERS, OPTIMIZERS, register

for _registry, _objs in ((OPTIM_WRAPPERS, (FusedOptimWrapper, AdaScaleOptimWrapper, ColossalAIOptimWrapper)),
                         (HOOKS, (UpdateParamSchedulerHook, WeightsOnlyCheckpointHook, NoiseScaleHook))):
    for _obj in _objs:
        register(_registry, _obj)
register_optimizers()

__all__ = [
    "AdaScaleOptimWrapper",
    "ColossalAIOptimWrapper",
    "FusedOptimWrapper",
    "HOOKS",
    "LossScaler",
    "NoiseScaleHook",
    "OPTIMIZERS",
    "OPTIM_WRAPPERS",
    "UpdateParamSchedulerHook",
    "WeightsOnlyCheckpointHook",
    "register_optimizers",
]
