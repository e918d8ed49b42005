"""Damaged state dicts: refused at ``load_state_dict``, naming the param and the key, and the
optimizer is left exactly as it was before the load."""

import copy

import pytest
import torch

import fused_optim
from fused_optim import state_formats as sf


def _trained(cls, **kwargs):
    """An optimizer of two groups (two params each) after two steps, and its params."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 7, 600, 3)]
    opt = cls([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, **kwargs)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt, params


def _snapshot(opt) -> dict:
    return copy.deepcopy(opt.state_dict())


def _assert_same(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        assert st.keys() == b["state"][pid].keys()
        for key, value in st.items():
            other = b["state"][pid][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (pid, key)


def _refused(opt, state_dict, match):
    """load_state_dict raises ValueError matching ``match``, and ``opt`` is unchanged."""
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state_dict)
    _assert_same(before, _snapshot(opt))


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), -float("inf")], ids=["nan", "neg", "inf", "-inf"])
@pytest.mark.parametrize("cls,kwargs", [(fused_optim.AdamW, {}), (fused_optim.AdamW, dict(state_dtype="8bit")),
                                        (fused_optim.FusedLAMB, {})], ids=["adamw", "adamw-8bit", "lamb"])
def test_a_damaged_step_is_refused_naming_the_param(cls, kwargs, bad):
    """A step count that is NaN, negative or infinite (which the update would turn into
    non-finite params, and which torch.optim refuses when negative) is refused at load, for a
    tensor counter or a plain number; the message names group, position and key and the fix."""
    opt, _ = _trained(cls, **kwargs)
    for as_tensor in (True, False):
        damaged = opt.state_dict()
        damaged["state"][3]["step"] = torch.tensor(bad) if as_tensor else bad  # param 1 of group 1
        _refused(opt, damaged, r"param 1 of group 1 has 'step' = .*finite number >= 0.*load an intact checkpoint")


def test_an_intact_step_count_loads_as_a_tensor_or_a_number():
    opt, params = _trained(fused_optim.AdamW)
    saved = opt.state_dict()
    saved["state"][0]["step"] = 2  # a plain number (torch < 1.12): taken as the counter
    fresh = fused_optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    fresh.load_state_dict(saved)
    assert float(fresh.state[params[0]]["step"]) == 2.0


@pytest.mark.parametrize("length", [0, 2, 4, None], ids=["empty", "short", "long", "missing"])
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_an_8bit_absmax_of_the_wrong_length_is_refused(key, length):
    """8-bit codes of n elements need ceil(n / 256) absmaxes: a shorter one would fail in the
    reference path, a longer one was silently accepted (the codes scaled by the wrong blocks)."""
    opt, _ = _trained(fused_optim.AdamW, state_dtype="8bit")
    damaged = opt.state_dict()
    name = sf.absmax_key(key)
    assert damaged["state"][2][key].dtype == torch.uint8 and damaged["state"][2][name].numel() == 3  # 600 codes
    if length is None:
        del damaged["state"][2][name]
    else:
        damaged["state"][2][name] = torch.ones(length)
    _refused(opt, damaged, rf"param 0 of group 1 has 8-bit '{key}' of 600 codes but '{name}' has .*it needs 3 ")
