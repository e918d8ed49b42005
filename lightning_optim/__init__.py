"""PyTorch Lightning adapter for fused_optim: ``import lightning_optim`` is all it takes.

* Our optimizers need no adapter: return them from ``configure_optimizers`` (with or without LR
  scheduler dicts), or name them on the command line of ``LightningCLI``:
  ``--optimizer fused_optim.FusedSGD --optimizer.lr 0.1``.
* :class:`AdaScaleCallback`: AdaScale for any module (wraps its optimizer, or syncs one it
  returns), τ-driven LR schedules, a τ target, logging, checkpoints.
* :class:`NoiseScaleCallback`: the gradient noise scale (B_simple), the batch and the suggested
  batch logged per update; optionally a batch-size ramp.
* :class:`LightningCLI`: Lightning's, whose own ``--optimizer`` also trains a model that
  ``configure_model`` shards (FSDP2); :class:`StepSchedulerCLI`: the same, whose
  ``--lr_scheduler`` steps per update, so ``AdaScaleCallback`` drives it by τ.
* :class:`ScaledHalfPrecision`: ``precision="16-true"`` with a dynamic loss scale, for fp16
  models whose optimizer keeps fp32 master weights (``master_weights=True``).
* Strategies by name (registered on import): ``"adascale_ddp"``, ``"adascale_ddp_spawn"``
  (:class:`AdaScaleDDPStrategy`); ``"centralized"``, ``"decentralized"`` (+ ``"_spawn"``) for the
  optimizers of ``fused_optim.distributed``, without a DDP wrapper (:class:`OptimizerSyncedStrategy`);
  ``"powersgd_ddp"`` (+ ``"_spawn"``): DDP with torch's PowerSGD hook (:class:`PowerSGDDDPStrategy`).
"""

from fused_optim.optional import require

require("lightning.pytorch", "lightning", "lightning_optim")

from .callback import AdaScaleCallback
from .cli import LightningCLI, StepSchedulerCLI
from .distributed import OptimizerSyncedStrategy, PowerSGDDDPStrategy
from .noise_scale import NoiseScaleCallback
from .precision import ScaledHalfPrecision
from .strategy import AdaScaleDDPStrategy

__all__ = ["AdaScaleCallback", "AdaScaleDDPStrategy", "LightningCLI", "NoiseScaleCallback", "OptimizerSyncedStrategy",
           "PowerSGDDDPStrategy", "ScaledHalfPrecision", "StepSchedulerCLI"]
