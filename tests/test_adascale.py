"""AdaScale against fairscale 0.4.13 (the numerical reference), and where fairscale breaks in
real training loops, that ours does not."""

import io

import pytest
import torch
from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

import fused_optim
from fused_optim import AdaScale

STEPS = 30


def model_and_groups(two_groups: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.05}] if two_groups else [{"params": params}]
    return model, groups


def micro_batch(step: int, micro: int):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(4, 8, generator=gen)
    return x, torch.sin(x[:, :4] * 3) + 0.3 * torch.randn(4, 4, generator=gen)


def backward_window(model, step: int, accum: int, passes: int | None = None) -> None:
    """The window's backward passes (``passes``, default ``accum``) of losses divided by accum."""
    for m in range(accum if passes is None else passes):
        x, y = micro_batch(step, m)
        (torch.nn.functional.mse_loss(model(x), y) / accum).backward()


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


# ---- where fairscale breaks ---------------------------------------------------------------------
def closure_loop(opt_factory, steps=4, accum=2):
    """Lightning's pattern: the window's last backward runs inside step(closure)."""
    model, groups = model_and_groups(two_groups=False)
    opt = opt_factory(torch.optim.SGD(groups, lr=0.1))
    for step in range(steps):
        for m in range(accum - 1):
            x, y = micro_batch(step, m)
            (torch.nn.functional.mse_loss(model(x), y) / accum).backward()

        def closure(step=step):
            x, y = micro_batch(step, accum - 1)
            loss = torch.nn.functional.mse_loss(model(x), y) / accum
            loss.backward()
            return loss

        opt.step(closure)
        opt.zero_grad()
    return opt


def test_step_with_closure_runs_it_first():
    ours = closure_loop(lambda inner: AdaScale(inner, world_size=1, num_gradients_to_accumulate=2))
    assert ours.gain() > 1.0 and ours.scale_invariant_steps > 4.0
    with pytest.raises(AssertionError, match="Don't step without finishing backward phase"):
        closure_loop(lambda inner: FairscaleAdaScale(inner, world_size=1, num_gradients_to_accumulate=2))


def test_short_last_window_uses_the_backward_passes_seen():
    model, groups = model_and_groups(two_groups=False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=4)
    for step, micro in enumerate([4, 4, 3, 4, 1]):  # an epoch ending with 3, then with 1 backward
        backward_window(model, step, 4, micro)
        before = opt.state_dict()["adascale"]
        opt.step()
        opt.zero_grad()
        after = opt.state_dict()["adascale"]
        assert after["backwards"] == 0
        if micro == 1:  # one micro-batch on one rank: no variance estimate, averages kept
            assert torch.equal(before["grad_var_avg"], after["grad_var_avg"])
        else:
            assert not torch.equal(before["grad_var_avg"], after["grad_var_avg"])
    assert all(torch.isfinite(p).all() for p in model.parameters()) and opt.gain() > 1.0
    # fairscale asserts on the short window's next backward
    model, groups = model_and_groups(two_groups=False)
    ref = FairscaleAdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=4)
    with pytest.raises(AssertionError):
        for step, micro in enumerate([3, 4]):
            backward_window(model, step, 4, micro)
            ref.step()
            ref.zero_grad()


def test_frozen_params_and_params_without_grads():
    model, _ = model_and_groups(two_groups=False)
    model[0].weight.requires_grad_(False)
    extra = torch.nn.Parameter(torch.ones(3))  # in the optimizer, never in the graph
    opt = AdaScale(fused_optim.FusedSGD([*model.parameters(), extra], lr=0.1, momentum=0.9),
                   world_size=1, num_gradients_to_accumulate=2)
    frozen = model[0].weight.detach().clone()
    for step in range(3):
        backward_window(model, step, 2)
        opt.step()
        opt.zero_grad()
    assert torch.equal(model[0].weight, frozen) and torch.equal(extra.detach(), torch.ones(3))
    assert opt.gain() > 1.0


def test_grad_scaler_divides_norms_by_the_scale_and_skips_overflow_windows():
    def run(use_scaler, overflow_at=None):
        model, groups = model_and_groups(two_groups=False)
        opt = AdaScale(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9), world_size=1,
                       num_gradients_to_accumulate=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000) if use_scaler else None
        gains = []
        for step in range(6):
            for m in range(2):
                x, y = micro_batch(step, m)
                loss = torch.nn.functional.mse_loss(model(x), y) / 2
                if step == overflow_at and m == 1:
                    loss = loss * float("inf")
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            gains.append((opt.gain(), opt.scale_invariant_steps))
        return [p.detach().clone() for p in model.parameters()], gains

    plain, plain_gains = run(False)
    scaled, scaled_gains = run(True)
    for p, q in zip(plain, scaled):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [g for g, _ in scaled_gains] == pytest.approx([g for g, _ in plain_gains], rel=1e-6)
    _, overflow_gains = run(True, overflow_at=3)
    assert overflow_gains[3] == overflow_gains[2]  # nothing changed: no statistics, no τ
    assert all(torch.isfinite(torch.tensor(g)) for g, _ in overflow_gains)


def test_state_dict_mid_window_loads_with_weights_only_and_continues_identically():
    def start():
        model, groups = model_and_groups(two_groups=True)
        return model, AdaScale(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9), world_size=1,
                               num_gradients_to_accumulate=2)

    def backward(model, step, m):
        x, y = micro_batch(step, m)
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()

    model, opt = start()
    for step in range(4):
        backward(model, step, 0)
        backward(model, step, 1)
        opt.step()
        opt.zero_grad()
    backward(model, 4, 0)  # mid-window
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "grads": [p.grad.clone() for p in model.parameters()]}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = start()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for p, g in zip(model2.parameters(), ckpt["grads"]):
        p.grad = g
    for m, o in ((model, opt), (model2, opt2)):
        backward(m, 4, 1)
        o.step()
        o.zero_grad()
        for step in range(5, 8):
            backward(m, step, 0)
            backward(m, step, 1)
            o.step()
            o.zero_grad()
    assert opt.gain() == opt2.gain() and opt.scale_invariant_steps == opt2.scale_invariant_steps
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_no_del_and_unhook_removes_the_hooks():
    model, groups = model_and_groups(two_groups=False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    assert "__del__" not in vars(AdaScale)
    opt.unhook()
    x, y = micro_batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert opt.state_dict()["adascale"]["backwards"] == 0


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
