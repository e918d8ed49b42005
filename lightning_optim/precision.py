"""``ScaledHalfPrecision``: Lightning's ``precision="16-true"`` (the module cast to fp16) with a
dynamic loss scale, for optimizers with fp32 master weights inside their step.

``"bf16-true"`` needs nothing of ours: return an optimizer with ``master_weights=True`` (the bf16
params then step through fp32 masters) and train. fp16's range needs a loss scale, which
Lightning's ``16-true`` plugin lacks and its ``16-mixed`` one cannot give fp16 params (GradScaler
refuses to unscale fp16 grads). This plugin is ``16-true`` plus ``16-mixed``'s scaler path: the
loss is scaled before backward, and ``torch.amp.GradScaler.step`` hands ``grad_scale`` /
``found_inf`` to the optimizer, whose kernel unscales the fp16 grads into the fp32 update and
skips the step on overflow; the scale backs off and grows as GradScaler's does, and is saved in
checkpoints. Pass it as a plugin::

    trainer = Trainer(plugins=[lightning_optim.ScaledHalfPrecision()])
    # LightningCLI: --trainer.plugins lightning_optim.ScaledHalfPrecision
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
from typing_extensions import override


class ScaledHalfPrecision(HalfPrecision, MixedPrecision):
    """fp16 module (``HalfPrecision``'s casts, no autocast) with ``MixedPrecision``'s loss
    scaling, for optimizers that unscale inside their step (``_step_supports_amp_scaling``:
    fused_optim's, typically with ``master_weights=True``).

    Args:
        device: the device type of the scaler, "cuda" or "cpu" (default: "cuda" where available).
        **scaler_kwargs: ``torch.amp.GradScaler``'s ``init_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``.
    """

    def __init__(self, device: str | None = None, **scaler_kwargs: Any) -> None:
        HalfPrecision.__init__(self, "16-true")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.scaler = torch.amp.GradScaler(self.device, **scaler_kwargs)

    @override
    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """MixedPrecision's scaler step, for an optimizer that unscales fp16 grads itself."""
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise TypeError(
                f"ScaledHalfPrecision: {type(optimizer).__name__} does not unscale inside its step, and "
                "torch.amp.GradScaler cannot unscale fp16 grads for it; use a fused_optim optimizer (e.g. "
                "fused_optim.FusedAdam(..., master_weights=True))")
        return MixedPrecision.optimizer_step(self, optimizer, model, closure, **kwargs)
