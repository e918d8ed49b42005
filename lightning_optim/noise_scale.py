"""``NoiseScaleCallback``: the gradient noise scale of any LightningModule, logged while training,
and an optional batch-size ramp."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from typing_extensions import override

from fused_optim import NoiseScale
from fused_optim.adascale import GradientStatistics
from fused_optim.metrics import NOISE_SCALE
from fused_optim.noise_scale import AccumulationRamp, noise_scale_metrics

from .callback import AdaScaleCallback, _accumulation, replicas
from .lr_monitor import detach, keep_names


class NoiseScaleCallback(Callback):
    """Logs ``noise_scale/b_simple`` (B_simple in samples, :class:`fused_optim.NoiseScale`),
    ``noise_scale/batch`` (the batch of the update: world size × accumulation × micro-batch) and
    ``noise_scale/suggested_batch`` once per optimizer update.

    The statistics come from the optimizer when it is an :class:`~fused_optim.AdaScale` (returned
    by the module, or made by an :class:`~lightning_optim.AdaScaleCallback`): no second set of
    hooks. Otherwise the optimizer is wrapped in a :class:`~fused_optim.NoiseScale` at
    ``on_fit_start`` (it shares the ``param_groups``, so schedulers stay valid); its accumulation
    count and world size follow the trainer's (its data-parallel replicas: see
    :class:`~lightning_optim.AdaScaleCallback`). It needs ``accumulate_grad_batches`` ≥ 2 or
    several devices. A ``LearningRateMonitor`` keeps its series names (``lr-<the module's optimizer
    class>``, not ``lr-NoiseScale``).

    ``max_accumulation`` turns on a batch-size ramp (off by default): at each epoch start, once
    ``min_windows`` updates were measured at the current count, ``trainer.accumulate_grad_batches``
    rises to the suggested count (the largest batch not above B_simple), up to
    ``max_accumulation``; never down. With AdaScale (default scale) the scale follows the count,
    so the gain keeps the lr right for the larger batch. Not with a GradientAccumulationScheduler.
    The ramp's count and windows are in Lightning checkpoints: a resumed run trains with the count
    it had reached and raises it when an unbroken run would.

    Args:
        micro_batch_size: samples per micro-batch (per device and backward pass); default: the
            train dataloader's ``batch_size``.
        max_accumulation: the ramp's largest accumulation count (None: no ramp).
        min_windows: updates measured at a count before the ramp raises it.
        log, prog_bar: log the metrics (and show B_simple in the progress bar).
        smoothing, debias_ewma: for the NoiseScale it creates.
    """

    def __init__(self, micro_batch_size: int | None = None, max_accumulation: int | None = None,
                 min_windows: int = 20, log: bool = True, prog_bar: bool = False, smoothing: float | None = None,
                 debias_ewma: bool = True):
        if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
            raise ValueError(f"Invalid micro_batch_size: {micro_batch_size!r} (an int >= 1, or None for the "
                             "dataloader's batch_size)")
        self.micro_batch_size = micro_batch_size
        self.ramp = None if max_accumulation is None else AccumulationRamp(max_accumulation, min_windows)
        self.log_noise_scale = log  # (not ``self.log``: Lightning sets that on every callback)
        self.prog_bar = prog_bar
        self.noise_kwargs = dict(smoothing=smoothing, debias_ewma=debias_ewma)
        self._micro: int | None = None
        self._global_step = 0
        self._accumulation: int | None = None  # the ramp's count, set at epoch starts
        self._monitors: list = []  # LearningRateMonitors naming the NoiseScale's series after its optimizer
        self._restored_accumulation: int | None = None  # from a checkpoint, for on_train_start

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        if self.ramp is not None and any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise RuntimeError("NoiseScaleCallback(max_accumulation=...) ramps trainer.accumulate_grad_batches itself: "
                               "remove the GradientAccumulationScheduler, or drop max_accumulation")
        strategy = trainer.strategy
        if any(isinstance(c, AdaScaleCallback) for c in trainer.callbacks):
            return  # its AdaScale (made in its own on_fit_start) measures
        if not pl_module.automatic_optimization or len(strategy.optimizers) != 1:
            raise RuntimeError("NoiseScaleCallback needs automatic optimization with exactly one optimizer; with "
                               "manual optimization wrap your optimizer in fused_optim.NoiseScale yourself")
        if not isinstance(strategy.optimizers[0], GradientStatistics):  # (an AdaScale measures itself)
            inner = strategy.optimizers[0]
            try:
                strategy.optimizers = [NoiseScale(inner, world_size=replicas(trainer),
                                                  num_gradients_to_accumulate=_accumulation(trainer),
                                                  module=pl_module, **self.noise_kwargs)]
            except RuntimeError as err:
                raise RuntimeError(f"{err}. In Lightning: Trainer(accumulate_grad_batches=4), or more "
                                   "devices") from None
            self._monitors = keep_names(trainer, strategy.optimizers[0], inner)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        """(The dataloader exists from here on.)"""
        self._micro = self.micro_batch_size or _loader_batch_size(trainer)
        stats = self._stats(trainer)
        if isinstance(stats, NoiseScale):
            stats.micro_batch_size = self._micro
        self._global_step = trainer.global_step
        if self._restored_accumulation is not None:  # Lightning's count is the Trainer's argument again
            trainer.accumulate_grad_batches = self._accumulation = self._restored_accumulation
            self._restored_accumulation = None

    @override
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        """The ramp: a new count starts with the epoch, where Lightning's windows restart."""
        if self.ramp is None:
            return
        stats, accumulate = self._stats(trainer), trainer.accumulate_grad_batches
        c = self.ramp.next_accumulation(stats.noise_scale(self._micro), self._micro, replicas(trainer), accumulate)
        trainer.accumulate_grad_batches = self._accumulation = c

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._stats(trainer).set_window(replicas(trainer), _accumulation(trainer))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._global_step:
            return  # the batch only accumulated
        self._global_step = trainer.global_step
        if self.ramp is not None:
            self.ramp.count_window()
        if self.log_noise_scale:
            max_c = None if self.ramp is None else self.ramp.max_accumulation
            for name, value in noise_scale_metrics(self._stats(trainer), self._micro, max_c).items():
                pl_module.log(name, value, prog_bar=self.prog_bar and name == NOISE_SCALE, on_step=True,
                              on_epoch=False, batch_size=1)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        detach(self._monitors)
        self._monitors = []

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.ramp is None or self._accumulation is None:
            return {}
        return {"accumulation": self._accumulation, "ramp": self.ramp.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.ramp is not None and state_dict:
            self.ramp.load_state_dict(state_dict["ramp"])
            self._restored_accumulation = int(state_dict["accumulation"])

    @staticmethod
    def _stats(trainer) -> GradientStatistics:
        opt = trainer.strategy.optimizers[0]
        if not isinstance(opt, GradientStatistics):
            raise RuntimeError(f"NoiseScaleCallback: the optimizer is a {type(opt).__name__}, not the NoiseScale or "
                               "AdaScale it set up (did another callback replace it?)")
        return opt


def _loader_batch_size(trainer) -> int:
    """The train dataloader's ``batch_size``, the samples of a micro-batch."""
    size = getattr(trainer.train_dataloader, "batch_size", None)
    if not isinstance(size, int):
        raise ValueError("NoiseScaleCallback: the train dataloader has no int batch_size (batch_size=None or a batch "
                         "sampler): pass NoiseScaleCallback(micro_batch_size=<samples per micro-batch>)")
    return size
