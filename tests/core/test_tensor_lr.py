"""A Tensor lr (torch.optim's form, what CUDA graph capture needs): the ops read ``lr_tensor`` in
place of ``lr``, the optimizers accept a Tensor lr and follow a scheduler that changes it in place,
and a bad one is refused naming the parameter."""

import pytest
import torch

import fused_optim
from fused_optim.specs import SPECS
from test_ops import SCALARS, sample_args, same_draws


@pytest.mark.parametrize("op", list(SCALARS))
def test_ops_read_lr_tensor_instead_of_lr(op):
    args, kwargs = sample_args(op, torch.float32, amp=True)
    clone = lambda: tuple([x.clone() if isinstance(x, torch.Tensor) else x for x in a] for a in args)  # noqa: E731
    with_float, with_tensor, reference = clone(), clone(), clone()
    getattr(torch.ops.fused_optim, op)(*with_float, **same_draws(kwargs))
    tensor_kwargs = {**same_draws(kwargs), "lr": 123.0, "lr_tensor": torch.tensor(kwargs["lr"], dtype=torch.float64)}
    getattr(torch.ops.fused_optim, op)(*with_tensor, **tensor_kwargs)
    SPECS[op].run_reference(*reference, **{**tensor_kwargs, **same_draws(kwargs), "lr": 123.0})
    for a, b, c in zip(with_float, with_tensor, reference):
        for x, y, z in zip(a, b, c):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), op
                torch.testing.assert_close(z, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, kw", [(fused_optim.FusedSGD, dict(momentum=0.9, weight_decay=1e-4)),
                                     (fused_optim.FusedAdam, dict(weight_decay=1e-2)),
                                     (fused_optim.FusedLAMB, dict(weight_decay=1e-2)),
                                     (fused_optim.LARS, dict(momentum=0.9, weight_decay=1e-4, trust_clip=True))],
                         ids=["sgd", "adamw", "lamb", "lars"])
def test_a_tensor_lr_follows_a_scheduler_like_a_float_lr(cls, kw):
    torch.manual_seed(0)
    init = [torch.randn(n) for n in (3, 4097, 300)]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    lr = torch.tensor(0.05)
    opt_a, opt_b = cls(a, lr=lr, fused=True, **kw), cls(b, lr=0.05, fused=True, **kw)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt_a, opt_b)]
    for k in range(6):
        for p, q in zip(a, b):
            p.grad = torch.full_like(p, 0.1 * (k + 1)) + p.detach() * 0.01
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()
        for s in scheds:
            s.step()
    assert opt_a.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.05 * 0.5**3)
    assert opt_a.implementation == "fused"
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lr, match", [(torch.tensor([0.1, 0.2]), "Tensor lr must be 1-element and floating"),
                                       (torch.tensor(1), "Tensor lr must be 1-element and floating"),
                                       (torch.tensor(-0.1), "lr must be >= 0")])
def test_a_bad_tensor_lr_is_refused(lr, match):
    with pytest.raises(ValueError, match=f"Invalid learning rate.*{match}"):
        fused_optim.FusedSGD([torch.nn.Parameter(torch.ones(2))], lr=lr)
