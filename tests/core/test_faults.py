"""Faults a user meets in step(): failed steps change nothing, params that share memory, bad
input refused clearly, NaN and edge sizes, and state dicts of older torch versions."""

import copy
import warnings

import numpy as np
import pytest
import torch

import fused_optim
from utils import assert_rel_close

MOMENTUM_OPTIMIZERS = {
    "sgd": lambda ps, fused: fused_optim.FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=fused),
    "sign-sgd": lambda ps, fused: fused_optim.SignSGD(ps, lr=0.01, momentum=0.9, fused=fused),
    "lars": lambda ps, fused: fused_optim.LARS(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, fused=fused),
    "colossalai-lars": lambda ps, fused: fused_optim.Lars(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, fused=fused),
}


def _params(seed=0, sizes=(7, 4097, 33)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


# ---- a failed step changes nothing -------------------------------------------------------------
def _bad_grad(kind, p):
    if kind == "sparse":
        return torch.zeros_like(p).to_sparse()
    p.grad_dtype = None  # torch refuses a grad of another dtype unless told to allow it
    return torch.zeros(p.shape, dtype=torch.float64)


@pytest.mark.parametrize("fused, bad", [(True, "sparse"), (True, "dtype"), (None, "sparse"), (None, "value")],
                         ids=["fused-sparse", "fused-dtype", "auto-sparse", "auto-group-value"])
@pytest.mark.parametrize("name", list(MOMENTUM_OPTIMIZERS))
def test_a_failed_first_step_leaves_no_trace(name, fused, bad):
    """A step that raises (one param's grad, or a bad group value), then good
    steps: the same trajectory, bit for bit, as an optimizer that never saw the failure (no state
    kept from the failed step, and the momentum buffers are not reset again on every later step)."""
    make = MOMENTUM_OPTIMIZERS[name]
    ours, clean = _params(), _params()
    opt, ref = make(ours, fused), make(clean, fused)
    for p, g in zip(ours, _grads(ours, 0)):
        p.grad = g
    before = [p.detach().clone() for p in ours]
    if bad == "value":  # a group value set after construction, refused by the check before any group steps
        opt.param_groups[0]["momentum"] = "0.9"
        with pytest.raises(ValueError, match="Invalid momentum value"):
            opt.step()
        opt.param_groups[0]["momentum"] = 0.9
    else:
        ours[1].grad = _bad_grad(bad, ours[1])
        with pytest.raises(RuntimeError, match="param 1 of group 0"):
            opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ours, before))
    assert len(opt.state) == 0  # a param that never stepped has no state
    for step in range(1, 5):
        for a, b, g in zip(ours, clean, _grads(ours, step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, clean):
            assert torch.equal(a, b), f"step {step}"
            assert torch.equal(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])


def test_a_failed_step_in_a_plan_of_several_buckets_updates_no_bucket():
    """Params of two dtypes (two buckets): a bad grad in the second leaves the first untouched."""
    ps = [torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5, dtype=torch.float64))]
    opt = fused_optim.FusedSGD(ps, lr=0.1, momentum=0.9)
    ps[0].grad = torch.ones(5)
    ps[1].grad = torch.ones(5, dtype=torch.float64).to_sparse()
    with pytest.raises(RuntimeError, match="param 1 of group 0 has a sparse gradient"):
        opt.step()
    assert torch.equal(ps[0], torch.ones(5)) and len(opt.state) == 0


