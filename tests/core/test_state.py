"""State dicts: interchange with torch.optim both ways, exact save/reload, weights_only loading."""

import copy
import io
import pickle

import pytest
import torch

from cases import STATEFUL_AND_LAYERWISE, STATEFUL_CASES, ids
from utils import assert_state_close, clone_groups, make_groups, params_of, set_grads, twin_groups


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def run_and_handover(case, first, second, steps=8):
    """`first` optimizer runs `steps` steps, hands its state (via a weights_only checkpoint) to
    `second`, which continues next to an uninterrupted `first` for `steps` more."""
    ga, gb = twin_groups(case)
    a = first(case, ga)
    for step in range(steps):
        set_grads(ga, gb, step)
        a.step()
    with torch.no_grad():
        for p, q in zip(params_of(a), [p for g in gb for p in g["params"]]):
            q.copy_(p)
    b = second(case, gb)
    b.load_state_dict(roundtrip(a.state_dict()))
    for step in range(steps, 2 * steps):
        set_grads(ga, gb, step)
        a.step()
        b.step()
        assert_state_close(b, a, 1e-6, f"{case.id} step {step}")
    return a, b


ours = lambda case, groups: case.make_ours(groups, fused=True)  # noqa: E731
theirs = lambda case, groups: case.make_torch(groups)  # noqa: E731


@pytest.mark.parametrize("case", STATEFUL_CASES, ids=ids(STATEFUL_CASES))
def test_our_state_dict_continues_in_torch(case):
    run_and_handover(case, ours, theirs)


@pytest.mark.parametrize("case", STATEFUL_CASES, ids=ids(STATEFUL_CASES))
def test_torch_state_dict_continues_in_ours(case):
    _, b = run_and_handover(case, theirs, ours)
    assert b.implementation == "fused"


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("case", STATEFUL_AND_LAYERWISE, ids=ids(STATEFUL_AND_LAYERWISE))
def test_save_and_reload_mid_run_continues_identically(case, fused):
    ga, gb = twin_groups(case)
    a = case.make_ours(ga, fused=fused)
    for step in range(6):
        set_grads(ga, gb, step)
        a.step()
    ckpt = roundtrip({"params": [p.detach().clone() for p in params_of(a)], "optim": a.state_dict()})
    with torch.no_grad():
        for q, saved in zip([p for g in gb for p in g["params"]], ckpt["params"]):
            q.copy_(saved)
    b = case.make_ours(gb, fused=fused)
    b.load_state_dict(ckpt["optim"])
    assert b.state_dict()["param_groups"] == a.state_dict()["param_groups"]  # no key gained or lost
    for step in range(6, 14):
        set_grads(ga, gb, step)
        a.step()
        b.step()
        assert_state_close(b, a, 0.0, f"step {step}")  # bit-identical


def test_state_dict_holds_only_tensors_and_python_scalars():
    case = STATEFUL_CASES[-1]
    groups = clone_groups(make_groups(), 0.1)
    opt = case.make_ours(groups, fused=True)
    set_grads(groups, clone_groups(make_groups()), 0)
    opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].item() == 1.0
    assert sd["param_groups"][0]["decoupled_weight_decay"] is True
    assert roundtrip(sd)["state"][0]["step"].item() == 1.0
    assert all(type(st) is dict for st in sd["state"].values())  # no class of ours in a checkpoint


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
def test_copies_keep_the_fused_flag_and_state(clone):
    case = STATEFUL_CASES[0]
    groups = clone_groups(make_groups(), 0.1)
    opt = case.make_ours(groups, fused=False, set_grad_none=True)
    set_grads(groups, clone_groups(make_groups()), 0)
    opt.step()
    dup = clone(opt)
    assert dup.fused is False and dup.set_grad_none is True
    assert len(dup.state) == len(opt.state)


@pytest.mark.parametrize("case", STATEFUL_CASES, ids=ids(STATEFUL_CASES))
def test_replacing_a_params_state_dict_is_noticed(case):
    """Lightning's optimizer_to_device assigns new state dicts (new tensors off-CPU); the cached
    lists must follow, or the kernel would keep updating the old tensors."""
    ga, gb = twin_groups(case)
    a, b = case.make_ours(ga, fused=True), case.make_torch(gb)
    for step in range(6):
        set_grads(ga, gb, step)
        a.step()
        b.step()
        if step == 2:
            for p in list(a.state):
                a.state[p] = {k: v.clone() for k, v in a.state[p].items()}
        assert_state_close(a, b, 1e-6, f"{case.id} step {step}")


@pytest.mark.parametrize("copy_first", [False, True], ids=["original", "deepcopy"])
@pytest.mark.parametrize("case", STATEFUL_CASES, ids=ids(STATEFUL_CASES))
def test_replacing_a_state_tensor_is_noticed(case, copy_first):
    """A state tensor assigned anew (``opt.state[p]["exp_avg"] = t``, as torch.optim allows: it
    reads the state every step) is the one the next steps update, in a copy of the optimizer too;
    the replaced tensor is left alone."""
    ga, gb = twin_groups(case)
    a, b = case.make_ours(ga, fused=True), case.make_torch(gb)
    replaced = []
    for step in range(6):
        set_grads(ga, gb, step)
        a.step()
        b.step()
        if step == 1 and copy_first:
            a = copy.deepcopy(a)
            ga = a.param_groups
        if step == 2:
            for p in list(a.state):
                for key, value in list(a.state[p].items()):
                    if isinstance(value, torch.Tensor) and key != "step":
                        replaced.append((value, value.clone()))
                        a.state[p][key] = value.clone()
        assert_state_close(a, b, 1e-6, f"{case.id} step {step}")
    assert replaced and all(torch.equal(old, snapshot) for old, snapshot in replaced)
