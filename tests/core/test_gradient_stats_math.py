"""The gradient statistics' arithmetic (fused_optim/gradient_stats_math.py) on values worked out by
hand. The values are chosen so that every intermediate is exact in binary floating point, so the
results are compared for equality."""

from __future__ import annotations

import math

from fused_optim import gradient_stats_math as stats
from fused_optim.gradient_stats_math import NOISE_SQR, NOISE_VAR, SQR, VAR, Window


def test_unscaled_sums_divide_by_the_loss_scales_and_undo_the_accumulation():
    window = Window(local=[8.0], total=[2.0], passes=2, scale=4.0, at_backward_end=True)
    # /2² for both; scaled losses: local ·= c² = 4, total ·= (c/c')² = 1
    assert stats.unscaled_sums(window, 2.0, 2.0, accum=2, is_scaled_loss=True) == ([8.0], [0.5])
    # unscaled losses: .grad holds the sum of c' micro-batch grads, total /= c'² = 4
    assert stats.unscaled_sums(window, 2.0, 2.0, accum=2, is_scaled_loss=False) == ([2.0], [0.125])
    short = Window(local=[8.0], total=[2.0], passes=1, scale=2.0, at_backward_end=False)
    # a short window (c' = 1 of c = 2) of scaled losses: total ·= (2/1)²
    assert stats.unscaled_sums(short, 1.0, 1.0, accum=2, is_scaled_loss=True) == ([32.0], [8.0])
    # no accumulation: only the loss scales
    assert stats.unscaled_sums(short, 2.0, 1.0, accum=1, is_scaled_loss=True) == ([2.0], [2.0])


def test_estimates():
    # cN = 4, S = 4: var = 15·(4/4)/3 − 3·4/3 = 5 − 4 = 1 ; sqr = 3 − 1/4
    assert stats.estimates([15.0], [3.0], cn=4, scale=4.0) == ([1.0], [2.75])
    # noise beyond the signal: |G|² estimate negative (kept: it is unbiased)
    assert stats.estimates([9.0], [0.0], cn=4, scale=4.0) == ([3.0], [-0.75])


def test_debiased_ewma():
    avg = {}
    stats.ewma_step(avg, "x", [2.0], beta=0.5, debias=True)
    # biased = 0.5·0 + 0.5·2 = 1, unbias = 0.5 → 2
    assert avg == {"x_biased": [1.0], "x_unbias": [0.5], "x": [2.0]}
    stats.ewma_step(avg, "x", [4.0], beta=0.5, debias=True)
    # biased = 0.5·1 + 0.5·4 = 2.5, unbias = 0.75 → 10/3
    assert avg["x_biased"] == [2.5] and avg["x_unbias"] == [0.75] and avg["x"] == [2.5 / 0.75]


def test_plain_mean_then_ewma():
    avg = {"x": [0.0]}
    for value, expected in ((2.0, 2.0), (4.0, 3.0), (6.0, 4.0), (10.0, 0.75 * 4.0 + 0.25 * 10.0)):
        # β = 0.75: the plain mean while the count is below 1/(1 − β) = 4, then the EWMA
        stats.ewma_step(avg, "x", [value], beta=0.75, debias=False)
        assert avg["x"] == [expected], value
    assert avg["x_count"] == [4.0]


def test_ewma_replaces_the_lists():
    """The averages before a step stay as they were (a step that fails goes back to them)."""
    before = [1.0]
    avg = {"x": before}
    stats.ewma_step(avg, "x", [3.0], beta=0.5, debias=False)
    assert before == [1.0] and avg["x"] == [3.0]


def _window(local, total, passes=1, scale=4.0):
    return Window(local=local, total=total, passes=passes, scale=scale, at_backward_end=True)


def test_averaged_moves_all_four_averages():
    start = stats.initial_averages(1)
    avg = stats.averaged(start, _window([15.0], [3.0]), 1.0, 1.0, accum=1, world_size=4, is_scaled_loss=True,
                         beta=0.5, debias=True)
    # var = 1, sqr = 2.75 (test_estimates); the first debiased step gives each value itself
    assert (avg[VAR], avg[SQR], avg[NOISE_VAR], avg[NOISE_SQR]) == ([1.0], [2.75], [1.0], [2.75])
    assert start == {SQR: [1.0], VAR: [0.0]}  # not changed
    # gain (1 + 2.75)/(1/4 + 2.75) = 1.25 ; B_simple = 8 · 1/2.75 samples of micro-batches of 8
    assert stats.gain(avg[VAR][0], avg[SQR][0], 4.0) == 1.25
    assert stats.noise_scale(avg, 8) == 8 / 2.75


def test_averaged_clamps_adascales_averages_only():
    avg = stats.averaged(stats.initial_averages(1), _window([9.0], [0.0]), 1.0, 1.0, accum=1, world_size=4,
                         is_scaled_loss=True, beta=0.5, debias=True)
    assert (avg[VAR], avg[SQR], avg[NOISE_VAR], avg[NOISE_SQR]) == ([3.0], [0.0], [3.0], [-0.75])
    assert stats.noise_scale(avg, 1) == math.inf  # the averaged |G|² is not positive


def test_averaged_keeps_the_averages_without_an_estimate():
    start = stats.initial_averages(2)
    one_micro_batch = _window([1.0, 1.0], [1.0, 1.0], passes=1)
    assert stats.averaged(start, one_micro_batch, 1.0, 1.0, accum=1, world_size=1, is_scaled_loss=True,
                          beta=0.5, debias=True) is start
    overflow = _window([math.inf, 1.0], [1.0, 1.0])
    assert stats.averaged(start, overflow, 1.0, 1.0, accum=1, world_size=4, is_scaled_loss=True,
                          beta=0.5, debias=True) is start


def test_gain_bounds_and_noise_scale_before_any_window():
    assert stats.gain(0.0, 2.0, 8.0) == 1.0  # no variance: the large batch gains nothing
    assert stats.gain(3.0, 0.0, 8.0) == 8.0  # no signal: the full scale
    assert math.isnan(stats.noise_scale(stats.initial_averages(1), 1))


def test_a_new_scale_rescales_the_variance_and_a_new_group_starts_fresh():
    avg = {SQR: [0.5], VAR: [2.0], VAR + "_biased": [1.0], VAR + "_count": [3.0]}
    assert stats.rescaled(avg, 4.0, 8.0) == {SQR: [0.5], VAR: [1.0], VAR + "_biased": [0.5], VAR + "_count": [3.0]}
    assert stats.with_new_group(avg) == {SQR: [0.5, 1.0], VAR: [2.0, 0.0], VAR + "_biased": [1.0, 0.0],
                                         VAR + "_count": [3.0]}
