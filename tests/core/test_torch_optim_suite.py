"""torch's generic optimizer tests (the ideas of ``TestOptimRenewed`` in torch's test/test_optim.py,
written here in our own words) run on fused_optim.SGD / Adam / AdamW.

They are driven by torch 2.13's own ``OptimizerInfo`` entries (``optim_db`` in
``torch.testing._internal.common_optimizers``, shipped in the wheel): every kwargs set of
``optim_inputs_func`` and every bad input of ``optim_error_inputs_func``, with ``optim_cls``
swapped for ours in a copy of the entry. The copy also states our two documented limitations in
the entry's own flags: ``supports_complex=False`` and ``supports_sparse=False`` (their tests
check that we refuse those clearly).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import pickle
import warnings

import pytest
import torch
from torch.nn import Parameter

pytest.importorskip("expecttest", reason="torch.testing._internal imports expecttest: pip install 'fused-optim[test]'")
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db  # noqa: E402

import fused_optim  # noqa: E402
from utils import assert_pairs_close  # noqa: E402

NAMES = ("SGD", "Adam", "AdamW")
TORCH_INFOS = {info.name: info for info in optim_db if info.name in NAMES}


def _ours(info):
    """torch's entry with our class, and our limitations in its flags."""
    ours = copy.copy(info)
    ours.optim_cls = getattr(fused_optim, info.name)
    ours.supports_complex = False
    ours.supports_sparse = False
    return ours


OUR_INFOS = {name: _ours(info) for name, info in TORCH_INFOS.items()}


def _inputs(name, dtype=torch.float32):
    """(id, kwargs) of every ``optim_inputs_func`` config torch tests ``name`` with on the CPU."""
    return [(f"{name}-{inp.desc.replace(' ', '_')}", inp.kwargs)
            for inp in TORCH_INFOS[name].optim_inputs_func(device="cpu", dtype=dtype)]


INPUTS = [(name, cid, kw) for name in NAMES for cid, kw in _inputs(name)]
INPUT_IDS = [cid for _, cid, _ in INPUTS]
SMALL = [x for x in INPUTS if x[1] in ("SGD-nesterov", "SGD-default", "Adam-amsgrad", "AdamW-maximize")]


def _fresh(kwargs: dict) -> dict:
    """A copy per optimizer: a Tensor lr must not be shared (a scheduler changes it in place)."""
    return copy.deepcopy(kwargs)


