"""AdaScale against fairscale 0.4.13, the numerical reference (where fairscale breaks in real
training loops: test_adascale_robustness.py; DDP and a fresh process: test_adascale_ddp.py)."""

import pytest
import torch
from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

from adascale_loops import backward_window, micro_batch, model_and_groups
from fused_optim import AdaScale

STEPS = 30


def train(wrap, accum=2, is_scaled_loss=True, two_groups=False, changes=None, add_group_at=None, steps=STEPS):
    """Plain accumulation loop; `changes[step](opt)` runs after that step. Returns the trace of
    (pooled gain, per-group gains, params) after every step."""
    model, groups = model_and_groups(two_groups)
    if add_group_at is not None:
        late, groups = groups[1], groups[:1]
    opt = wrap(torch.optim.SGD(groups, lr=0.1, momentum=0.9), accum)
    trace = []
    for step in range(steps):
        for m in range(accum):
            x, y = micro_batch(step, m)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / accum if is_scaled_loss else loss).backward()
        opt.step()
        opt.zero_grad()
        trace.append((opt.gain(), [opt.gain(k) for k in range(len(opt.param_groups))],
                      [p.detach().clone() for p in model.parameters()]))
        if changes and step in changes:
            accum = changes[step](opt) or accum
        if step == add_group_at:
            opt.add_param_group(late)
    return trace


CONFIGS = {
    "default": dict(),
    "unscaled-loss": dict(is_scaled_loss=False),
    "no-debias": dict(debias_ewma=False),
    "smoothing": dict(smoothing=0.9),
    "scale-not-Nc": dict(scale=5.0),
    "accum-4": dict(num_gradients_to_accumulate=4),
}


def both(config, **loop):
    accum = config.get("num_gradients_to_accumulate", 2)
    kw = {k: v for k, v in config.items() if k != "num_gradients_to_accumulate"}
    ours = train(lambda inner, c: AdaScale(inner, world_size=1, num_gradients_to_accumulate=c, **kw), accum,
                 is_scaled_loss=config.get("is_scaled_loss", True), **loop)
    ref = train(lambda inner, c: FairscaleAdaScale(inner, world_size=1, num_gradients_to_accumulate=c, **kw), accum,
                is_scaled_loss=config.get("is_scaled_loss", True), **loop)
    return ours, ref


def assert_same(ours, ref):
    for step, ((g, gs, ps), (rg, rgs, rps)) in enumerate(zip(ours, ref)):
        assert g == pytest.approx(rg, rel=1e-5), f"step {step}: gain {g} vs {rg}"
        assert gs == pytest.approx(rgs, rel=1e-5), f"step {step}: group gains"
        for p, q in zip(ps, rps):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("two_groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_fairscale(name, two_groups):
    ours, ref = both(CONFIGS[name], two_groups=two_groups)
    assert_same(ours, ref)
    assert ours[-1][0] > 1.0  # the statistics did something


def test_matches_fairscale_when_scale_and_accumulation_change_mid_run():
    def rescale(opt):
        opt.set_scale(3.0)

    def accumulate_3(opt):
        opt.set_num_gradients_to_accumulate(3)
        return 3

    ours, ref = both({}, two_groups=True, changes={9: rescale, 19: accumulate_3})
    assert_same(ours, ref)


def test_matches_fairscale_after_add_param_group():
    ours, ref = both({}, two_groups=True, add_group_at=9)
    assert_same(ours, ref)
    assert len(ours[-1][1]) == 2


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
