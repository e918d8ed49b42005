"""The gradient noise scale measured while training (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"): :class:`NoiseScale`, and the accumulation count it suggests."""

from __future__ import annotations

import math

import torch

from .adascale import GradientStatistics
from .checks import positive_int
from .metrics import BATCH, NOISE_SCALE, SUGGESTED_BATCH


class NoiseScale(GradientStatistics):
    r"""Wraps any optimizer and measures the gradient noise scale B_simple = tr(Σ)/|G|²; the update
    is the wrapped optimizer's, unchanged.

    B_simple is the batch size (in samples) up to which a larger batch still pays off about
    linearly. Per window of c backward passes on each of N ranks (B = N·c micro-batches of
    B_micro samples), per param group, from the same per-micro-batch norm hooks, kernels and one
    all-reduce as :class:`~fused_optim.AdaScale` (whose class docstring lists how windows, DDP,
    AMP, short windows and checkpoints are handled)::

        |G_small|² = (Σ over micro-batches and ranks of ‖g_micro‖²) / B      |G_big|² = ‖.grad‖²
        tr(Σ)/B_micro ≈ (|G_small|² − |G_big|²) / (1 − 1/B)        |G|² ≈ |G_big|² − tr(Σ)/(B·B_micro)

    Both unbiased estimates are averaged by an EWMA with β (default max(1 − N·c/1000, 0);
    bias-corrected with ``debias_ewma``), and ``b_simple`` is B_micro · Σ tr(Σ)/B_micro over the
    groups / Σ |G|² over the groups: the ratio of the averages, not an average of ratios (one
    window's |G|² estimate may be negative). It is NaN before the first window.

    An :class:`~fused_optim.AdaScale` measures the same: use its :meth:`noise_scale` instead of
    wrapping it again.

    Args:
        optimizer: the optimizer to wrap (ours or torch's); its param_groups are shared.
        micro_batch_size: B_micro, samples per micro-batch (per rank and backward pass); b_simple
            is in samples.
        world_size: N (default: the process group's size, or 1; 1 for DTensor params outside
            FSDP2, see :class:`~fused_optim.AdaScale` for sharded params and FSDP2).
        smoothing: β.
        num_gradients_to_accumulate: c, backward passes per step (N·c ≥ 2 is needed).
        is_scaled_loss: whether each micro-batch loss was divided by c.
        debias_ewma: bias-corrected EWMA, or a plain mean for the first 1/(1 − β) windows.
        grad_scaler: the ``torch.amp.GradScaler``, needed only when the loop calls
            ``scaler.unscale_(optimizer)`` before ``scaler.step``.
        module: the model, when FSDP2 (``fully_shard``) shards its params.
    """

    _name = "NoiseScale"
    _state_key = "noise_scale"

    def __init__(self, optimizer: torch.optim.Optimizer, micro_batch_size: int = 1, world_size: int | None = None,
                 smoothing: float | None = None, num_gradients_to_accumulate: int = 1, is_scaled_loss: bool = True,
                 debias_ewma: bool = True, grad_scaler: torch.amp.GradScaler | None = None,
                 module: torch.nn.Module | None = None):
        if isinstance(optimizer, GradientStatistics):
            raise TypeError(f"NoiseScale: the optimizer is a {type(optimizer).__name__}, which measures the noise "
                            "scale already: read optimizer.noise_scale(micro_batch_size) instead of wrapping it")
        self.micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
        super().__init__(optimizer, world_size, None, smoothing, num_gradients_to_accumulate, is_scaled_loss,
                         debias_ewma, grad_scaler, module)

    @property
    def b_simple(self) -> float:
        """The gradient noise scale in samples (see the class docstring)."""
        return self.noise_scale(self.micro_batch_size)


def suggested_accumulation(b_simple: float, micro_batch_size: int, world_size: int,
                           max_accumulation: int | None = None) -> int | float:
    """The accumulation count c whose batch N·c·B_micro is the largest not above ``b_simple``
    (at least 1, at most ``max_accumulation``); 1 while ``b_simple`` is unknown (NaN). An
    infinite ``b_simple`` (the noise dominates) suggests ``max_accumulation``, or ``inf``
    without one (no count is large enough).

    Up to B_simple a larger batch cuts the steps needed almost proportionally; beyond it the
    returns diminish (the critical batch size B_crit ≈ B_simple)."""
    if math.isnan(b_simple):
        return 1
    cap = math.inf if max_accumulation is None else max_accumulation
    c = b_simple / (world_size * micro_batch_size)
    return max(1, min(cap, math.floor(c) if math.isfinite(c) else cap))


def noise_scale_metrics(stats: GradientStatistics, micro_batch_size: int,
                        max_accumulation: int | None = None) -> dict[str, float]:
    """What the framework adapters log after an update: B_simple, the batch of the update and the
    suggested batch, all in samples (names from :mod:`fused_optim.metrics`)."""
    b_simple, n = stats.noise_scale(micro_batch_size), stats.world_size
    suggested = suggested_accumulation(b_simple, micro_batch_size, n, max_accumulation)
    return {NOISE_SCALE: b_simple, BATCH: float(n * stats.num_gradients_to_accumulate * micro_batch_size),
            SUGGESTED_BATCH: float(n * suggested * micro_batch_size)}


class AccumulationRamp:
    """An optional batch-size ramp: the accumulation count rises (never falls) to the suggested
    one (:func:`suggested_accumulation`, up to ``max_accumulation``) once the noise scale has
    been measured over ``min_windows`` windows since the last change. The framework adapters ask
    it at epoch boundaries, where a new count starts a whole window; with AdaScale, the scale
    follows the count (S = N·c) so the gain keeps the lr right for the larger batch.

    Args:
        max_accumulation: the largest accumulation count to ramp to.
        min_windows: windows measured (at the current count) before a raise.
    """

    def __init__(self, max_accumulation: int, min_windows: int = 20):
        self.max_accumulation = positive_int("max_accumulation", max_accumulation)
        self.min_windows = positive_int("min_windows", min_windows)
        self._windows = 0

    def count_window(self) -> None:
        """One more window measured at the current accumulation count."""
        self._windows += 1

    def next_accumulation(self, b_simple: float, micro_batch_size: int, world_size: int, accumulation: int) -> int:
        """The accumulation count to train with from now on."""
        if self._windows < self.min_windows:
            return accumulation
        c = suggested_accumulation(b_simple, micro_batch_size, world_size, self.max_accumulation)
        if c > accumulation:
            self._windows = 0
            return c
        return accumulation

    def state_dict(self) -> dict:
        """The windows measured since the last change (for checkpoints: a resumed ramp raises
        when an unbroken one would)."""
        return {"windows": self._windows}

    def load_state_dict(self, state: dict) -> None:
        self._windows = int(state["windows"])