# ---- the model of torch's derived-optimizer tests, run in lockstep by several optimizers -----------------------
def _model(dtype):
    """torch's test model: Linear(2,3), Sigmoid, Linear(3,1), Sigmoid, plus a 0-dim param last (an
    edge case for multi-tensor code), all from one seed."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid())
    model.to(dtype)
    scalar = Parameter(torch.rand((), dtype=dtype))
    return model, [*model.parameters(), scalar]


def _lockstep(make_optimizers, dtype, rtol, steps=7, no_grad_step=3):
    """Each optimizer gets its own copy of the model; all see the same grads each step (none at
    ``no_grad_step``: after ``zero_grad()`` the step must change nothing). After every step each
    optimizer's params and state must match the first's to ``rtol`` (relative to each tensor's
    scale), and hold state for exactly the same params."""
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    runs = []
    for make in make_optimizers:
        model, params = _model(dtype)
        runs.append((model, params, make(params)))
    for step in range(steps):
        for model, params, opt in runs:
            opt.zero_grad()
            if step != no_grad_step:
                (model(x).sum() + params[-1] ** 2).backward()
            opt.step()
        ref_params, ref_opt = runs[0][1], runs[0][2]
        for _, params, opt in runs[1:]:
            _assert_same_state(opt, params, ref_opt, ref_params, rtol, f"step {step}")
    return [opt for _, _, opt in runs]


def _assert_same_state(opt, params, ref_opt, ref_params, rtol, label):
    assert len(opt.state) == len(ref_opt.state), f"{label}: state entries {len(opt.state)} vs {len(ref_opt.state)}"
    names, actual, expected = [], [], []
    for i, (p, q) in enumerate(zip(params, ref_params)):
        names.append(f"{label} param {i}")
        actual.append(p.detach())
        expected.append(q.detach())
        mine, ref = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert set(mine) == set(ref), f"{label}: state keys of param {i}: {sorted(mine)} vs {sorted(ref)}"
        for k in sorted(ref):
            names.append(f"{label} state {k} of param {i}")
            actual.append(torch.as_tensor(mine[k]))
            expected.append(torch.as_tensor(ref[k]))
    assert_pairs_close(names, actual, expected, rtol)


# Tolerance of ours vs torch after `steps` steps. Both compute the same formula per element, in
# a different order (our kernels fold lr/bc1 and √bc2 into scalars and use fused multiply-adds;
# torch's loop rounds each in-place op). Per step that is ~10 roundings of at most ½ ulp each,
# i.e. ≤ 5 ulps of a tensor's scale; Adam's m/√v̂ divides two such values (relative errors add,
# ×1.5 with the square root): ≤ 7.5, taken as 9 ulps per step, accumulating linearly. (Observed
# over every config after 7 steps: ≤ 1.5 ulps; a wrong default or rule is off by far more.)
def _rtol(dtype, steps=7):
    return 9 * steps * torch.finfo(dtype).eps


# ---- every optim_inputs_func config: ours vs torch.optim --------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name, cid, kwargs", INPUTS, ids=INPUT_IDS)
def test_every_torch_config_matches_torch(name, cid, kwargs, dtype, fused):
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    theirs, ours = _lockstep([lambda ps: torch_cls(ps, **_fresh(kwargs), foreach=False),
                              lambda ps: ours_cls(ps, **_fresh(kwargs), fused=fused)], dtype, _rtol(dtype))
    assert ours.implementation == ("fused" if fused else "reference")


@pytest.mark.parametrize("name, cid, kwargs", INPUTS, ids=INPUT_IDS)
def test_fused_matches_forloop_and_torch_foreach(name, cid, kwargs):
    """torch's fused-vs-forloop parity: ours fused, ours reference and torch's foreach
    implementation agree in float64 (the same derivation as _rtol)."""
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    fused, reference, _ = _lockstep([lambda ps: ours_cls(ps, **_fresh(kwargs), fused=True),
                                     lambda ps: ours_cls(ps, **_fresh(kwargs), fused=False),
                                     lambda ps: torch_cls(ps, **_fresh(kwargs), foreach=True)],
                                    torch.float64, _rtol(torch.float64))
    assert (fused.implementation, reference.implementation) == ("fused", "reference")
    assert all(st["step"].dtype == torch.float32 for st in fused.state.values() if "step" in st)


# ---- every optim_error_inputs_func case -------------------------------------------------------------------------
def _error_cases(device):
    cases = []
    for name in NAMES:
        for err in OUR_INFOS[name].optim_error_inputs_func(device=device, dtype=torch.float32):
            cases.append((name, err))
    return cases


def _check_error(name, err):
    """torch's test_errors with our class: same error (or warning) type, message matching torch's regex."""
    cls = OUR_INFOS[name].optim_cls
    inp = err.optimizer_error_input
    expect = pytest.warns if issubclass(err.error_type, Warning) else pytest.raises
    if err.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with expect(err.error_type, match=err.error_regex):
            cls(inp.params, **inp.kwargs)
    else:
        opt = cls(inp.params, **inp.kwargs)
        with expect(err.error_type, match=err.error_regex):
            opt.step()


CPU_ERRORS = _error_cases("cpu")


@pytest.mark.parametrize("name, err", CPU_ERRORS,
                         ids=[f"{n}-{e.optimizer_error_input.desc[:60]}" for n, e in CPU_ERRORS])
def test_torch_error_inputs_raise_torchs_errors(name, err):
    _check_error(name, err)


@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
def test_torch_cuda_error_inputs_raise_torchs_errors(name):
    for _, err in [c for c in _error_cases("cuda") if c[0] == name]:
        _check_error(name, err)


@pytest.mark.parametrize("name", NAMES)
def test_torch_cuda_only_flag_conflicts_raise_torchs_errors_on_cpu_too(name):
    """The two flag conflicts torch lists for CUDA only, checked on the CPU (same regexes)."""
    cls, p = OUR_INFOS[name].optim_cls, [Parameter(torch.zeros(()))]
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        cls(p, foreach=True, fused=True)
    with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
        cls(p, fused=True, differentiable=True)
    with pytest.raises(ValueError, match=f"Invalid differentiable value: True.*torch.optim.{name}"):
        cls(p, differentiable=True)


def test_a_tensor_weight_decay_is_refused_clearly():
    """torch 2.13's SGD also takes a Tensor weight_decay; ours says to pass a number."""
    with pytest.raises(ValueError, match=r"Invalid weight_decay value: tensor\(0\.1000\).*float\(weight_decay\)"):
        fused_optim.SGD([Parameter(torch.zeros(2))], weight_decay=torch.tensor(0.1))