@pytest.mark.parametrize("bad", ["sparse", "dtype"])
@pytest.mark.parametrize("make", [
    lambda groups: fused_optim.AdamW(groups, lr=0.1, fused=True),
    lambda groups: fused_optim.SGD(groups, lr=0.1, momentum=0.9, fused=True, state_dtype="8bit"),
    lambda groups: fused_optim.FusedAdam(groups, lr=0.1, fused=True, state_dtype=torch.bfloat16,
                                         state_rounding="stochastic"),
], ids=["adamw", "sgd-8bit", "adam-bf16-stochastic"])
def test_a_bad_grad_in_a_later_group_leaves_every_group_unchanged(make, bad):
    """Two groups (decay / no decay): a grad refused in the second group raises before the first
    group steps, so the first group's params, moments, step counters and rounding keys stay as
    they were (on its first step too: no state appears); the good steps after it follow an
    optimizer that never saw the failure, bit for bit."""
    ours, clean = _params(), _params()

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]

    opt, ref = make(groups(ours)), make(groups(clean))
    for step in range(4):
        for a, b, g in zip(ours, clean, _grads(ours, step)):
            a.grad, b.grad = g.clone(), g.clone()
        if step in (0, 2):  # a first step and a later one
            before = [p.detach().clone() for p in ours]
            state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(ours) if p in opt.state}
            good = ours[2].grad
            ours[2].grad = _bad_grad(bad, ours[2])
            with pytest.raises(RuntimeError, match="param 0 of group 1"):
                opt.step()
            ours[2].grad = good
            assert all(torch.equal(p, b) for p, b in zip(ours, before))
            assert {i for i, p in enumerate(ours) if p in opt.state} == state.keys()
            for i, saved in state.items():
                assert all(torch.equal(opt.state[ours[i]][k], v) for k, v in saved.items())
        opt.step()
        ref.step()
        for a, b in zip(ours, clean):
            assert torch.equal(a, b), f"step {step}"
            assert all(torch.equal(v, ref.state[b][k]) for k, v in opt.state[a].items())


# ---- params that share memory ------------------------------------------------------------------
N_ALIAS = 400_000  # far above one work item (16K) and the serial threshold: split between 2 threads


def _alias_layouts():
    """(name, make) where make() returns the group's params and the tensors to compare."""
    gen = torch.Generator().manual_seed(5)

    def twice():
        p = torch.nn.Parameter(torch.randn(N_ALIAS, dtype=torch.float64, generator=gen.manual_seed(5)))
        q = torch.nn.Parameter(torch.randn(100, dtype=torch.float64, generator=gen))
        return [p, q, p], [p, q]

    def overlapping_views():
        base = torch.randn(N_ALIAS + 100_000, dtype=torch.float64, generator=gen.manual_seed(6))
        a, b = torch.nn.Parameter(base[:N_ALIAS]), torch.nn.Parameter(base[100_000:])  # share 300K elements
        return [a, b], [a, b]

    return [("same-param-twice", twice), ("overlapping-views", overlapping_views)]


ALIAS_OPTIMIZERS = [
    ("sgd", lambda ps: fused_optim.FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)),
    ("adam", lambda ps: fused_optim.FusedAdam(ps, lr=0.1, weight_decay=0.01),
     lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01, foreach=False)),
]


@pytest.mark.parametrize("opt_name, ours, theirs", ALIAS_OPTIMIZERS, ids=[o[0] for o in ALIAS_OPTIMIZERS])
@pytest.mark.parametrize("layout_name, layout", _alias_layouts(), ids=[a[0] for a in _alias_layouts()])
def test_params_sharing_memory_are_updated_in_order_as_torch_does(layout_name, layout, opt_name, ours, theirs):
    """torch.optim's per-param loop updates such params one after the other (and only warns
    about a param given twice); so do we, at 2 threads, every run. float64, 6 steps: a few ulps
    per operation, far below the O(0.1) errors of two threads updating one element at once."""
    torch.set_num_threads(2)
    for _ in range(3):  # a race shows up in some runs only
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
            group_a, check_a = layout()
            group_b, check_b = layout()
            opt_a, opt_b = ours(group_a), theirs(group_b)
        for step in range(6):
            for a, b in zip(check_a, check_b):
                g = torch.randn(a.shape, dtype=a.dtype, generator=torch.Generator().manual_seed(step))
                a.grad, b.grad = g, g.clone()
            opt_a.step()
            opt_b.step()
        assert opt_a.implementation == "fused"
        for a, b in zip(check_a, check_b):
            assert_rel_close(a.detach(), b.detach(), 1e-12, f"{layout_name} {opt_name}")


