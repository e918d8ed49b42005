"""Kernels == reference on every dtype and the odd shapes (the layer-wise, sign and sparsified
optimizers; SGD/Adam in fp16/bf16, where torch.optim is no exact oracle; every registry entry as
created by name, in fp32), results independent of the thread count, and LAMB / LARS edge
cases."""

import pytest
import torch

import fused_optim
from cases import LAYERWISE_CASES, REGISTRY_CASES, STATEFUL_CASES, ids
from utils import assert_state_close, set_grads, twin_groups

RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
        torch.float16: 4 * torch.finfo(torch.float16).eps}


DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PAIRS = [(c, d) for c in LAYERWISE_CASES for d in RTOL] + [
    (c, d) for c in STATEFUL_CASES for d in (torch.bfloat16, torch.float16)] + [
    (c, torch.float32) for c in REGISTRY_CASES]
# The fast tier keeps fp32 and bf16 (the reduced-precision template the fp16 kernels share);
# fp16 and fp64, 40% of this test's time, run in the full tier.
FULL_TIER_ONLY = (torch.float16, torch.float64)


@pytest.mark.parametrize("case, dtype", [
    pytest.param(c, d, marks=[pytest.mark.slow] if d in FULL_TIER_ONLY else [], id=f"{c.id}-{DTYPE_IDS[d]}")
    for c, d in PAIRS])
def test_kernel_matches_reference(case, dtype):
    """Odd sizes, 300 small tensors, a param without grad and one whose grads start late."""
    ga, gb = twin_groups(case, dtype)
    kernel, reference = case.make_ours(ga, fused=True), case.make_ours(gb, fused=False)
    for step in range(20):
        set_grads(ga, gb, step)
        kernel.step()
        reference.step()
        assert_state_close(kernel, reference, RTOL[dtype], f"{case.id} {dtype} step {step}")
    assert (kernel.implementation, reference.implementation) == ("fused", "reference")


THREAD_CASES = STATEFUL_CASES[-1:] + LAYERWISE_CASES