# ---- signatures and defaults ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_signature_defaults_and_group_keys_are_torchs(name):
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    spell = lambda cls: [(p.name, p.default, p.kind) for p in inspect.signature(cls).parameters.values()]  # noqa: E731
    # torch's parameters in torch's order, then our extensions: keyword-only, off by default, so
    # every call written for torch means the same here.
    extensions = [("master_weights", False), ("state_dtype", None), ("state_rounding", "nearest"),
                  ("stochastic_rounding", False)]
    assert spell(ours_cls) == spell(torch_cls) + [(k, v, inspect.Parameter.KEYWORD_ONLY) for k, v in extensions]
    ours, theirs = ours_cls([Parameter(torch.zeros(2))]), torch_cls([Parameter(torch.zeros(2))])
    assert ours.state_dict() == theirs.state_dict()
    assert ours.defaults == theirs.defaults
    assert repr(ours) == repr(theirs)


# ---- torch's direction test: the closure's loss goes the right way -------------------------------------------
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("name, cid, kwargs", INPUTS, ids=INPUT_IDS)
def test_goes_right_direction_and_step_returns_the_closures_loss(name, cid, kwargs, contiguous):
    """20 steps with a closure (fused=None: the kernels, or for strided params the reference
    implementation with a warning) lower the loss, or raise it under maximize."""
    if contiguous:
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
    else:
        weight, bias = Parameter(torch.randn(10, 5, 2)[..., 0]), Parameter(torch.randn(10, 2)[..., 0])
    x = torch.randn(5)
    opt = OUR_INFOS[name].optim_cls([weight, bias], **_fresh(kwargs))

    losses = []

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        losses.append(loss)
        return loss

    initial = closure().item()
    with pytest.warns(UserWarning, match="not contiguous") if not contiguous else _no_warning():
        for _ in range(20):
            assert opt.step(closure) is losses[-1]
    assert opt.implementation == ("fused" if contiguous else "reference")
    final = closure().item()
    assert final > initial if kwargs.get("maximize") else final < initial


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---- documented limitations, from the entries' own flags ---------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_complex_params_are_refused_clearly(name):
    assert TORCH_INFOS[name].supports_complex and not OUR_INFOS[name].supports_complex
    with pytest.raises(ValueError, match="does not support complex parameters.*view_as_real"):
        OUR_INFOS[name].optim_cls([torch.randn(3, dtype=torch.complex64, requires_grad=True)])


@pytest.mark.parametrize("name", NAMES)
def test_sparse_grads_are_refused_clearly(name):
    assert not OUR_INFOS[name].supports_sparse
    p = Parameter(torch.zeros(4))
    opt = OUR_INFOS[name].optim_cls([p], **TORCH_INFOS[name].metadata_for_sparse[0])
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()
    assert torch.equal(p, torch.zeros(4))


