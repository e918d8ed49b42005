"""SparsifiedSGD: error feedback keeps every gradient, k coordinates per step, any shape, the
estimated-weights average of mlbench_core (golden), a private generator."""

import copy
import pickle

import pytest
import torch

import fused_optim
from utils import GOLDEN

SHAPES = [(), (7,), (4, 5), (2, 3, 4), (1, 20)]


def run(fused, random_sparse, steps=6, k=3, weight_decay=0.0, seed=0):
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]
    start = [p.detach().clone() for p in ps]
    opt = fused_optim.SparsifiedSGD(ps, lr=0.1, weight_decay=weight_decay, sparse_grad_size=k,
                                    random_sparse=random_sparse, seed=seed, fused=fused)
    grads, changed = [torch.zeros_like(p) for p in ps], []
    for _ in range(steps):
        before = [p.detach().clone() for p in ps]
        for p, total in zip(ps, grads):
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            total += p.grad
        opt.step()
        changed.append([(p.detach() != b).flatten().nonzero().flatten() for p, b in zip(ps, before)])
    return ps, start, grads, opt, changed


@pytest.mark.parametrize("random_sparse", [False, True], ids=["block", "random"])
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_error_feedback_loses_no_gradient(fused, random_sparse):
    """Without decay: params + memory = start − lr·Σg, whatever was sent."""
    ps, start, grads, opt, _ = run(fused, random_sparse)
    for p, s, g in zip(ps, start, grads):
        torch.testing.assert_close(p.detach() - opt.state[p]["memory"], s - 0.1 * g, rtol=1e-12, atol=1e-12)
    assert opt.implementation == ("fused" if fused else "reference")


@pytest.mark.parametrize("random_sparse", [False, True], ids=["block", "random"])
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_k_coordinates_per_tensor_and_step(fused, random_sparse):
    _, _, _, _, changed = run(fused, random_sparse, k=3)
    for step in changed:
        for shape, idx in zip(SHAPES, step):
            numel = torch.Size(shape).numel()
            assert 1 <= len(idx) <= min(3, numel)
            if not random_sparse:  # one block [b·k, b·k + k) of the flattened tensor
                assert idx[0] % 3 == 0 and torch.equal(idx, torch.arange(idx[0], idx[0] + len(idx)))
    if random_sparse:  # random subsets are not always blocks
        assert any(not torch.equal(idx, torch.arange(idx[0], idx[0] + len(idx))) for step in changed for idx in step)


def test_weight_decay_is_not_multiplied_by_lr():
    p = torch.nn.Parameter(torch.full((10,), 2.0, dtype=torch.float64))
    opt = fused_optim.SparsifiedSGD([p], lr=0.1, weight_decay=0.25, sparse_grad_size=10, fused=True, seed=0)
    p.grad = torch.ones(10, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((10,), 2.0 - 0.25 * 2.0 - 0.1, dtype=torch.float64))


def test_seed_makes_runs_repeatable_and_different_seeds_differ():
    a, *_ = run(True, True, seed=7)
    b, *_ = run(True, True, seed=7)
    c, *_ = run(True, True, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_draws_the_coordinates_the_original_draws(how):
    """A copy of the optimizer after 6 steps has its own generator in the original's state: fed the
    same grads, copy and original update the same coordinates by the same amounts (the copy lost
    its generator and its step raised AttributeError)."""
    ps, _, _, opt, _ = run(True, True)
    copied = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert copied.generator is not opt.generator
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p, q in zip(ps, copied.param_groups[0]["params"]):
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            q.grad = p.grad.clone()
        opt.step()
        copied.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, copied.param_groups[0]["params"]))


def golden_estimates():
    data = torch.load(GOLDEN / "mlbench_sparsified_estimates.pt", weights_only=True)
    return [pytest.param(c, id=c["id"]) for c in data["cases"]]


@pytest.mark.parametrize("case", golden_estimates())
def test_estimated_weights_follow_mlbench(case):
    p = torch.nn.Parameter(case["params"][0][0].clone())
    opt = fused_optim.SparsifiedSGD([p], lr=0.1, sparse_grad_size=case["k"], seed=0)
    for t, (params, estimates) in enumerate(zip(case["params"], case["estimates"])):
        with torch.no_grad():
            p.copy_(params[0])
        opt.update_estimated_weights(t, case["k"])
        torch.testing.assert_close(opt.get_estimated_weights()[0], estimates[0], rtol=1e-12, atol=1e-14)
