"""FusedSGD == torch.optim.SGD and FusedAdam (and ColossalAI's CPUAdam / HybridAdam) == torch.optim.Adam/AdamW,
every option combination."""

import pytest
import torch

import fused_optim
from cases import (ADAM_LOW_PRECISION_CASES, ALL_CASES, SGD_CASES, SGD_LOW_PRECISION_CASES, STATEFUL_AND_LAYERWISE,
                   ids)
from utils import assert_rel_close, assert_state_close, clone_groups, make_groups, set_grads, twin_groups


def run_pair(case, dtype, steps, ours_kw=None, torch_kw=None, rtol=1e-6, late=True):
    ga, gb = twin_groups(case, dtype)
    ours = case.make_ours(ga, **(ours_kw or {}))
    theirs = case.make_torch(gb, **(torch_kw or {}))
    for step in range(steps):
        set_grads(ga, gb, step, late=late)
        ours.step()
        theirs.step()
        assert_state_close(ours, theirs, rtol, f"{case.id} {dtype} step {step}")
    return ours, theirs


@pytest.mark.slow  # 50 steps per case (seconds in all): the fast tier has the frozen trajectories
@pytest.mark.parametrize("case", ALL_CASES, ids=ids(ALL_CASES))
def test_fp32_kernel_matches_torch_over_50_steps(case):
    ours, _ = run_pair(case, torch.float32, 50, ours_kw=dict(fused=True), rtol=1e-6)
    assert ours.implementation == "fused"


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("case", ALL_CASES, ids=ids(ALL_CASES))
def test_float64_matches_torch_tightly(case, fused):
    ours, _ = run_pair(case, torch.float64, 12, ours_kw=dict(fused=fused), rtol=1e-12)
    assert ours.implementation == ("fused" if fused else "reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ADAM_LOW_PRECISION_CASES, ids=ids(ADAM_LOW_PRECISION_CASES))
def test_low_precision_adam_matches_torch_fused(case, dtype):
    """torch's fused CPU Adam also does fp32 math on fp16/bf16 storage: agree within a few ulps."""
    rtol = 4 * torch.finfo(dtype).eps
    run_pair(case, dtype, 20, ours_kw=dict(fused=True), torch_kw=dict(fused=True), rtol=rtol, late=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", SGD_LOW_PRECISION_CASES, ids=ids(SGD_LOW_PRECISION_CASES))
def test_low_precision_sgd_step_matches_torch_single_tensor(case, dtype):
    """torch's single-tensor SGD rounds each intermediate to fp16/bf16: one step agrees to 2 ulps."""
    run_pair(case, dtype, 1, ours_kw=dict(fused=True), rtol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_wd_after_momentum_follows_the_documented_rule(fused, nesterov):
    """ALGORITHMS.md: decay added after the momentum update and not stored in the buffer."""
    lr, mu, wd = 0.1, 0.9, 0.05
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4097, dtype=torch.float64, generator=gen))
    opt = fused_optim.FusedSGD([p], lr=lr, momentum=mu, weight_decay=wd, nesterov=nesterov,
                               wd_after_momentum=True, fused=fused)
    x, buf = p.detach().clone(), None
    for _ in range(10):
        g = torch.randn(4097, dtype=torch.float64, generator=gen)
        p.grad = g.clone()
        opt.step()
        buf = g.clone() if buf is None else mu * buf + g
        d = g + mu * buf if nesterov else buf.clone()
        x = x - lr * (d + wd * x)
        assert_rel_close(p.detach(), x, 1e-12, "param")
        assert_rel_close(opt.state[p]["momentum_buffer"], buf, 1e-12, "momentum_buffer")


@pytest.mark.parametrize("case", SGD_CASES[:1] + STATEFUL_AND_LAYERWISE, ids=ids(SGD_CASES[:1] + STATEFUL_AND_LAYERWISE))
def test_never_mutates_grads(case):
    groups = clone_groups(make_groups(), case.ours_kw["lr"])
    opt = case.make_ours(groups, fused=True)
    for p in (p for g in groups for p in g["params"]):
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for g in groups for p in g["params"])


@pytest.mark.parametrize("case", STATEFUL_AND_LAYERWISE, ids=ids(STATEFUL_AND_LAYERWISE))
def test_grads_that_come_and_go_match_torch(case):
    """The cached plans must follow the set of params with grads, both ways, every step."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(n, generator=gen) for n in (3, 4097, 40)]
    ours_p = [torch.nn.Parameter(t.clone()) for t in base]
    theirs_p = [torch.nn.Parameter(t.clone()) for t in base]
    ours, theirs = case.make_ours(ours_p, fused=True), case.make_torch(theirs_p)
    pattern = [(1, 1, 1), (1, 1, 1), (1, 0, 1), (1, 1, 1), (0, 0, 1), (1, 1, 1), (1, 1, 1)]
    for step, present in enumerate(pattern):
        for a, b, on in zip(ours_p, theirs_p, present):
            g = torch.randn(a.shape, generator=gen) if on else None
            a.grad, b.grad = g, None if g is None else g.clone()
        ours.step()
        theirs.step()
        assert_state_close(ours, theirs, 1e-6, f"{case.id} step {step}")


@pytest.mark.parametrize("change", ["append", "replace", "remove", "assign"])
@pytest.mark.parametrize("case", STATEFUL_AND_LAYERWISE[:4], ids=ids(STATEFUL_AND_LAYERWISE[:4]))
def test_a_group_s_params_changed_in_place_match_torch(case, change):
    """torch.optim reads ``group["params"]`` every step: a param appended, replaced, removed, or
    a new list assigned, takes effect at the next step. The cached plans must follow (they used
    to keep updating the old list: an appended param never moved)."""
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(n, generator=gen) for n in (3, 4097, 40, 17)]
    ours_p = [torch.nn.Parameter(t.clone()) for t in base]
    theirs_p = [torch.nn.Parameter(t.clone()) for t in base]
    ours, theirs = case.make_ours(ours_p[:3], fused=True), case.make_torch(theirs_p[:3])
    for step in range(6):
        if step == 3:
            for opt, ps in ((ours, ours_p), (theirs, theirs_p)):
                group = opt.param_groups[0]
                if change == "append":
                    group["params"].append(ps[3])
                elif change == "replace":
                    group["params"][1] = ps[3]
                elif change == "remove":
                    group["params"].remove(ps[0])
                else:
                    group["params"] = [ps[3], ps[2]]
        for a, b in zip(ours_p, theirs_p):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
        for a, b in zip(ours_p, theirs_p):
            assert_rel_close(a.detach(), b.detach(), 1e-6, f"{case.id} {change} step {step}")