def test_the_same_param_in_two_groups_is_refused_as_torch_does():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        fused_optim.FusedSGD([{"params": [p]}, {"params": [p]}], lr=0.1)


# ---- input validation --------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda ps: fused_optim.FusedSGD(ps, lr=0.1),
    lambda ps: fused_optim.SignSGD(ps, lr=0.1),
    lambda ps: fused_optim.SparsifiedSGD(ps, lr=0.1, sparse_grad_size=2),
], ids=["sgd", "sign-sgd", "sparsified-sgd"])
def test_integer_params_with_a_grad_are_refused_at_step(make):
    """torch.optim builds on an integer tensor too and fails at its step; we say why."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.full((3,), 5, dtype=torch.long)
    opt = make([p, q])
    p.grad, q.grad = torch.ones(3), torch.ones(3, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"param 1 of group 0 has dtype torch.int64; only floating-point"):
        opt.step()
    assert torch.equal(q, torch.full((3,), 5)) and torch.equal(p.detach(), torch.ones(3)) and len(opt.state) == 0


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v


def test_numpy_float32_hyperparameters_are_accepted():
    f32 = np.float32
    results = []
    for cls, kw in [(fused_optim.FusedSGD, dict(lr=f32(0.1), momentum=f32(0.9), dampening=f32(0.1),
                                                 weight_decay=f32(0.01))),
                    (fused_optim.FusedAdam, dict(lr=f32(0.1), betas=(f32(0.9), f32(0.99)), eps=f32(1e-8),
                                                  weight_decay=f32(0.01))),
                    (fused_optim.FusedLAMB, dict(lr=f32(0.1), max_grad_norm=f32(1.0))),
                    (fused_optim.SparsifiedSGD, dict(lr=f32(0.1), sparse_grad_size=np.int64(2), seed=0))]:
        ours = torch.nn.Parameter(torch.ones(4))
        plain = torch.nn.Parameter(torch.ones(4))
        floats = {k: (tuple(float(b) for b in v) if isinstance(v, tuple) else _plain(v)) for k, v in kw.items()}
        a, b = cls([ours], **kw), cls([plain], **floats)
        ours.grad, plain.grad = torch.full((4,), 0.5), torch.full((4,), 0.5)
        a.step()
        b.step()
        results.append(torch.equal(ours, plain))
    assert all(results)


STRING_FLAGS = [
    (fused_optim.FusedSGD, dict(lr=0.1, momentum=0.9, nesterov="yes"), "nesterov"),
    (fused_optim.FusedSGD, dict(lr=0.1, maximize="no"), "maximize"),
    (fused_optim.FusedAdam, dict(amsgrad="False"), "amsgrad"),
    (fused_optim.FusedAdam, dict(maximize="no"), "maximize"),
    (fused_optim.FusedAdam, dict(adam_w_mode="no"), "adam_w_mode"),
    (fused_optim.FusedLAMB, dict(amsgrad="False"), "amsgrad"),
    (fused_optim.FusedLAMB, dict(trust_clip="True"), "trust_clip"),
    (fused_optim.LARS, dict(lr=0.1, always_adapt="yes"), "always_adapt"),
    (fused_optim.SignSGD, dict(lr=0.1, momentum=0.9, nesterov="True"), "nesterov"),
    (fused_optim.SparsifiedSGD, dict(lr=0.1, random_sparse="no"), "random_sparse"),
    (fused_optim.Lamb, dict(adam="no"), "adam"),
    (fused_optim.Adagrad, dict(maximize="no"), "maximize"),
]


@pytest.mark.parametrize("cls, kwargs, name", STRING_FLAGS, ids=[f"{c.__name__}-{n}" for c, _, n in STRING_FLAGS])
def test_string_flags_are_refused_naming_the_parameter(cls, kwargs, name):
    with pytest.raises(ValueError, match=rf"Invalid {name} value: '.*' \({name} must be True or False\)"):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_a_string_flag_in_an_added_group_is_refused():
    opt = fused_optim.FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="Invalid nesterov value"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "nesterov": "False"})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_a_grad_of_another_shape_is_refused_naming_the_param_and_shapes(fused):
    """torch refuses to assign such a grad; one appears when a param's data is replaced after its
    grad was set. Same element count, other shape: refused before anything changes."""
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 3))]
    opt = fused_optim.FusedSGD(ps, lr=0.1, momentum=0.9, fused=fused)
    ps[0].grad = torch.ones(3)
    ps[1].grad = torch.ones(2, 3)
    ps[1].data = torch.ones(3, 2)
    shapes = r"param 1 of group 0 has shape \(3, 2\) but its gradient has shape \(2, 3\)"
    with pytest.raises(RuntimeError, match=shapes):
        opt.step()
    assert torch.equal(ps[0].detach(), torch.ones(3)) and len(opt.state) == 0


def test_kernel_errors_name_the_params_index_in_its_group():
    """A bucket holds some of a group's params: the kernel's index into the bucket is translated."""
    ps = [torch.nn.Parameter(torch.ones(2, dtype=torch.float64)), torch.nn.Parameter(torch.ones(3)),
          torch.nn.Parameter(torch.ones(4))]
    opt = fused_optim.FusedSGD(ps, lr=0.1, momentum=0.9, fused=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.state[ps[2]] = {"momentum_buffer": torch.ones(5)}  # a damaged state: 5 elements for 4
    with pytest.raises(RuntimeError, match=r"momentum_buffers\[1\] \(param 2 of group 0\) has 5 elements"):
        opt.step()


def test_lamb_names_a_bad_grad_by_group_and_index_in_its_global_norm():
    """The global grad norm runs over every group's grads: its index is translated too."""
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    opt = fused_optim.FusedLAMB([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.1)
    for p in ps:
        p.grad = torch.ones(3)
    ps[3].grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match=r"tensors\[3\] \(param 1 of group 1\) is sparse"):
        opt.step()
    assert all(torch.equal(p.detach(), torch.ones(3)) for p in ps) and len(opt.state) == 0


