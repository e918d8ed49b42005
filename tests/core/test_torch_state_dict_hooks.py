"""State-dict hooks as torch's own optimizer tests use them (``TestOptimRenewed`` in torch's
test/optim: test_state_dict_pre_hook, test_state_dict_pre_post_hook, test_load_state_dict_post_hook,
test_load_state_dict_pre_post_hook), written here in our own words, on fused_optim.SGD / Adam / AdamW.

Those hooks keep their notes in ``optimizer.state`` itself, under keys that are no param and with
values that are no dict (``state["test"] = 1``, ``state["ran_post_hook"] = True``): torch's
``optimizer.state`` is a ``defaultdict(dict)`` that takes anything, and ``state_dict()`` /
``load_state_dict()`` carry such entries through as they are. Each case runs for every kwargs set
torch tests the class with (``optim_inputs_func`` of torch's ``optim_db``), fresh as torch's tests
do and after a step (param state next to the notes).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal imports expecttest: pip install 'fused-optim[test]'")
from torch.testing._internal.common_optimizers import optim_db  # noqa: E402

import fused_optim  # noqa: E402

NAMES = ("SGD", "Adam", "AdamW")
CONFIGS = [(info.name, f"{info.name}-{inp.desc.replace(' ', '_')}", inp.kwargs)
           for info in optim_db if info.name in NAMES
           for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32)]


def _optimizer(name, kwargs, stepped):
    """Ours on one (2, 3) param, as torch's hook tests make it; with ``stepped``, after one step."""
    torch.manual_seed(0)
    param = torch.rand(2, 3, requires_grad=True)
    opt = getattr(fused_optim, name)([param], **copy.deepcopy(kwargs))
    if stepped:
        param.grad = torch.rand(2, 3)
        opt.step()
    return param, opt


def _note_in_state(opt):
    """torch's state-dict pre-hook: a note under a key that is no param, with a value that is no dict."""
    opt.state["test"] = 1


def _take_note_out(opt, state_dict):
    """torch's state-dict post-hook: removes the pre-hook's note and says whether it found it."""
    state_dict["ran_state_dict_pre_hook"] = state_dict["state"].pop("test", None) == 1
    return state_dict


def _changed_lr(opt, state_dict):
    """torch's second load pre-hook: returns a changed deep copy, which is what gets loaded."""
    mine = copy.deepcopy(state_dict)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _notes_after_load(opt):
    """torch's load post-hook: notes (booleans) in ``optimizer.state`` about what was loaded."""
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


parametrize_configs = pytest.mark.parametrize("name, cid, kwargs", CONFIGS, ids=[c for _, c, _ in CONFIGS])
parametrize_stepped = pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])


@parametrize_stepped
@parametrize_configs
def test_state_dict_pre_hook_note_reaches_the_state_dict(name, cid, kwargs, stepped):
    _, opt = _optimizer(name, kwargs, stepped)
    opt.register_state_dict_pre_hook(_note_in_state)
    state_dict = opt.state_dict()
    assert state_dict["state"]["test"] == 1
    assert opt.state["test"] == 1
    param_states = [v for k, v in state_dict["state"].items() if k != "test"]
    assert len(param_states) == len(opt.state) - 1
    assert len(param_states) == (1 if stepped and name != "SGD" else len(param_states))  # Adam's made state
    assert all(type(st) is dict for st in param_states)  # a weights_only checkpoint holds no class of ours


@parametrize_stepped
@parametrize_configs
def test_state_dict_post_hook_sees_the_pre_hooks_note(name, cid, kwargs, stepped):
    _, opt = _optimizer(name, kwargs, stepped)
    opt.register_state_dict_pre_hook(_note_in_state)
    opt.register_state_dict_post_hook(_take_note_out)
    state_dict = opt.state_dict()
    assert "test" not in state_dict["state"]
    assert state_dict["ran_state_dict_pre_hook"] is True


@parametrize_stepped
@parametrize_configs
def test_load_state_dict_post_hook_notes_stay_in_the_state(name, cid, kwargs, stepped):
    _, opt = _optimizer(name, kwargs, stepped)
    opt.register_load_state_dict_post_hook(_notes_after_load)
    opt.load_state_dict(opt.state_dict())
    assert not opt.state["ran_load_state_dict_pre_hook2"]  # (a tensor for a Tensor lr)
    assert opt.state["ran_load_state_dict_post_hook"] is True


@parametrize_stepped
@parametrize_configs
def test_load_state_dict_pre_hooks_result_is_loaded(name, cid, kwargs, stepped):
    _, opt = _optimizer(name, kwargs, stepped)
    opt.register_load_state_dict_pre_hook(_changed_lr)
    opt.register_load_state_dict_post_hook(_notes_after_load)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"]
    assert opt.state["ran_load_state_dict_post_hook"] is True


@pytest.mark.parametrize("name", NAMES)
def test_notes_round_trip_and_steps_continue_as_without_them(name):
    """Notes of any kind under keys that are no param go through state_dict() and load_state_dict()
    as they are, next to the param state; an optimizer that loaded them steps bit for bit like one
    that never had them."""
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    p, opt = _optimizer(name, kwargs, stepped=True)
    q, plain = _optimizer(name, kwargs, stepped=True)
    notes = {"test": 1, "flag": True, "label": "x", "numbers": [1, 2], "table": {"a": 1}}
    for key, value in notes.items():
        opt.state[key] = value
    state_dict = copy.deepcopy(opt.state_dict())  # (a state dict shares the optimizer's tensors)
    assert {k: state_dict["state"][k] for k in notes} == notes

    r = p.detach().clone().requires_grad_()
    loaded = getattr(fused_optim, name)([r], **kwargs)
    loaded.load_state_dict(state_dict)
    assert {k: loaded.state[k] for k in notes} == notes
    for step in range(3):
        for param in (p, q, r):
            param.grad = torch.full((2, 3), 0.5 + step)
        for o in (opt, plain, loaded):
            o.step()
        assert torch.equal(p, q) and torch.equal(r, q), f"step {step}"


@pytest.mark.parametrize("name", ("SGD", "Adam"))
def test_a_replaced_state_tensor_is_noticed_next_to_notes(name):
    """With notes in ``optimizer.state``, a state tensor assigned anew is still the one the next
    step updates (the cached lists are rebuilt), and the replaced tensor is left alone."""
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    key = "momentum_buffer" if name == "SGD" else "exp_avg"
    p, opt = _optimizer(name, kwargs, stepped=True)
    opt.state["test"] = 1
    old = opt.state[p][key]
    before = old.clone()
    new = old.clone()
    opt.state[p][key] = new
    p.grad = torch.ones(2, 3)
    opt.step()
    assert torch.equal(old, before)
    assert not torch.equal(new, before)
    assert opt.state[p][key] is new
