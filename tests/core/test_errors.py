"""Bad input gets a clear error naming the parameter; unsupported tensors fall back, never a copy."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fused_optim
from cases import ERROR_CASES


@pytest.mark.parametrize("cls, kwargs, pattern", ERROR_CASES, ids=[p for _, _, p in ERROR_CASES])
def test_bad_hyperparameters_raise_value_error_naming_them(cls, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_param_group_is_rejected_without_changing_the_optimizer():
    opt = fused_optim.FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls, kwargs", [
    (fused_optim.FusedSGD, dict(momentum=0.9)), (fused_optim.LARS, dict(momentum=0.9, weight_decay=0.1)),
    (fused_optim.SignSGD, {}), (fused_optim.SparsifiedSGD, dict(sparse_grad_size=2, seed=0)),
], ids=["FusedSGD", "LARS", "SignSGD", "SparsifiedSGD"])
def test_lr_given_by_every_group_instead_of_the_constructor(cls, kwargs):
    """As apex's FusedSGD and quadra's LARS (torch's ``required`` lr), the constructor may omit lr
    (None) when every param group has one (timm's create_optimizer_v2 builds them so when its lr is
    None), and then steps as with it (the same kernel on the same numbers: bit for bit). A group
    without lr is refused, naming lr, and leaves the optimizer as it was. (None rather than torch's
    placeholder: LightningCLI's parser refuses the placeholder as a float default.)"""
    start, grad = torch.linspace(-1, 1, 8), torch.linspace(0.5, -0.25, 8)
    p, q = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    by_group, by_constructor = cls([{"params": [p], "lr": 0.5}], **kwargs), cls([q], lr=0.5, **kwargs)
    for _ in range(2):
        p.grad, q.grad = grad.clone(), grad.clone()
        by_group.step()
        by_constructor.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert not torch.equal(p.detach(), start)
    with pytest.raises(ValueError, match=f"{cls.__name__}: a param group has no lr .* pass lr="):
        cls([torch.nn.Parameter(start.clone())], **kwargs)
    with pytest.raises(ValueError, match="has no lr"):
        by_group.add_param_group({"params": [torch.nn.Parameter(start.clone())]})
    assert len(by_group.param_groups) == 1


@pytest.mark.parametrize("cls, kwargs, key, value, pattern", [
    (fused_optim.FusedSGD, dict(momentum=0.9), "lr", None, r"Invalid learning rate: None"),
    (fused_optim.FusedSGD, dict(momentum=0.9), "momentum", "0.9", r"Invalid momentum value: 0\.9 \(momentum must"),
    (fused_optim.FusedAdam, {}, "weight_decay", None, r"Invalid weight_decay value: None"),
    (fused_optim.FusedLAMB, {}, "betas", (0.9,), r"Invalid betas: \(0\.9,\)"),
    (fused_optim.LARS, dict(momentum=0.9), "eps", "1e-8", r"Invalid epsilon value: 1e-8"),
    # an lr of another type than the float it was: checked as a new value (a float is not)
    (fused_optim.FusedAdam, {}, "lr", "0.1", r"Invalid learning rate: 0\.1 \(lr must be a float >= 0\)"),
    (fused_optim.FusedAdam, {}, "lr", -1, r"Invalid learning rate: -1 \(lr must be a float >= 0\)"),
    (fused_optim.FusedSGD, {}, "lr", torch.tensor([0.1, 0.2]), r"Invalid learning rate: .*Tensor lr must be 1-element"),
], ids=["sgd-lr", "sgd-momentum", "adam-weight_decay", "lamb-betas", "lars-eps", "adam-lr-str", "adam-lr-int",
        "sgd-lr-2-element-tensor"])
def test_a_bad_value_set_in_a_later_group_raises_before_any_group_steps(cls, kwargs, key, value, pattern):
    """The value is set after construction (as a schedule or user code would), in the second of two
    groups: the step raises naming it, and the first group's params and state are as they were
    (they were updated before the second group's kernel call refused the value)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, generator=gen)) for _ in range(2)]
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], lr=0.1, **kwargs)
    for p in params:
        p.grad = torch.randn(5, generator=gen)
    opt.step()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[1][key] = value
    with pytest.raises(ValueError, match=pattern):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before[0]))
    assert str(opt.state_dict()["state"]) == str(before[1])


def test_complex_params_are_refused():
    with pytest.raises(ValueError, match="complex parameters.*view_as_real"):
        fused_optim.FusedAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])


@pytest.mark.parametrize("fused", [True, None, False])
def test_sparse_gradients_raise_a_clear_error(fused):
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradient.*SparseAdam"):
        fused_optim.FusedSGD([p], lr=0.1, fused=fused).step()


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("make", [
    lambda ps, fused: fused_optim.SGD(ps, lr=0.1, momentum=0.9, fused=fused),
    lambda ps, fused: fused_optim.Adam(ps, lr=0.1, fused=fused),
    lambda ps, fused: fused_optim.ColossalLamb(ps, lr=0.1, fused=fused),
], ids=["sgd-momentum", "adam", "colossal-lamb"])
def test_a_sparse_param_raises_a_clear_error_and_changes_nothing(make, fused):
    """A sparse param (its grad is sparse too) is refused before any state is made for it (making
    the moments like it failed inside torch, with no word of the param): the error names it, and
    the dense param before it in the group is neither updated nor given state."""
    dense = torch.nn.Parameter(torch.ones(3))
    sparse = torch.zeros(2, 2).to_sparse().requires_grad_(True)
    dense.grad = torch.ones(3)
    sparse.grad = torch.ones(2, 2).to_sparse()
    opt = make([dense, sparse], fused)
    with pytest.raises(RuntimeError, match=r"param 1 of group 0 is a sparse tensor .*SparseAdam"):
        opt.step()
    assert torch.equal(dense, torch.ones(3)) and len(opt.state) == 0


def _non_contiguous_pair():
    base = torch.randn(8, 6)
    ours = torch.nn.Parameter(base.clone().t())  # a transposed view: not contiguous
    theirs = torch.nn.Parameter(base.clone().t())
    other = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    return ours, theirs, other


def test_non_contiguous_param_is_updated_in_place_by_the_reference_path():
    ours, theirs, other = _non_contiguous_pair()
    other_t = [torch.nn.Parameter(o.detach().clone()) for o in other]
    storage = ours.data_ptr()
    opt = fused_optim.FusedAdam([ours, *other], lr=0.1, weight_decay=0.01)
    ref = torch.optim.AdamW([theirs, *other_t], lr=0.1, weight_decay=0.01)
    with pytest.warns(UserWarning, match="param 0 of group 0 is not contiguous") as record:
        for step in range(3):
            for a, b in zip([ours, *other], [theirs, *other_t]):
                a.grad = torch.full_like(a, step + 1.0)
                b.grad = a.grad.clone()
            opt.step()
            ref.step()
    assert len([w for w in record if "not contiguous" in str(w.message)]) == 1  # one warning, not one per step
    assert ours.data_ptr() == storage and not ours.is_contiguous()
    assert opt.implementation == "mixed"
    torch.testing.assert_close(ours, theirs)
    for a, b in zip(other, other_t):
        torch.testing.assert_close(a, b)


def test_non_contiguous_param_with_fused_true_raises():
    ours, _, _ = _non_contiguous_pair()
    ours.grad = torch.ones_like(ours)
    with pytest.raises(RuntimeError, match=r"fused=True.*not contiguous.*fused=False"):
        fused_optim.FusedSGD([ours], lr=0.1, fused=True).step()


@pytest.mark.parametrize("cls", [fused_optim.FusedSGD, fused_optim.FusedAdam, fused_optim.FusedLAMB])
def test_a_non_contiguous_grad_is_read_in_its_logical_order(cls):
    """The kernels take a contiguous copy of a grad that is a strided view (and borrow the others)."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen)]
    grads = [torch.randn(5, 3, generator=gen).t(), torch.randn(7, generator=gen)]  # the first is transposed
    assert not grads[0].is_contiguous()
    results = []
    for fused in (True, False):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = cls(ps, lr=0.1, fused=fused, **({"momentum": 0.9} if cls is fused_optim.FusedSGD else {}))
        for _ in range(2):
            for p, g in zip(ps, grads):
                p.grad = g.clone() if g.is_contiguous() else g
            opt.step()
        assert opt.implementation == ("fused" if fused else "reference")
        results.append([p.detach() for p in ps])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grads_of_another_dtype_fall_back_with_a_warning():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad_dtype = None  # torch refuses a grad of another dtype unless told to allow it
    p.grad = torch.ones(4, dtype=torch.float32)
    opt = fused_optim.FusedSGD([p], lr=0.5)
    with pytest.warns(UserWarning, match="gradients whose dtype differs"):
        opt.step()
    assert opt.implementation == "reference" and torch.equal(p.detach(), torch.full((4,), 0.5, dtype=torch.bfloat16))


def test_kernel_rejects_mismatched_lists_without_touching_anything():
    p, g = torch.ones(4), torch.ones(3)
    with pytest.raises(RuntimeError, match=r"grads\[0\].*does not match its param"):
        torch.ops.fused_optim.sgd_([p], [g], [], [], [], lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
                                   nesterov=False, maximize=False, wd_after_momentum=False)
    buf = torch.ones(4, 2).t()  # non-contiguous state: the kernel refuses to update it
    with pytest.raises(RuntimeError, match=r"momentum_buffers\[0\] must be a dense contiguous tensor"):
        torch.ops.fused_optim.sgd_([torch.ones(2, 4)], [torch.ones(2, 4)], [buf], [], [False], lr=0.1, momentum=0.9,
                                   dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                                   wd_after_momentum=False)
    assert torch.equal(p, torch.ones(4))


BROKEN_BUILD = textwrap.dedent("""
    import warnings, torch, fused_optim
    from fused_optim import _build
    _build.CFLAGS.append("-fthis-flag-does-not-exist")
    p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)
    try:
        fused_optim.FusedSGD([p], lr=0.5, fused=True).step()
    except _build.BuildError as exc:
        print("RAISED:", exc)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            opt = fused_optim.FusedSGD([p], lr=0.5)
            opt.step(); opt.step()
    print("WARNINGS:", len(w), "|", w[0].message if w else "")
    print("IMPL:", opt.implementation, p.tolist(), fused_optim.is_available())
""")


@pytest.mark.slow
def test_failed_build_raises_with_fused_true_and_falls_back_once_with_fused_none(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", BROKEN_BUILD], env=env, capture_output=True, text=True,
                         timeout=1800).stdout
    raised = next(line for line in out.splitlines() if line.startswith("RAISED:"))
    assert "could not build its CPU kernels" in raised and "this-flag-does-not-exist" in raised
    assert "FUSED_OPTIM_VERBOSE_BUILD=1" in raised and "fused=False" in raised
    warned = next(line for line in out.splitlines() if line.startswith("WARNINGS:"))
    assert warned.startswith("WARNINGS: 1 |") and "Falling back to the reference" in warned
    # 4 reference steps of lr 0.5 on grad 1 from 1.0
    assert "IMPL: reference [-1.0, -1.0, -1.0] False" in out