# ---- NaN and edge sizes ------------------------------------------------------------------------
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sign_sgd_with_a_nan_grad_agrees_between_kernel_and_reference(momentum):
    """torch.sign(NaN) is 0 (the reference's, and mlbench's, sign): the element does not move."""
    assert torch.sign(torch.tensor(float("nan"))).item() == 0.0
    results = []
    for fused in (True, False):
        p = torch.nn.Parameter(torch.ones(37))
        opt = fused_optim.SignSGD([p], lr=0.1, momentum=momentum, fused=fused)
        for _ in range(2):
            p.grad = torch.ones(37)
            p.grad[3] = float("nan")
            opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])
    assert results[0][3].item() == 1.0 and results[0][0].item() == pytest.approx(0.8)


@pytest.mark.parametrize("random_sparse", [False, True], ids=["block", "random"])
def test_sparsified_sgd_takes_empty_params_and_a_k_above_the_size(random_sparse):
    """An empty param sends nothing; k above a param's size sends all of it (k is clamped), on
    both implementations and with the same draws for the params after them."""
    results = []
    for fused in (True, False):
        ps = [torch.nn.Parameter(torch.ones(0)), torch.nn.Parameter(torch.ones(5)),
              torch.nn.Parameter(torch.ones(40, dtype=torch.float32))]
        opt = fused_optim.SparsifiedSGD([{"params": ps[:2], "sparse_grad_size": 10**30},
                                         {"params": ps[2:], "sparse_grad_size": 7}],
                                        lr=0.5, random_sparse=random_sparse, seed=4, fused=fused)
        for _ in range(2):
            for p in ps:
                p.grad = torch.ones_like(p)
            opt.step()
        opt.update_estimated_weights(0)
        opt.update_estimated_weights(1)
        assert torch.equal(ps[1].detach(), torch.zeros(5))  # every coordinate sent: 1 - 0.5 - 0.5
        assert ps[0].numel() == 0 and opt.state[ps[0]]["memory"].numel() == 0
        results.append([p.detach().clone() for p in ps] + opt.get_estimated_weights())
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---- state dicts of older torch versions -------------------------------------------------------
def _state_dict_of(opt_cls, kw, mutate, steps=3):
    p = torch.nn.Parameter(torch.ones(5))
    opt = opt_cls([p], **kw)
    for step in range(steps):
        p.grad = torch.full((5,), 0.1 * (step + 1))
        opt.step()
    sd = opt.state_dict()
    mutate(sd["state"][0])
    return p.detach().clone(), sd