# ---- state dicts ------------------------------------------------------------------------------------------------
def _weights_only(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name, cid, kwargs", INPUTS, ids=INPUT_IDS)
def test_state_dict_round_trip_ours_torch_ours(name, cid, kwargs):
    """Ours runs 3 steps; its state dict (through a weights_only checkpoint) continues in
    torch.optim for 2 steps, whose state dict continues in a new one of ours; all along an
    uninterrupted run of ours must agree. Group keys survive both ways."""
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    model_a, pa = _model(torch.float64)
    model_b, pb = _model(torch.float64)
    x = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.float64)
    steady = ours_cls(pa, **_fresh(kwargs), fused=True)
    relay = ours_cls(pb, **_fresh(kwargs), fused=True)

    def step(model, params, opt):
        opt.zero_grad()
        (model(x).sum() + params[-1] ** 2).backward()
        opt.step()

    for n in range(7):
        if n in (3, 5):  # hand over: ours -> torch at step 3, torch -> ours at step 5
            sd = _weights_only(relay.state_dict())
            relay = (torch_cls if n == 3 else ours_cls)(pb, **_fresh(kwargs))
            relay.load_state_dict(sd)
            assert relay.state_dict()["param_groups"] == sd["param_groups"]  # no key gained or lost
        step(model_a, pa, steady)
        step(model_b, pb, relay)
        _assert_same_state(relay, pb, steady, pa, _rtol(torch.float64), f"step {n}")
    assert type(relay) is ours_cls and relay.implementation == "fused"


@pytest.mark.parametrize("name", NAMES)
def test_a_torch_checkpoints_flags_are_kept_and_do_not_switch_the_implementation(name):
    """A torch.optim checkpoint's fused/foreach group values load as they are (saving gives them
    back unchanged); which implementation runs is the constructor's ``fused``."""
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    p, q = Parameter(torch.ones(3)), Parameter(torch.ones(3))
    theirs = torch_cls([q], foreach=True)
    q.grad = torch.ones(3)
    theirs.step()
    ours = ours_cls([p], fused=False)
    ours.load_state_dict(_weights_only(theirs.state_dict()))
    assert ours.param_groups[0]["foreach"] is True and ours.param_groups[0]["fused"] is None
    p.grad = torch.ones(3)
    ours.step()
    assert ours.implementation == "reference" and ours.fused is False
    assert ours.state_dict()["param_groups"] == theirs.state_dict()["param_groups"]


@pytest.mark.parametrize("name", NAMES)
def test_older_state_dicts_without_the_newer_flags_load(name):
    """torch's BC check: a checkpoint whose groups lack the flags added after the optimizer was
    first released (the entry's ``not_og_supported_flags``) loads, regains them, and steps."""
    kwargs = {"momentum": 0.9} if name == "SGD" else {"amsgrad": True}
    p = Parameter(torch.ones(3))
    opt = OUR_INFOS[name].optim_cls([p], **kwargs)
    p.grad = torch.ones(3)
    opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        for flag in OUR_INFOS[name].not_og_supported_flags:
            group.pop(flag, None)
    fresh = OUR_INFOS[name].optim_cls([p], **kwargs)
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    fresh.step()


@pytest.mark.parametrize("name", ("Adam", "AdamW"))
def test_a_plain_number_step_loads_like_torch(name):
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    p, q = Parameter(torch.ones(3)), Parameter(torch.ones(3))
    ours, theirs = ours_cls([p], fused=True), torch_cls([q])
    for opt, param in ((ours, p), (theirs, q)):
        param.grad = torch.ones(3)
        opt.step()
        sd = opt.state_dict()
        sd["state"][0]["step"] = sd["state"][0]["step"].item()
        opt.load_state_dict(sd)
        opt.step()
    assert_pairs_close(["param"], [p.detach()], [q.detach()], _rtol(torch.float32))


# ---- hooks --------------------------------------------------------------------------------------------------------
def _stepped(name, **kwargs):
    p = Parameter(torch.ones(3))
    opt = OUR_INFOS[name].optim_cls([p], **kwargs)
    p.grad = torch.ones(3)
    return p, opt


