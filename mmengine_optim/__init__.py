"""fused_optim for mmengine: optimizers, wrappers and hooks by config name.

No ``custom_imports`` is needed for scoped names::

    optim_wrapper = dict(type='mmengine_optim.AdaScaleOptimWrapper', accumulative_counts=4,
                         optimizer=dict(type='mmengine_optim.FusedSGD', lr=0.1, momentum=0.9))
    default_hooks = dict(param_scheduler=dict(type='mmengine_optim.UpdateParamSchedulerHook'))
    custom_hooks = [dict(type='mmengine_optim.NoiseScaleHook')]  # the gradient noise scale, logged

Bare names (``type='FusedLAMB'``) work after ``custom_imports=dict(imports=['mmengine_optim'])``
(see :mod:`.optimizers` for the names left to others); an optimizer name that nothing holds
raises a ``KeyError`` saying what to write (:mod:`.constructor`). Train with
``python -m mmengine_optim.train CONFIG``. The distributed optimizers (``mmengine_optim.CentralizedSGD``,
``PowerSGD``, …) train under ``model_wrapper_cfg=dict(type='mmengine_optim.OptimizerSyncedModel')``:
see :mod:`.distributed`.
"""

from .colossalai_wrapper import ColossalAIOptimWrapper
from .constructor import OptimWrapperConstructor, register_constructor
from .distributed import OptimizerSyncedModel, register_distributed
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
register_distributed()
register_constructor()

__all__ = [
    "AdaScaleOptimWrapper",
    "ColossalAIOptimWrapper",
    "FusedOptimWrapper",
    "HOOKS",
    "LossScaler",
    "NoiseScaleHook",
    "OPTIMIZERS",
    "OPTIM_WRAPPERS",
    "OptimWrapperConstructor",
    "OptimizerSyncedModel",
    "UpdateParamSchedulerHook",
    "WeightsOnlyCheckpointHook",
    "register_distributed",
    "register_optimizers",
]
