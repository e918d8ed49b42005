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
see :mod:`.distributed`. A script of one's own under ``torchrun`` on CPU calls
:func:`prepare_cpu_ddp` on its config before ``Runner.from_cfg`` (:mod:`.cpu_ddp`).

Importing this package allows the globals mmengine writes into checkpoints in
``torch.load(weights_only=True)`` (:mod:`.checkpoint_globals`), so mmengine's own
``CheckpointHook`` checkpoints resume on torch ≥ 2.6.
"""

from fused_optim.optional import require

require("mmengine", "mmengine", "mmengine_optim")

from .checkpoint_globals import register_checkpoint_globals
from .colossalai_wrapper import ColossalAIOptimWrapper
from .constructor import OptimWrapperConstructor, register_constructor
from .cpu_ddp import prepare_cpu_ddp
from .distributed import OptimizerSyncedModel, register_distributed
from .hooks import PortableCheckpointHook, UpdateParamSchedulerHook, WeightsOnlyCheckpointHook
from .loss_scaler import LossScaler
from .noise_scale import NoiseScaleHook
from .optim_wrapper import AdaScaleOptimWrapper, FusedOptimWrapper
from .optimizers import register_optimizers
from .registry import HOOKS, OPTIM_WRAPPERS, OPTIMIZERS, register

for _registry, _objs in ((OPTIM_WRAPPERS, (FusedOptimWrapper, AdaScaleOptimWrapper, ColossalAIOptimWrapper)),
                         (HOOKS, (UpdateParamSchedulerHook, PortableCheckpointHook, NoiseScaleHook))):
    for _obj in _objs:
        register(_registry, _obj)
register(HOOKS, PortableCheckpointHook, name="WeightsOnlyCheckpointHook")  # its old name
register_checkpoint_globals()
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
    "PortableCheckpointHook",
    "UpdateParamSchedulerHook",
    "WeightsOnlyCheckpointHook",
    "prepare_cpu_ddp",
    "register_distributed",
    "register_optimizers",
]