@pytest.mark.parametrize("name", NAMES)
def test_step_pre_and_post_hooks(name):
    p, opt = _stepped(name)
    calls = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", p.detach().clone())))
    post = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", p.detach().clone())))
    opt.step()
    assert [c for c, _ in calls] == ["pre", "post"]
    assert torch.equal(calls[0][1], torch.ones(3)) and not torch.equal(calls[1][1], torch.ones(3))
    pre.remove()
    post.remove()
    opt.step()
    assert len(calls) == 2


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_hooks(name):
    _, opt = _stepped(name, momentum=0.9) if name == "SGD" else _stepped(name)
    opt.step()
    opt.register_state_dict_pre_hook(lambda o: o.param_groups[0].__setitem__("lr", 0.5))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    sd = opt.state_dict()
    assert sd["extra"] == 1 and sd["param_groups"][0]["lr"] == 0.5


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_pre_and_post_hooks(name):
    _, opt = _stepped(name)
    opt.step()
    sd = opt.state_dict()
    calls = []

    def pre(o, state_dict):
        calls.append("pre")
        state_dict = copy.deepcopy(state_dict)
        state_dict["param_groups"][0]["lr"] = 0.25
        return state_dict

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_pre_hook(lambda o, s: calls.append("first"), prepend=True)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("post", o.param_groups[0]["lr"])))
    opt.load_state_dict(sd)
    assert calls == ["first", "pre", ("post", 0.25)]
    assert opt.param_groups[0]["lr"] == 0.25 and sd["param_groups"][0]["lr"] != 0.25


# ---- copies -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("name, cid, kwargs", SMALL, ids=[x[1] for x in SMALL])
def test_copies_continue_like_the_original(name, cid, kwargs, clone):
    p, opt = _stepped(name, **_fresh(kwargs))
    opt.step()
    dup = clone(opt)
    assert {k for k in vars(dup) if not k.startswith("_")} == {k for k in vars(opt) if not k.startswith("_")}
    assert dup.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    (q,) = dup.param_groups[0]["params"]
    assert q is not p and torch.equal(q, p)
    for n in range(2):
        p.grad, q.grad = torch.full((3,), float(n + 2)), torch.full((3,), float(n + 2))
        opt.step()
        dup.step()
    assert torch.equal(q, p)
    assert all(torch.equal(dup.state[q][k], opt.state[p][k]) for k in opt.state[p])


# ---- steps without grads, groups added later, zero_grad ------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("name, cid, kwargs", INPUTS, ids=INPUT_IDS)
def test_a_step_without_grads_changes_nothing(name, cid, kwargs, fused):
    params = [Parameter(torch.randn(4)), Parameter(torch.randn(2, 3))]
    before = [p.detach().clone() for p in params]
    opt = OUR_INFOS[name].optim_cls(params, **_fresh(kwargs), fused=fused)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert len(opt.state) == 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("name, cid, kwargs", INPUTS, ids=INPUT_IDS)
def test_steps_never_write_into_the_grads(name, cid, kwargs, fused):
    """maximize negates g and weight decay adds λ·p to it: on copies, never in the user's grad
    (its version counter would move)."""
    params = [Parameter(torch.randn(4)), Parameter(torch.randn(2, 3))]
    opt = OUR_INFOS[name].optim_cls(params, **_fresh(kwargs), fused=fused)
    for p in params:
        p.grad = torch.randn(p.shape)
    grads = [(p.grad, p.grad.clone(), p.grad._version) for p in params]
    for _ in range(3):
        opt.step()
    assert all(p.grad is g and g._version == v and torch.equal(g, copy_) for p, (g, copy_, v) in zip(params, grads))


@pytest.mark.parametrize("name", NAMES)
def test_state_dicts_of_named_params_load_into_unnamed_and_torchs_and_back(name):
    """torch.optim takes ``model.named_parameters()`` and keeps each group's ``param_names`` in
    its state dict; ours too, and state dicts move between named and unnamed optimizers, ours and
    torch's, both ways, continuing the same."""
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    start = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3)

    def steps(opt, n):
        for _ in range(n):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    named = ours_cls(model.named_parameters(), lr=0.01, weight_decay=0.1)
    steps(named, 2)
    sd = named.state_dict()
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    # named ours -> unnamed torch -> named ours (the names come back from the first state dict)
    unnamed_torch = torch_cls(model.parameters(), lr=0.01, weight_decay=0.1)
    unnamed_torch.load_state_dict(_weights_only(sd))
    steps(unnamed_torch, 1)
    again = ours_cls(model.named_parameters(), lr=0.01, weight_decay=0.1)
    again.load_state_dict(_weights_only(unnamed_torch.state_dict()))
    assert again.state_dict()["param_groups"][0]["param_names"] == sd["param_groups"][0]["param_names"]
    steps(again, 1)
    after_relay = copy.deepcopy(model.state_dict())

    model.load_state_dict(start)
    straight = ours_cls(model.named_parameters(), lr=0.01, weight_decay=0.1)
    steps(straight, 4)
    rtol = _rtol(torch.float32, steps=4)
    assert_pairs_close(list(after_relay), [after_relay[k] for k in after_relay],
                       [model.state_dict()[k] for k in after_relay], rtol)


