"""Lion == the update of Chen et al. 2023 as lion-pytorch computes it, bit for bit on the CPU; its
defaults and state (its bad arguments: ERROR_CASES in tests/cases.py)."""

import pytest
import torch

import fused_optim

SHAPES = ((37,), (5, 7), (3000,))
STEPS = 20


def lion_pytorch_step(params, states, lr, betas, weight_decay):
    """lion-pytorch's update (its ``update_fn``), in its order of operations: decay, the sign of
    β1·m + (1 − β1)·g, then m ← β2·m + (1 − β2)·g."""
    beta1, beta2 = betas
    with torch.no_grad():
        for p in params:
            m = states.setdefault(p, torch.zeros_like(p))
            p.mul_(1 - lr * weight_decay)
            p.add_(m.clone().mul_(beta1).add(p.grad, alpha=1 - beta1).sign_(), alpha=-lr)
            m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def _params(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for shape in SHAPES]


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kw", [dict(lr=1e-3), dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)],
                         ids=["defaults", "betas-wd"])
def test_lion_follows_lion_pytorch(kw, dtype, fused):
    """The kernel and the reference round as lion-pytorch does (β·m, then one fused multiply-add):
    equal bit for bit."""
    ours, theirs = _params(dtype), _params(dtype)
    opt = fused_optim.Lion(ours, fused=fused, **kw)
    states = {}
    full = dict(dict(betas=(0.9, 0.99), weight_decay=0.0), **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen, dtype=dtype)
            b.grad = a.grad.clone()
        opt.step()
        lion_pytorch_step(theirs, states, **full)
        for a, b in zip(ours, theirs):
            m_ours, m_theirs = opt.state[a]["exp_avg"], states[b]
            assert torch.equal(a, b) and torch.equal(m_ours, m_theirs)
    assert opt.implementation == ("fused" if fused else "reference")
    assert set(opt.state[ours[0]]) == {"exp_avg"}


def test_every_element_moves_by_lr_without_decay():
    """|Δp| = lr wherever the direction is not 0: the sign, not the gradient's size."""
    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float64))
    opt = fused_optim.Lion([p], lr=0.25)
    p.grad = torch.randn(1000, dtype=torch.float64) * torch.logspace(-6, 6, 1000, dtype=torch.float64)
    opt.step()
    assert torch.equal(p.detach(), -0.25 * p.grad.sign())


def test_the_defaults_are_lion_pytorchs():
    opt = fused_optim.Lion([torch.nn.Parameter(torch.zeros(2))])
    assert {k: opt.defaults[k] for k in ("lr", "betas", "weight_decay")} == dict(lr=1e-4, betas=(0.9, 0.99),
                                                                                 weight_decay=0.0)