def _continue(opt, p, steps=3):
    for step in range(steps):
        p.grad = torch.full((5,), 0.3 - 0.05 * step)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_a_plain_number_step_loads_and_continues_as_in_torch(fused):
    def to_number(state):
        state["step"] = int(state["step"].item())

    start, sd = _state_dict_of(torch.optim.Adam, dict(lr=0.1, foreach=False), to_number)
    assert isinstance(sd["state"][0]["step"], int)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    a = fused_optim.FusedAdam([ours], lr=0.1, adam_w_mode=False, fused=fused)
    b = torch.optim.Adam([theirs], lr=0.1, foreach=False)
    a.load_state_dict(copy.deepcopy(sd))  # loading shares the tensors of the dict
    b.load_state_dict(copy.deepcopy(sd))
    assert torch.equal(a.state[ours]["step"], b.state[theirs]["step"])
    assert_rel_close(_continue(a, ours), _continue(b, theirs), 1e-6, "params")  # fp32, 3 steps
    assert a.state[ours]["step"].item() == 6.0


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_a_none_momentum_buffer_means_first_step_as_in_torch(fused):
    def to_none(state):
        state["momentum_buffer"] = None

    start, sd = _state_dict_of(torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=False), to_none)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    a = fused_optim.FusedSGD([ours], lr=0.1, momentum=0.9, fused=fused)
    b = torch.optim.SGD([theirs], lr=0.1, momentum=0.9, foreach=False)
    a.load_state_dict(copy.deepcopy(sd))  # loading shares the tensors of the dict
    b.load_state_dict(copy.deepcopy(sd))
    assert_rel_close(_continue(a, ours), _continue(b, theirs), 1e-6, "params")  # fp32, 3 steps
    assert_rel_close(a.state[ours]["momentum_buffer"], b.state[theirs]["momentum_buffer"], 1e-6, "buffer")


@pytest.mark.parametrize("cls", [fused_optim.FusedAdam, fused_optim.FusedLAMB])
def test_an_adam_state_without_step_raises_as_in_torch(cls):
    """torch.optim.Adam's load_state_dict raises KeyError: 'step'; ours too, loading nothing
    (the moments were silently restarted from zero)."""
    def drop_step(state):
        del state["step"]

    start, sd = _state_dict_of(torch.optim.Adam, dict(lr=0.1, foreach=False), drop_step)
    b = torch.optim.Adam([torch.nn.Parameter(start.clone())], lr=0.1, foreach=False)
    with pytest.raises(KeyError, match="step"):
        b.load_state_dict(copy.deepcopy(sd))
    ours = torch.nn.Parameter(start.clone())
    a = cls([ours], lr=0.1)
    with pytest.raises(KeyError, match="'step'"):
        a.load_state_dict(copy.deepcopy(sd))
    assert len(a.state) == 0
    a.state[ours] = copy.deepcopy(sd["state"][0])  # the same state set directly: refused at step
    ours.grad = torch.ones(5)
    with pytest.raises(KeyError, match="'step'"):
        a.step()
    assert torch.equal(ours.detach(), start)
