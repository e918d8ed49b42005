"""A plain group (no ``state_dtype``, ``state_rounding`` or ``stochastic_rounding``) steps without
the compact-state machinery: no format conversion, no compact lists, no compact op or reference;
only a moment loaded in another format sends its param there, to be decoded."""

import pytest
import torch

import fused_optim
from fused_optim import param_state, state_formats
from fused_optim.spec import OpSpec

COMPACT_MACHINERY = [(state_formats, "convert_state"), (state_formats, "target_dtype"),
                     (state_formats, "initial_key"), (param_state, "to_group_format"),
                     (param_state, "compact_lists"), (OpSpec, "run_compact_reference")]


def _refuse_compact_machinery(monkeypatch):
    for owner, name in COMPACT_MACHINERY:
        def refused(*args, _name=name, **kwargs):
            raise AssertionError(f"a plain step called {_name}")
        monkeypatch.setattr(owner, name, refused)


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "reference"])
@pytest.mark.parametrize("cls, kwargs", [(fused_optim.AdamW, {}), (fused_optim.SGD, {"momentum": 0.9}),
                                         (fused_optim.FusedLAMB, {})], ids=["AdamW", "SGD", "FusedLAMB"])
def test_plain_steps_do_not_touch_compact_state(cls, kwargs, fused, monkeypatch):
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = cls(params, lr=0.1, fused=fused, **kwargs)
    _refuse_compact_machinery(monkeypatch)
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        opt.step()
    assert opt.implementation == ("reference" if fused is False else "fused")
    assert all(st["exp_avg" if "exp_avg" in st else "momentum_buffer"].dtype == torch.float32
               for st in opt.state.values())


def test_a_plain_group_decodes_moments_loaded_in_another_format():
    p, q = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(300))
    compact = fused_optim.AdamW([p], lr=0.1, state_dtype="8bit")
    p.grad = torch.randn(300)
    compact.step()
    plain = fused_optim.AdamW([q], lr=0.1)
    plain.load_state_dict(compact.state_dict())
    assert plain.state[q]["exp_avg"].dtype == torch.uint8  # kept as saved until the next step
    q.grad = torch.randn(300)
    plain.step()
    assert {k: v.dtype for k, v in plain.state[q].items()} == {
        "step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
