"""AdaScale against fairscale 0.4.13, the numerical reference (where fairscale breaks in real
training loops: test_adascale_robustness.py; DDP and a fresh process: test_adascale_ddp.py).

How the two are compared, and why the tolerance holds on any CPU: both run in float64 and in
lockstep, from the same state at every step (after each step fairscale's params and momentum
buffers are set to ours). A step's difference is then only the rounding of the statistics, never
a difference amplified over many steps of a chaotic trajectory. Each sum of squares has at most
212 float64 terms, so whatever the order of its reduction (which differs with the ISA and between
fairscale's per-param sums and our kernel's) it is within 212·2⁻⁵³ ≈ 2.4e-14 relative of the exact
sum. The variance estimate is a difference a − b of two such sums, which multiplies that error by
κ = (a + b)/|a − b| (checked below to stay under 1e3 on this data). Gains and the lr·gain steps
from identical params therefore agree to κ·2.4e-14 ≤ 2.4e-11 relative (params: the step's size,
at most 1, times that, plus one rounding). RTOL = 1e-9 leaves a factor 40 and still catches any
error in the formulas (a wrong factor shows at 1e-3 or more).
"""

import contextlib

import pytest
import torch
from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

from adascale_loops import backward_window, micro_batch, model_and_groups
from fused_optim import AdaScale

STEPS = 30
RTOL = 1e-9  # see the module docstring
MAX_CANCELLATION = 1e3  # κ of the variance estimate the tolerance assumes


@contextlib.contextmanager
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # fairscale's micro-batch sums take the default dtype
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def cancellation(opt: AdaScale) -> float:
    """κ = (a + b)/|a − b| of the variance estimate a − b of the window that just ended."""
    window = opt._pending
    c, accum, n = window.passes, opt.num_gradients_to_accumulate, opt.world_size * window.passes
    local = [x * accum**2 for x in window.local] if accum > 1 else window.local
    total = [x * (accum / c) ** 2 for x in window.total]
    return max((lo / n + to) / abs(lo / n - to) for lo, to in zip(local, total))


def lockstep(config: dict, accum=2, two_groups=False, changes=None, add_group_at=None, steps=STEPS):
    """Ours and fairscale's AdaScale over SGD(momentum 0.9), each in fairscale's documented loop
    (``backward; tau += opt.gain(); step()``), compared at every step; fairscale's params and
    momentum buffers are then set to ours. ``changes[step](ours, theirs)`` runs after that step
    and may return a new accumulation count. Returns our final gain."""
    scaled = config.get("is_scaled_loss", True)
    with float64():
        runs = []
        for cls in (AdaScale, FairscaleAdaScale):
            model, groups = model_and_groups(two_groups)
            late = None
            if add_group_at is not None:
                late, groups = groups[1], groups[:1]
            opt = cls(torch.optim.SGD(groups, lr=0.1, momentum=0.9), world_size=1, num_gradients_to_accumulate=accum,
                      **config)
            runs.append((model, opt, late))
        (model, ours, late), (ref_model, theirs, ref_late) = runs
        tau = ref_tau = 0.0
        for step in range(steps):
            for m, opt in ((model, ours), (ref_model, theirs)):
                for micro in range(accum):
                    x, y = micro_batch(step, micro)
                    loss = torch.nn.functional.mse_loss(m(x), y)
                    (loss / accum if scaled else loss).backward()
                if not scaled:
                    opt.scale_grad_by_num_grads_to_accum()
            where = f"step {step}"
            assert cancellation(ours) < MAX_CANCELLATION, where
            gain, ref_gain = ours.gain(), theirs.gain()
            assert gain == pytest.approx(ref_gain, rel=RTOL), f"{where}: gain {gain} vs {ref_gain}"
            groups = range(len(ours.param_groups))
            assert [ours.gain(k) for k in groups] == pytest.approx([theirs.gain(k) for k in groups], rel=RTOL), where
            tau, ref_tau = tau + gain, ref_tau + ref_gain
            ours.step()
            theirs.step()
            assert ours.gain() == gain, f"{where}: step() applied another gain than gain() read before it"
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p, q, rtol=RTOL, atol=RTOL, msg=lambda msg: f"{where}: {msg}")
                q.data.copy_(p.data)
                if p in ours.state:  # (not a group added later, before it is added)
                    theirs.state[q]["momentum_buffer"].copy_(ours.state[p]["momentum_buffer"])
            ours.zero_grad()
            theirs.zero_grad()
            if changes and step in changes:
                accum = changes[step](ours, theirs) or accum
            if step == add_group_at:
                ours.add_param_group(late)
                theirs.add_param_group(ref_late)
        assert ours.scale_invariant_steps == pytest.approx(tau, rel=1e-15)
        assert tau == pytest.approx(ref_tau, rel=RTOL)
        return ours.gain()