@pytest.mark.parametrize("case", THREAD_CASES, ids=ids(THREAD_CASES))
def test_thread_count_does_not_change_a_bit(case):
    """Work items split the same way whatever the thread count, and per-tensor norms are summed in
    a fixed order: 1 and 2 threads give identical params, which match the reference. With 2
    threads the tensors take every Placement of the two-pass launcher: 300_001 elements (more than
    kWhole: all threads at once), 100_003 (split at the threads' part boundary), 50_000 and 7 (held
    whole by one thread); LAMB hands u from pass 1 to pass 2 in all but the split one."""
    results = []
    for threads, fused in ((1, True), (2, True), (2, False)):
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300_001, 100_003, 50_000, 7)]
        opt = case.make_ours(ps, fused=fused)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        results.append([p.detach().clone() for p in ps])
    torch.set_num_threads(2)
    assert all(torch.equal(a, b) for a, b in zip(*results[:2]))
    for a, b in zip(*results[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_lamb_clips_with_the_global_norm_of_all_groups(fused):
    """Two groups: once clipping is active, scaling every grad changes nothing, and the clip
    divides by the norm over both groups (a per-group norm would give other moments)."""
    gen = torch.Generator().manual_seed(2)
    base = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (5, 300)]
    grads = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in base]
    total = torch.linalg.vector_norm(torch.cat(grads)).item()

    def run(scale, max_grad_norm):
        ps = [torch.nn.Parameter(t.clone()) for t in base]
        opt = fused_optim.FusedLAMB([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=0.1,
                                    max_grad_norm=max_grad_norm, fused=fused)
        for p, g in zip(ps, grads):
            p.grad = g * scale
        opt.step()
        return ps, opt

    limit = total / 2
    (a, opt_a), (b, _) = run(10.0, limit), run(20.0, limit)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    # ĝ = 10·g / (10·G / limit) with G the norm over BOTH groups; m = (1 − β1)·ĝ on the first step.
    m = opt_a.state[a[1]]["exp_avg"]
    torch.testing.assert_close(m, 0.1 * grads[1] * limit / total, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_lamb_one_group_clips_with_the_norm_of_all_its_grads(fused):
    """One group, whose direct call takes the norm itself: when the general path runs instead
    (params of two dtypes: two kernel calls; a grad gone missing after the direct plan was cached),
    each call still divides by the norm of all the group's grads, not of its own."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (7, 300, 40)]
    grads = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in base]

    def first_moments(dtypes, present):
        ps = [torch.nn.Parameter(t.to(d)) for t, d in zip(base, dtypes)]
        opt = fused_optim.FusedLAMB(ps, lr=0.1, max_grad_norm=0.5, fused=fused)
        for p, g in zip(ps, grads):  # a first step with every grad caches the plan
            p.grad = g.to(p.dtype)
        opt.step()
        moments = [opt.state[p]["exp_avg"].clone() for p in ps]
        for p, g, keep in zip(ps, grads, present):
            p.grad = g.to(p.dtype) if keep else None
        opt.step()
        return [opt.state[p]["exp_avg"] - 0.9 * m for p, m in zip(ps, moments)]

    for dtypes, present in [((torch.float64, torch.float32, torch.float64), (True, True, True)),
                            ((torch.float64,) * 3, (True, False, True))]:
        total = torch.linalg.vector_norm(torch.cat([g.to(d).double() for g, d, k in zip(grads, dtypes, present) if k]))
        for a, g, d, keep in zip(first_moments(dtypes, present), grads, dtypes, present):
            if keep:  # m − β1·m_prev = (1 − β1)·g·max_grad_norm/G with G over the present grads
                torch.testing.assert_close(a.double(), 0.1 * g.to(d).double() * 0.5 / total,
                                           rtol=1e-5 if torch.float32 in dtypes else 1e-10, atol=1e-12)


@pytest.mark.parametrize("max_grad_norm", [None, 0.0])
def test_lamb_max_grad_norm_none_or_zero_disables_clipping(max_grad_norm):
    gen = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(50, generator=gen, dtype=torch.float64))
    g = 100.0 * torch.randn(50, generator=gen, dtype=torch.float64)
    opt = fused_optim.FusedLAMB([p], lr=0.1, max_grad_norm=max_grad_norm, fused=True)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(opt.state[p]["exp_avg"], 0.1 * g, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_lamb_takes_torchs_name_for_the_decoupled_decay_flag(decoupled):
    """decoupled_weight_decay (torch's name) is apex's adam_w_mode: the same group and the same step."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(50, generator=gen, dtype=torch.float64)
    g = torch.randn(50, generator=gen, dtype=torch.float64)
    params = [torch.nn.Parameter(p0.clone()) for _ in range(2)]
    opts = [fused_optim.FusedLAMB([params[0]], lr=0.1, weight_decay=0.1, decoupled_weight_decay=decoupled),
            fused_optim.FusedLAMB([params[1]], lr=0.1, weight_decay=0.1, adam_w_mode=decoupled)]
    for p, opt in zip(params, opts):
        assert opt.param_groups[0]["adam_w_mode"] is decoupled
        p.grad = g.clone()
        opt.step()
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], p0)


@pytest.mark.parametrize("cls, kw", [(fused_optim.LARS, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
                                     (fused_optim.Lars, dict(lr=0.1, momentum=0.9, weight_decay=0.1))],
                         ids=["LARS", "Lars"])
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_lars_zero_norms_use_the_raw_gradient_scale(cls, kw, fused):
    """A zero param (LARS: raw gradient, no decay) and a zero grad (nothing moves without decay)."""
    zero_p = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    zero_g = torch.nn.Parameter(torch.ones(10, dtype=torch.float64))
    opt = cls([zero_p, zero_g], fused=fused, **kw)
    zero_p.grad = torch.full((10,), 2.0, dtype=torch.float64)
    zero_g.grad = torch.zeros(10, dtype=torch.float64)
    opt.step()
    assert torch.equal(zero_p.detach(), torch.full((10,), -0.2, dtype=torch.float64))
    expected = 1.0 if cls is fused_optim.LARS else 1.0 - 0.1 * 0.1  # Lars decays with ratio 1
    torch.testing.assert_close(zero_g.detach(), torch.full((10,), expected, dtype=torch.float64))
