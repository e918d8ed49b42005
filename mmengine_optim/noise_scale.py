"""``NoiseScaleHook``: the gradient noise scale logged to mmengine's message hub, and an optional
batch-size ramp through ``accumulative_counts``."""

from __future__ import annotations

from mmengine.hooks import Hook
from mmengine.optim import OptimWrapperDict
from typing_extensions import override

from fused_optim import NoiseScale
from fused_optim.adascale import GradientStatistics
from fused_optim.noise_scale import AccumulationRamp, noise_scale_metrics

from ._compat import accumulative_counts, is_resuming, set_accumulative_counts

RAMP_KEY = "noise_scale_ramp"  # the checkpoint entry of the ramp's state


class NoiseScaleHook(Hook):
    """Per optimizer update, the message hub gets ``train/noise_scale/b_simple`` (B_simple in
    samples, :class:`fused_optim.NoiseScale`), ``train/noise_scale/batch`` (world size ×
    ``accumulative_counts`` × micro-batch) and ``train/noise_scale/suggested_batch`` (the loggers
    show them without ``train/``).

    With an :class:`~mmengine_optim.AdaScaleOptimWrapper` the statistics are its AdaScale's; any
    other wrapper's optimizer is wrapped in a :class:`~fused_optim.NoiseScale` before training
    (``accumulative_counts`` ≥ 2 or several ranks are needed). Its statistics are not in the
    checkpoint: a resumed run measures afresh (AdaScale's are).

    ``max_accumulation`` turns on a batch-size ramp (off by default): once ``min_windows`` updates
    were measured at the current count, ``accumulative_counts`` rises to the suggested count (the
    largest batch not above B_simple), up to ``max_accumulation``; never down. The new count starts
    at the first update whose iteration count it divides (mmengine's windows are counted from
    iteration 0). With AdaScale (default scale) the scale follows the count, so the gain keeps the
    lr right for the larger batch. The ramp's count and windows are in the checkpoint
    (``"noise_scale_ramp"``): a resumed run trains with the count it had reached.

    Args:
        micro_batch_size: samples per micro-batch (per rank and iteration); default: the train
            dataloader's ``batch_size``.
        max_accumulation: the ramp's largest ``accumulative_counts`` (None: no ramp).
        min_windows: updates measured at a count before the ramp raises it.
        smoothing, debias_ewma: for the NoiseScale it creates.
    """

    priority = "NORMAL"  # before the LoggerHook (BELOW_NORMAL) reads the message hub

    def __init__(self, micro_batch_size: int | None = None, max_accumulation: int | None = None,
                 min_windows: int = 20, smoothing: float | None = None, debias_ewma: bool = True):
        if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
            raise ValueError(f"Invalid micro_batch_size: {micro_batch_size!r} (an int >= 1, or None for the "
                             "dataloader's batch_size)")
        self.micro_batch_size = micro_batch_size
        self.ramp = None if max_accumulation is None else AccumulationRamp(max_accumulation, min_windows)
        self.noise_kwargs = dict(smoothing=smoothing, debias_ewma=debias_ewma)
        self._micro: int | None = None
        self._target: int | None = None  # the ramp's next count, until an update boundary fits it

    @override
    def before_train(self, runner) -> None:
        wrapper = runner.optim_wrapper
        if isinstance(wrapper, OptimWrapperDict):
            raise TypeError("NoiseScaleHook measures one optimizer: it does not take an OptimWrapperDict")
        self._micro = self.micro_batch_size or getattr(runner.train_dataloader, "batch_size", None)
        if not isinstance(self._micro, int):
            raise ValueError("NoiseScaleHook: the train dataloader has no int batch_size: pass "
                             "dict(type='mmengine_optim.NoiseScaleHook', micro_batch_size=<samples per iteration>)")
        if not isinstance(wrapper.optimizer, GradientStatistics):
            try:
                wrapper.optimizer = NoiseScale(wrapper.optimizer, self._micro,
                                               num_gradients_to_accumulate=accumulative_counts(wrapper),
                                               **self.noise_kwargs)
            except RuntimeError as err:
                raise RuntimeError(f"{err}. In mmengine: optim_wrapper=dict(accumulative_counts=4, ...), or more "
                                   "ranks") from None

    @override
    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        wrapper = runner.optim_wrapper
        if not wrapper.should_update():  # the iteration only accumulated
            return
        stats = wrapper.optimizer
        max_c = None if self.ramp is None else self.ramp.max_accumulation
        for name, value in noise_scale_metrics(stats, self._micro, max_c).items():
            runner.message_hub.update_scalar(f"train/{name}", value)
        if self.ramp is None:
            return
        self.ramp.count_window()
        c = accumulative_counts(wrapper)
        target = self.ramp.next_accumulation(stats.noise_scale(self._micro), self._micro, stats.world_size, c)
        self._target = target if target != c else self._target
        if self._target is not None and wrapper.inner_count % self._target == 0:
            self._set_accumulation(runner, stats, self._target)
            self._target = None

    @override
    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self.ramp is not None:
            checkpoint[RAMP_KEY] = {"accumulation": accumulative_counts(runner.optim_wrapper),
                                    "target": self._target, "ramp": self.ramp.state_dict()}

    @override
    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        """On resume (not ``load_from``, as mmengine's EMAHook), before mmengine counts the resumed
        iterations in windows of the wrapper's count (``initialize_count_status``), set here; the
        statistics' count comes with the optimizer state (AdaScale) or from it (``before_train``)."""
        saved = checkpoint.get(RAMP_KEY)
        if self.ramp is None or saved is None or not is_resuming(runner):
            return
        self.ramp.load_state_dict(saved["ramp"])
        self._target = saved["target"]
        set_accumulative_counts(runner.optim_wrapper, int(saved["accumulation"]))

    @staticmethod
    def _set_accumulation(runner, stats: GradientStatistics, c: int) -> None:
        """mmengine's count (and, through ``initialize_count_status`` at the current iteration, the
        short last window it derives from it) and the statistics'."""
        wrapper = runner.optim_wrapper
        set_accumulative_counts(wrapper, c)
        wrapper.initialize_count_status(runner.model, wrapper.inner_count, runner.train_loop.max_iters)
        stats.set_window(stats.world_size, c)
