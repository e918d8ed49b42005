"""Adagrad == torch.optim.Adagrad: trajectories in fp32 and fp64 with a tolerance derived from the
one operation that rounds differently, state dicts both ways, torch's checks and errors."""

import pytest
import torch

import fused_optim

SHAPES = ((37,), (5, 7), (3000,))  # a vector, a matrix, and more than one SIMD block and thread share
STEPS = 20
OPTIONS = {
    "defaults": {},
    "wd-lr_decay": dict(lr=0.05, weight_decay=0.1, lr_decay=0.05),
    "maximize-initial": dict(maximize=True, initial_accumulator_value=0.3, eps=1e-6),
}


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for shape in SHAPES]


def _trajectories(dtype, kw, steps=STEPS, fused=True):
    """(ours, torch's) after each step, fed the same grads."""
    ours, theirs = _params(dtype), _params(dtype)
    opt_a, opt_b = fused_optim.Adagrad(ours, fused=fused, **kw), torch.optim.Adagrad(theirs, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen, dtype=dtype)
            b.grad = a.grad.clone()
        opt_a.step()
        opt_b.step()
        yield opt_a, opt_b, ours, theirs


def _tolerance(dtype, lr, steps, params):
    """torch's fp32 CPU sqrt is not correctly rounded (1 ulp off on ~18% of elements; ours is IEEE
    sqrt on both devices), so √s + eps may differ by an ulp: the update q = clr·g/(√s + eps), with
    |q| <= clr (s >= g²), by 2 ulps of clr, and p + q then rounds to neighbouring values (an ulp
    of p). Per step <= ulp(p) + 2^-u·2·clr with u the significand bits; weight decay feeds a
    difference in p back into g at λ <= 0.1 of it: a factor 2 covers it. Summed over the steps."""
    eps = torch.finfo(dtype).eps
    return 2 * steps * (eps * max(float(p.detach().abs().max()) for p in params) + 2 * eps * lr)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_adagrad_follows_torch(option, dtype, fused):
    kw = OPTIONS[option]
    for step, (opt_a, opt_b, ours, theirs) in enumerate(_trajectories(dtype, kw, fused=fused), 1):
        atol = _tolerance(dtype, kw.get("lr", 1e-2), step, theirs)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)
            sa, sb = opt_a.state[a], opt_b.state[b]
            assert float(sa["step"]) == float(sb["step"]) == step
            if fused and kw.get("weight_decay", 0) == 0:  # the sums depend on the grads alone: one fma
                assert torch.equal(sa["sum"], sb["sum"])                # each, as torch's (the reference rounds twice)
            else:  # g + λp (one ulp of |g| + |λp| < 6, standard normal grads) squared: 2·6·ulp per step
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(sa["sum"], sb["sum"], rtol=16 * eps, atol=12 * 6 * eps * step)
    assert opt_a.implementation == ("fused" if fused else "reference")


def test_a_state_dict_moves_to_torch_and_back_and_the_runs_continue_alike():
    """Our state dict (group keys, ``step``, ``sum``) loads into torch.optim.Adagrad and torch's into
    ours; both then continue as one optimizer would."""
    kw = OPTIONS["wd-lr_decay"]
    run = _trajectories(torch.float32, kw, steps=3)
    for opt_a, opt_b, ours, theirs in run:
        pass
    assert opt_a.state_dict()["param_groups"][0].keys() == opt_b.state_dict()["param_groups"][0].keys()
    torch_from_ours = torch.optim.Adagrad([p.detach().clone().requires_grad_() for p in ours])
    torch_from_ours.load_state_dict(opt_a.state_dict())
    ours_from_torch = fused_optim.Adagrad([p.detach().clone().requires_grad_() for p in theirs])
    ours_from_torch.load_state_dict(opt_b.state_dict())
    for a, b in zip(torch_from_ours.state.values(), opt_a.state.values()):
        assert torch.equal(a["sum"], b["sum"]) and float(a["step"]) == float(b["step"]) == 3.0
    gen = torch.Generator().manual_seed(5)
    pairs = [(opt_a, ours_from_torch), (torch_from_ours, opt_b)]
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for x, y in pairs:
            for opt in (x, y):
                for p, g in zip(opt.param_groups[0]["params"], grads):
                    p.grad = g.clone()
                opt.step()
    for x, y in pairs:
        for p, q in zip(x.param_groups[0]["params"], y.param_groups[0]["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=_tolerance(torch.float32, kw["lr"], 5, [q]))


def test_the_defaults_and_group_keys_are_torchs():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_optim.Adagrad(p).defaults == torch.optim.Adagrad(p).defaults


@pytest.mark.parametrize("kw, message", [
    (dict(lr=-0.1), r"Invalid learning rate: -0\.1"),
    (dict(lr_decay=-1.0), r"Invalid lr_decay value: -1\.0"),
    (dict(weight_decay=-1.0), r"Invalid weight_decay value: -1\.0"),
    (dict(initial_accumulator_value=-1.0), r"Invalid initial_accumulator_value value: -1\.0"),
    (dict(eps=-1.0), r"Invalid epsilon value: -1\.0"),
])
def test_bad_arguments_raise_torchs_errors(kw, message):
    p = [torch.nn.Parameter(torch.zeros(2))]
    for cls in (torch.optim.Adagrad, fused_optim.Adagrad):
        with pytest.raises(ValueError, match=message):
            cls(p, **kw)


def test_differentiable_is_refused():
    with pytest.raises(ValueError, match=r"Invalid differentiable value: True .*use torch.optim.Adagrad"):
        fused_optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], differentiable=True)


def test_a_state_with_a_sum_but_no_step_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = fused_optim.Adagrad([p])
    opt.state[p]["sum"] = torch.zeros(3)
    p.grad = torch.ones(3)
    with pytest.raises(KeyError, match="'step': a param's state has \\['sum'\\]"):
        opt.step()


def test_a_sparse_grad_is_refused_naming_the_param():
    """torch's Adagrad takes sparse grads (DeepSpeed's sparse-embedding case); ours refuses them
    before anything changes."""
    p = torch.nn.Parameter(torch.ones(6))
    opt = fused_optim.Adagrad([p])
    p.grad = torch.zeros(6).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(p, torch.ones(6)) and not opt.state[p]
