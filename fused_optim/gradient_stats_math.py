r"""The arithmetic of the gradient statistics of :class:`~fused_optim.AdaScale` and
:class:`~fused_optim.NoiseScale`, on plain Python floats (one per param group): no tensors, no hooks.

An accumulation window of c backward passes on each of N ranks ends with two sums per group
(:class:`Window`): ``local``, Σ over the cN micro-batches of ‖g_micro‖², and ``total``, ‖.grad‖²,
both still multiplied by the square of the loss scale they were taken under. With S the scale
(default N·c) and the window's own scale S·c'/c when it ended short (c' < c passes)::

    local /= micro_scale² ;  total /= grad_scale²                        (:func:`unscaled_sums`)
    c > 1:  is_scaled_loss: local ·= c², total ·= (c/c')²   else: total /= c'²
    var = local·(S/cN)/(cN − 1) − total·S/(cN − 1) ;  sqr = total − var/S  (:func:`estimates`)

``var`` is the gradient variance at the scale's base batch and ``sqr`` the squared norm of the
mean gradient |G|² (Johnson et al., "AdaScale SGD", 2020; fairscale's estimator). A window with
cN = 1, or with a non-finite estimate, leaves the averages as they were. Each window moves four
EWMAs with smoothing β (:func:`ewma_step`: bias-corrected, or a plain mean for the first
1/(1 − β) windows then the EWMA): AdaScale's ``grad_var_avg`` = max(var, 1e−6) and
``grad_sqr_avg`` = max(sqr, 0), and the unclamped, micro-batch-unit noise-scale estimates
``noise_var_avg`` = var·cN/S (tr(Σ)/B_micro) and ``noise_sqr_avg`` = sqr (McCandlish et al. 2018,
App. A). From them: the AdaScale gain (var + sqr)/(var/S + sqr) (:func:`gain`) and the noise scale
B_simple = B_micro · Σ noise_var / Σ noise_sqr (:func:`noise_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SQR, VAR = "grad_sqr_avg", "grad_var_avg"
# The noise-scale averages, per group, in units of one micro-batch: tr(Σ)/B_micro and |G|², the
# unbiased per-window estimates (not clamped: a negative |G|² estimate is part of an unbiased mean).
NOISE_VAR, NOISE_SQR = "noise_var_avg", "noise_sqr_avg"
MIN_VAR = 1e-6  # AdaScale's floor of the variance estimate


@dataclass(frozen=True)
class Window:
    """An ended accumulation window's sums, per group: the micro-batch ‖g‖² pooled over ranks
    (``local``) and ‖.grad‖² (``total``), both still carrying the loss scales; its backward passes,
    its scale S·c'/c, and whether ``total`` was taken at the end of the backward pass (before a
    ``scaler.unscale_``) or in ``step()``."""

    local: list[float]
    total: list[float]
    passes: int
    scale: float
    at_backward_end: bool


def initial_averages(groups: int) -> dict[str, list[float]]:
    """The averages before the first window: |G|² = 1 and variance 0 per group (gain 1)."""
    return {SQR: [1.0] * groups, VAR: [0.0] * groups}


def with_new_group(avg: dict[str, list[float]]) -> dict[str, list[float]]:
    """The averages with one more group, which starts as in :func:`initial_averages` (its
    accumulators at 0; the plain mean's window count is shared by all groups)."""
    return {name: value if name.endswith("_count") else [*value, 1.0 if name == SQR else 0.0]
            for name, value in avg.items()}


def rescaled(avg: dict[str, list[float]], old_scale: float, new_scale: float) -> dict[str, list[float]]:
    """The averages after the scale S changes: the variance and its accumulators are in units of
    S (the variance at the scale's base batch), so they are multiplied by S_old/S_new."""
    out = dict(avg)
    for name in (VAR, VAR + "_biased", VAR + "_total"):
        if name in out:
            out[name] = [v * (old_scale / new_scale) for v in out[name]]
    return out


def unscaled_sums(window: Window, micro_scale: float, grad_scale: float, accum: int,
                  is_scaled_loss: bool) -> tuple[list[float], list[float]]:
    """The window's (local, total) without the loss scales, as sums of micro-batch grads of the
    unscaled loss: the grads hold c' of the c-scaled (or unscaled) micro-batch losses."""
    c = window.passes
    local = [x / micro_scale**2 for x in window.local]
    total = [x / grad_scale**2 for x in window.total]
    if accum > 1:
        if is_scaled_loss:
            local = [x * accum**2 for x in local]
            total = [x * (accum / c) ** 2 for x in total]
        else:
            total = [x / c**2 for x in total]
    return local, total


def estimates(local: list[float], total: list[float], cn: int, scale: float) -> tuple[list[float], list[float]]:
    """(var, sqr) per group from cN micro-batches: the variance at the scale's base batch
    (cN/S micro-batches) and |G|², both unbiased (either may come out negative)."""
    var = [lo * (scale / cn) / (cn - 1) - to * scale / (cn - 1) for lo, to in zip(local, total)]
    sqr = [to - v / scale for to, v in zip(total, var)]
    return var, sqr


def ewma_step(avg: dict[str, list[float]], name: str, value: list[float], beta: float, debias: bool) -> None:
    """One EWMA step of ``avg[name]`` (and its accumulators) towards ``value``; ``avg``'s lists are
    replaced, never changed in place. ``debias``: the bias-corrected EWMA (``<name>_biased`` over
    ``<name>_unbias``); else the plain mean of the first 1/(1 − β) values (``<name>_total`` over
    ``<name>_count``), then the EWMA."""
    zeros = [0.0] * len(value)
    if debias:
        biased = [beta * b + (1 - beta) * v for b, v in zip(avg.get(name + "_biased", zeros), value)]
        unbias = [beta * u + (1 - beta) for u in avg.get(name + "_unbias", zeros)]
        avg[name + "_biased"], avg[name + "_unbias"] = biased, unbias
        avg[name] = [b / u for b, u in zip(biased, unbias)]
        return
    count = avg.get(name + "_count", [0.0])[0] + 1
    avg[name + "_count"] = [count]
    if count < 1 / (1 - beta):
        total = [t + v for t, v in zip(avg.get(name + "_total", zeros), value)]
        avg[name + "_total"] = total
        avg[name] = [t / count for t in total]
    else:
        avg[name] = [beta * a + (1 - beta) * v for a, v in zip(avg[name], value)]


def averaged(avg: dict[str, list[float]], window: Window, micro_scale: float, grad_scale: float, *,
             accum: int, world_size: int, is_scaled_loss: bool, beta: float,
             debias: bool) -> dict[str, list[float]]:
    """The averages after ``window`` (``avg`` itself when the window cannot estimate, cN = 1, or
    when its statistics are not finite); ``avg`` is not changed."""
    local, total = unscaled_sums(window, micro_scale, grad_scale, accum, is_scaled_loss)
    cn = world_size * window.passes
    if cn <= 1:
        return avg
    var, sqr = estimates(local, total, cn, window.scale)
    if not all(math.isfinite(x) for x in var + sqr):
        return avg
    new = dict(avg)
    ewma_step(new, NOISE_VAR, [v * cn / window.scale for v in var], beta, debias)
    ewma_step(new, NOISE_SQR, sqr, beta, debias)
    ewma_step(new, SQR, [max(q, 0.0) for q in sqr], beta, debias)
    ewma_step(new, VAR, [max(v, MIN_VAR) for v in var], beta, debias)
    return new


def gain(var: float, sqr: float, scale: float) -> float:
    """AdaScale's gain (var + sqr)/(var/S + sqr): 1 without variance, S without signal."""
    return (var + sqr) / (var / scale + sqr)


def noise_scale(avg: dict[str, list[float]], micro_batch_size: int) -> float:
    """B_simple in samples of micro-batches of ``micro_batch_size``: the ratio of the summed
    averages; NaN before the first window, inf while the averaged |G|² is not positive."""
    if NOISE_VAR not in avg:
        return math.nan
    var, sqr = sum(avg[NOISE_VAR]), sum(avg[NOISE_SQR])
    return micro_batch_size * var / sqr if sqr > 0 else math.inf
