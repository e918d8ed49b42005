"""NoiseScale (fused_optim/noise_scale.py): B_simple against a known tr(Σ)/|G|², AdaScale's
noise_scale() on the same gradients, 1 process × 4 micro-batches against 2 DDP ranks × 2, short
windows, AMP, checkpoints, the suggested accumulation and the errors."""

from __future__ import annotations

import importlib.util
import io
import math

import pytest
import torch

from fused_optim import AdaScale, NoiseScale
from fused_optim.noise_scale import AccumulationRamp, suggested_accumulation

from test_adascale_ddp import check, free_port, run_workers
from utils import WORKERS

_spec = importlib.util.spec_from_file_location("noise_scale_worker", WORKERS / "noise_scale_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

# Synthetic gradients: loss(w) = mean over the micro-batch of x·w, so a sample's gradient is
# x = G + σ·ξ (ξ ~ N(0, I)): |G|² = D·g², tr(Σ) = D·σ², B_simple = σ²/g² = 64 samples.
D, G_VALUE, SIGMA, MICRO, ACCUM = 4096, 0.1, 0.8, 8, 4
TRUE_B_SIMPLE = SIGMA**2 / G_VALUE**2


def synthetic_windows(opts, windows: int, seed: int = 0, passes: int = ACCUM, accum: int = ACCUM,
                      w: torch.Tensor | None = None) -> None:
    """``windows`` steps of ``passes`` micro-batches of MICRO samples each (losses divided by
    ``accum``) into the param ``w`` that every optimizer of ``opts`` wraps."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(windows):
        for _ in range(passes):
            x = G_VALUE + SIGMA * torch.randn(MICRO, D, generator=gen)
            ((x @ w).mean() / accum).backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()


def test_b_simple_matches_known_sigma_and_g_within_5_percent():
    """200 windows of 4 micro-batches of 8 samples (B_big = 32 = B_simple/2). Per window, the
    tr(Σ) estimate pools 3·4096 degrees of freedom (relative std √(2/12288) ≈ 1.3%) and the |G|²
    estimate has std √(4·GᵀΣG/32 + 2·tr(Σ²)/32²) ≈ 2.6 on |G|² ≈ 41 (6%); the default β
    (0.996, bias-corrected) averages the 200 windows about evenly, so B_simple's relative std is
    ≈ 0.5% (measured over 20 seeds: 0.50%, worst 1.0%): 5% is 10 standard deviations."""
    w = torch.zeros(D, requires_grad=True)
    opt = NoiseScale(torch.optim.SGD([w], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=ACCUM)
    assert math.isnan(opt.b_simple)  # nothing measured yet
    synthetic_windows([opt], 200, w=w)
    assert opt.b_simple == pytest.approx(TRUE_B_SIMPLE, rel=0.05)


def test_adascale_measures_the_same_noise_scale():
    """The same statistics code: on identical gradients (both wrap the same param; lr 0, so the
    gradients do not depend on AdaScale's gain) the values are equal exactly."""
    w = torch.zeros(D, requires_grad=True)
    noise = NoiseScale(torch.optim.SGD([w], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=ACCUM)
    ada = AdaScale(torch.optim.SGD([w], lr=0.0), num_gradients_to_accumulate=ACCUM)
    synthetic_windows([noise, ada], 5, w=w)
    assert ada.noise_scale(MICRO) == noise.b_simple
    assert ada.noise_scale() == noise.b_simple / MICRO  # in micro-batches by default
    assert ada.gain() > 1.0  # AdaScale's own statistics are there too


@pytest.mark.slow
def test_one_process_accumulating_4_equals_2_ddp_ranks_accumulating_2(tmp_path):
    """float64; the two runs differ only in summation order (all-reduced partial sums, DDP's
    averaged grads), ~1e-16 relative per op, amplified by the cancellation in tr(Σ)'s estimate
    (|G_small|² − |G_big|², here a few times smaller than its terms) over 8 steps: 1e-9 is far
    above that and far below any real difference (a wrong world size or loss scale is ≥ 1e-1)."""
    out = tmp_path / "ddp.pt"
    port = free_port()
    check(run_workers([[str(rank), str(port), str(out)] for rank in range(2)], tmp_path,
                      worker=WORKERS / "noise_scale_worker.py"))
    ddp = torch.load(out, weights_only=True)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, groups = worker.model_and_groups(two_groups=True)
        opt = NoiseScale(torch.optim.SGD(groups, lr=0.1), micro_batch_size=4, num_gradients_to_accumulate=4)
        one = worker.train(model, opt, worker.STEPS, lambda step: range(4), 4)
    finally:
        torch.set_default_dtype(old_dtype)
    assert len(ddp) == len(one) == worker.STEPS
    assert all(math.isfinite(b) and b > 0 for b in one)
    assert ddp == pytest.approx(one, rel=1e-9)


def test_short_windows_are_measured_with_their_own_length():
    """A window that ends after 2 of 4 backward passes (losses still divided by 4, as Lightning
    does) gives what full windows of 2 give: the grads are rescaled by (4/2)² and the pooled
    count is 2 (powers of two: equal up to the order of a few float64 ops)."""
    w1, w2 = torch.zeros(D, requires_grad=True), torch.zeros(D, requires_grad=True)
    short = NoiseScale(torch.optim.SGD([w1], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=4,
                       smoothing=0.9)
    full = NoiseScale(torch.optim.SGD([w2], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=2,
                      smoothing=0.9)
    synthetic_windows([short], 10, passes=2, accum=4, w=w1)
    synthetic_windows([full], 10, passes=2, accum=2, w=w2)
    assert short.b_simple == pytest.approx(full.b_simple, rel=1e-12)


def test_under_a_grad_scaler_the_statistics_are_those_of_unscaled_grads():
    """GradScaler on the CPU with a power-of-two scale: the scaled backward and the division by the
    scale² are exact, so the values are equal."""
    w1, w2 = torch.zeros(D, requires_grad=True), torch.zeros(D, requires_grad=True)
    plain = NoiseScale(torch.optim.SGD([w1], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=ACCUM)
    amp = NoiseScale(torch.optim.SGD([w2], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=ACCUM)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        for _ in range(ACCUM):
            x = G_VALUE + SIGMA * torch.randn(MICRO, D, generator=gen)
            ((x @ w1).mean() / ACCUM).backward()
            scaler.scale((x @ w2).mean() / ACCUM).backward()
        plain.step()
        scaler.step(amp)
        scaler.update()
        plain.zero_grad()
        amp.zero_grad()
    assert scaler.get_scale() == 2.0**12  # no overflow: every window was measured
    assert amp.b_simple == plain.b_simple


def test_state_dict_resumes_identically_with_weights_only():
    w = torch.zeros(D, requires_grad=True)
    opt = NoiseScale(torch.optim.SGD([w], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=ACCUM)
    synthetic_windows([opt], 3, w=w)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh = NoiseScale(torch.optim.SGD([w], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=ACCUM)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    opt.unhook()
    assert fresh.b_simple == opt.b_simple
    synthetic_windows([fresh], 2, seed=1, w=w)
    fresh.unhook()
    reference = NoiseScale(torch.optim.SGD([w], lr=0.0), micro_batch_size=MICRO, num_gradients_to_accumulate=ACCUM)
    synthetic_windows([reference], 3, w=w)
    synthetic_windows([reference], 2, seed=1, w=w)
    assert fresh.b_simple == reference.b_simple


def test_suggested_accumulation_and_ramp():
    # the largest N·c·B_micro not above B_simple, within [1, max]
    assert suggested_accumulation(100.0, micro_batch_size=8, world_size=2) == 6  # 96 ≤ 100 < 112
    assert suggested_accumulation(100.0, micro_batch_size=8, world_size=2, max_accumulation=4) == 4
    assert suggested_accumulation(3.0, micro_batch_size=8, world_size=1) == 1
    assert suggested_accumulation(math.nan, micro_batch_size=8, world_size=1) == 1
    assert suggested_accumulation(math.inf, micro_batch_size=8, world_size=1, max_accumulation=16) == 16
    assert suggested_accumulation(math.inf, micro_batch_size=8, world_size=1) == math.inf  # (no ramp: logged)
    ramp = AccumulationRamp(max_accumulation=8, min_windows=2)
    assert ramp.next_accumulation(100.0, 8, 1, 2) == 2  # not measured long enough
    ramp.count_window()
    ramp.count_window()
    assert ramp.next_accumulation(20.0, 8, 1, 4) == 4  # never lowered
    assert ramp.next_accumulation(100.0, 8, 1, 4) == 8  # raised, capped at max_accumulation
    assert ramp.next_accumulation(1000.0, 8, 1, 8) == 8  # the windows count again from the raise


def test_errors_name_the_parameter_and_the_fix():
    w = torch.zeros(4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"NoiseScale needs world_size \* num_gradients_to_accumulate > 1"):
        NoiseScale(torch.optim.SGD([w], lr=0.1))
    ada = AdaScale(torch.optim.SGD([w], lr=0.1), num_gradients_to_accumulate=2)
    with pytest.raises(TypeError, match=r"noise_scale\(micro_batch_size\)"):
        NoiseScale(ada, num_gradients_to_accumulate=2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        NoiseScale(torch.optim.SGD([w], lr=0.1), micro_batch_size=0, num_gradients_to_accumulate=2)
    with pytest.raises(ValueError, match="max_accumulation"):
        AccumulationRamp(max_accumulation=0)