CONFIGS = {
    "default": dict(),
    "unscaled-loss": dict(is_scaled_loss=False),
    "no-debias": dict(debias_ewma=False),
    "smoothing": dict(smoothing=0.9),
    "scale-not-Nc": dict(scale=5.0),
}


@pytest.mark.parametrize("two_groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_fairscale(name, two_groups):
    assert lockstep(CONFIGS[name], two_groups=two_groups) > 1.0  # the statistics did something


def test_matches_fairscale_accumulating_4():
    assert lockstep({}, accum=4, two_groups=True) > 1.0


def test_matches_fairscale_when_scale_and_accumulation_change_mid_run():
    def rescale(*opts):
        for opt in opts:
            opt.set_scale(3.0)

    def accumulate_3(*opts):
        for opt in opts:
            opt.set_num_gradients_to_accumulate(3)
        return 3

    lockstep({}, two_groups=True, changes={9: rescale, 19: accumulate_3})


def test_matches_fairscale_after_add_param_group():
    lockstep({}, two_groups=True, add_group_at=9)


def test_scale_grad_by_num_grads_to_accum_divides_the_grads_by_c():
    model, groups = model_and_groups(two_groups=False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=2, is_scaled_loss=False)
    backward_window(model, 0, 2)  # (losses divided by 2: any grads do)
    before = [p.grad.clone() for p in model.parameters()]
    opt.scale_grad_by_num_grads_to_accum()
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g / 2)
    scaled = AdaScale(torch.optim.SGD(model_and_groups(False)[1], lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    with pytest.raises(RuntimeError, match="is_scaled_loss=True"):
        scaled.scale_grad_by_num_grads_to_accum()
    opt.zero_grad()
    backward_window(model, 1, 2, passes=1)
    with pytest.raises(RuntimeError, match="inside an accumulation window \\(1 of 2"):
        opt.scale_grad_by_num_grads_to_accum()


def test_effective_lr_is_lr_times_gain_and_restored():
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append([g["lr"] for g in self.param_groups])
            return super().step(closure)

    model, groups = model_and_groups(two_groups=True)
    opt = AdaScale(Spy(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    for step in range(5):
        backward_window(model, step, 2)
        opt.step()
        opt.zero_grad()
        assert seen[-1] == pytest.approx([0.1 * opt.gain(0), 0.05 * opt.gain(1)], rel=1e-12)
        assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]


def test_tau_is_the_sum_of_gains():
    model, groups = model_and_groups(two_groups=False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    total = 0.0
    for step in range(6):
        backward_window(model, step, 2)
        opt.step()
        total += opt.gain()
        opt.zero_grad()
    assert opt.scale_invariant_steps == pytest.approx(total, rel=1e-12)


def test_lr_scheduler_binds_to_it():
    model, groups = model_and_groups(two_groups=False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for step in range(2):
        backward_window(model, step, 2)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_single_worker_without_accumulation_is_refused():
    _, groups = model_and_groups(two_groups=False)
    with pytest.raises(RuntimeError, match="world_size \\* num_gradients_to_accumulate > 1"):
        AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1)
