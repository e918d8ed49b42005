"""The AMP contract: GradScaler end to end, found_inf skips everything, closures return the loss."""

import pytest
import torch

import fused_optim
from cases import STATEFUL_AND_LAYERWISE, ids
from utils import clone_groups, make_groups, params_of, set_grads, twin_groups


def snapshot(opt):
    return [p.detach().clone() for p in params_of(opt)], {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for p in params_of(opt) if p in opt.state
    }


def assert_unchanged(opt, snap):
    params, state = snap
    assert all(torch.equal(p, q) for p, q in zip(params_of(opt), params))
    now = {id(p): opt.state[p] for p in params_of(opt) if p in opt.state and opt.state[p]}
    assert now.keys() == {k for k, v in state.items() if v}
    for pid, st in now.items():
        assert all(torch.equal(v, state[pid][k]) for k, v in st.items())


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("case", STATEFUL_AND_LAYERWISE, ids=ids(STATEFUL_AND_LAYERWISE))
def test_found_inf_changes_nothing(case, fused):
    groups = clone_groups(make_groups(), case.ours_kw["lr"])
    other = clone_groups(make_groups())
    opt = case.make_ours(groups, fused=fused)
    set_grads(groups, other, 0)
    # An overflow on the very first step: no state may appear (a later first step must be a first step).
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    before = snapshot(opt)
    opt.step()
    assert_unchanged(opt, before)
    assert not any(opt.state[p] for p in params_of(opt))
    del opt.grad_scale, opt.found_inf
    for step in range(3):
        set_grads(groups, other, step)
        opt.step()
    before = snapshot(opt)
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    opt.step()
    assert_unchanged(opt, before)  # params, buffers and step counters


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("case", STATEFUL_AND_LAYERWISE, ids=ids(STATEFUL_AND_LAYERWISE))
def test_grad_scale_is_divided_out_inside_the_step(case, fused):
    ga, gb = twin_groups(case)
    scaled, plain = case.make_ours(ga, fused=fused), case.make_ours(gb, fused=fused)
    for step in range(3):
        set_grads(ga, gb, step)
        for p in params_of(scaled):
            if p.grad is not None:
                p.grad.mul_(256.0)
        scaled.grad_scale, scaled.found_inf = torch.tensor(256.0), torch.tensor(0.0)
        scaled.step()
        plain.step()
    assert all(torch.allclose(p, q, rtol=1e-6, atol=1e-7) for p, q in zip(params_of(scaled), params_of(plain)))


def _train(make_opt, dtype, steps=8, overflow_at=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    gen = torch.Generator().manual_seed(1)
    scales = []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step == overflow_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, opt, scales


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", STATEFUL_AND_LAYERWISE, ids=ids(STATEFUL_AND_LAYERWISE))
def test_grad_scaler_end_to_end_matches_torch(case, dtype):
    """GradScaler with autocast on CPU, one overflow step: same params, same scale history, and
    the overflow step skipped by both (step counters agree with torch's)."""
    ours_model, ours_opt, ours_scales = _train(lambda ps: case.make_ours(ps, fused=True), dtype)
    ref_model, ref_opt, ref_scales = _train(lambda ps: case.make_torch(ps), dtype)
    assert ours_scales == ref_scales and ours_scales[4] == ours_scales[3] / 2
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    if "step" in ref_opt.state[next(ref_model.parameters())]:
        assert ours_opt.state[next(ours_model.parameters())]["step"].item() == 7.0


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_step_runs_closure_under_grad_and_returns_its_loss(fused):
    p = torch.nn.Parameter(torch.ones(3))
    opt = fused_optim.FusedSGD([p], lr=0.1, fused=fused)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    with torch.no_grad():  # Lightning may call step from a no_grad context; the closure still needs grad
        loss = opt.step(closure)
    assert loss.item() == 3.0
    assert torch.allclose(p.detach(), torch.full((3,), 0.8))


def test_zero_grad_default_follows_set_grad_none():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    fused_optim.FusedSGD([p], lr=0.1).zero_grad()  # apex default set_grad_none=False: zeros
    assert p.grad is not None and p.grad.abs().sum() == 0
    fused_optim.FusedSGD([p], lr=0.1, set_grad_none=True).zero_grad()
    assert p.grad is None
    p.grad = torch.ones(3)
    fused_optim.FusedAdam([p]).zero_grad(set_to_none=False)
    assert p.grad is not None