@pytest.mark.parametrize("name, cid, kwargs", SMALL, ids=[x[1] for x in SMALL])
def test_a_param_group_added_later_matches_torch(name, cid, kwargs):
    ours_cls, torch_cls = OUR_INFOS[name].optim_cls, TORCH_INFOS[name].optim_cls
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(5, generator=gen), torch.randn(7, generator=gen)]
    pa, pb = [Parameter(t.clone()) for t in base], [Parameter(t.clone()) for t in base]
    ours, theirs = ours_cls([pa[0]], **_fresh(kwargs), fused=True), torch_cls([pb[0]], **_fresh(kwargs))
    for n in range(5):
        if n == 2:
            ours.add_param_group({"params": [pa[1]], "lr": 0.05})
            theirs.add_param_group({"params": [pb[1]], "lr": 0.05})
        for a, b in zip(pa, pb):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
        _assert_same_state(ours, pa, theirs, pb, _rtol(torch.float32), f"step {n}")
    assert ours.param_groups[1].keys() == theirs.param_groups[1].keys()


SCHEDULES = [(name, i) for name in NAMES for i in range(len(TORCH_INFOS[name].scheduler_inputs))]


@pytest.mark.parametrize("name, i", SCHEDULES, ids=[f"{n}-schedule{i}" for n, i in SCHEDULES])
def test_lr_schedulers_and_per_group_lr_match_torch(name, i):
    """Each of the entry's scheduler_inputs drives ours and torch's (two groups, the second with
    its own lr) over 12 closure steps; ReduceLROnPlateau is fed the loss, as torch's test does."""
    steps, x = 12, torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    runs = []
    for cls in (TORCH_INFOS[name].optim_cls, OUR_INFOS[name].optim_cls):
        gen = torch.Generator().manual_seed(1)
        weight = Parameter(torch.randn(10, 5, dtype=torch.float64, generator=gen))
        bias = Parameter(torch.randn(10, dtype=torch.float64, generator=gen))
        opt = cls([{"params": [weight]}, {"params": [bias], "lr": 1e-2}], lr=1e-3)
        schedulers = [make(opt) for make in TORCH_INFOS[name].scheduler_inputs[i]]
        runs.append((opt, schedulers, [weight, bias]))
    for step in range(steps):
        for opt, schedulers, (weight, bias) in runs:
            def closure():
                opt.zero_grad()
                loss = (weight.mv(x) + bias).pow(2).sum()
                loss.backward()
                return loss

            loss = opt.step(closure)
            for sched in schedulers:
                if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    sched.step(loss.item())
                else:
                    sched.step()
        (theirs, _, tp), (ours, _, op) = runs
        assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups]
        _assert_same_state(ours, op, theirs, tp, _rtol(torch.float64, steps), f"step {step}")


@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr_matches_a_float_lr_and_follows_in_place_changes(name):
    """torch's Tensor-lr test: a Tensor lr (changed in place, as a scheduler with a Tensor lr does)
    gives what the float lr gives."""
    ours_cls = OUR_INFOS[name].optim_cls
    pa, pb = Parameter(torch.ones(6)), Parameter(torch.ones(6))
    lr = torch.tensor(0.01)
    with_tensor, with_float = ours_cls([pa], lr=lr, fused=True), ours_cls([pb], lr=0.01, fused=True)
    for n in range(4):
        if n == 2:
            lr.mul_(0.5)
            with_float.param_groups[0]["lr"] = 0.005
        pa.grad = pb.grad = torch.linspace(-1, 1, 6) * (n + 1)
        with_tensor.step()
        with_float.step()
        assert torch.equal(pa, pb)
    assert with_tensor.param_groups[0]["lr"] is lr


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad_sets_grads_to_none_so_frozen_params_stay_put(name):
    """torch's default: zero_grad() leaves grads None, so a param without a grad this step is
    not moved by momentum or weight decay (with zero grads it would be)."""
    kwargs = dict(momentum=0.9, weight_decay=0.1) if name == "SGD" else dict(weight_decay=0.1)
    a, b = Parameter(torch.ones(3)), Parameter(torch.ones(3))
    opt = OUR_INFOS[name].optim_cls([a, b], **kwargs)
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    frozen = b.detach().clone()
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b, frozen)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(a.grad, torch.zeros(3))


def test_sgd_without_momentum_keeps_no_state_like_torch():
    p, q = Parameter(torch.ones(3)), Parameter(torch.ones(3))
    ours, theirs = fused_optim.SGD([p], lr=0.1, fused=True), torch.optim.SGD([q], lr=0.1)
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    ours.step()
    theirs.step()
    assert len(ours.state) == len(theirs.state) == 0
    assert ours.state_dict()["state"] == theirs.state_dict()["state"] == {}


@pytest.mark.parametrize("name", ("Adam", "AdamW"))
def test_capturable_is_accepted_and_changes_nothing_on_the_cpu(name):
    """capturable=True (which also lifts torch's Tensor-lr-under-foreach refusal) steps exactly like
    the default: the fused step needs no host value in either case."""
    runs = []
    for kwargs in (dict(), dict(capturable=True, foreach=True)):
        p = Parameter(torch.ones(4))
        opt = OUR_INFOS[name].optim_cls([p], lr=torch.tensor(0.01), **kwargs)
        for n in range(3):
            p.grad = torch.linspace(-1, 1, 4) * (n + 1)
            opt.step()
        runs.append(p.detach())
        assert opt.param_groups[0]["capturable"] is kwargs.get("capturable", False)
        assert opt.implementation == "fused"
    assert torch.equal(*runs)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("name", ("Adam", "AdamW"))
def test_tensor_betas_match_torch(name, fused):
    """torch.optim.Adam's Tensor betas (any shape of one element) work as their values."""
    # float64 Tensors: torch does its beta arithmetic (1 − β, β^t) in the Tensors' dtype, ours in
    # Python floats of their values; float32 betas would differ by their own rounding (~1e-8).
    f64 = torch.float64
    betas = lambda: (torch.tensor([[[0.9]]], dtype=f64), torch.tensor([[0.99]], dtype=f64))  # noqa: E731
    theirs, ours = _lockstep([lambda ps: TORCH_INFOS[name].optim_cls(ps, betas=betas(), foreach=False),
                              lambda ps: OUR_INFOS[name].optim_cls(ps, betas=betas(), fused=fused)],
                             torch.float64, _rtol(torch.float64))
    assert [b.shape for b in ours.param_groups[0]["betas"]] == [b.shape for b in theirs.param_groups[0]["betas"]]


# ---- names in LightningCLI (jsonargparse resolves --optimizer among all Optimizer subclasses) ---------------------
def _cli_optimizer(value: str) -> str:
    jsonargparse = pytest.importorskip("jsonargparse",
                                       reason="LightningCLI's parser: pip install 'fused-optim[lightning]'")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(torch.optim.Optimizer, "optimizer", skip={"params"}, instantiate=False)
    return parser.parse_args([f"--optimizer={value}"]).optimizer.class_path


@pytest.mark.parametrize("name", NAMES)
def test_lightning_cli_class_paths_pick_torchs_or_ours(name):
    assert _cli_optimizer(f"torch.optim.{name}") == f"torch.optim.{name}"
    assert _cli_optimizer(f"fused_optim.{name}") == f"fused_optim.{name}"


@pytest.mark.parametrize("name", NAMES)
def test_lightning_cli_short_name_is_refused_naming_both_class_paths(name):
    """Two Optimizer subclasses share the short name once fused_optim is imported: jsonargparse
    refuses it and names both full paths (the README says to give one)."""
    with pytest.raises(Exception, match=f"Multiple subclasses with name {name}.*torch.optim.{name}.*fused_optim.{name}"):
        _cli_optimizer(name)
