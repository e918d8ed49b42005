"""8-bit state in state dicts: never read as plain moments by another optimizer; ours load it
(also as older state dicts saved it) and convert it to plain state for the others."""

import io

import pytest
import torch

import fused_optim
from fused_optim import state_formats as sf

SHAPES = [(300,), (5, 7), (), (1, 1)]  # a vector, a matrix, a 0-dim and an all-ones shape


def _roundtrip(state_dict: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _stepped(cls, shape, n=2, **kwargs):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))
    opt = cls([p], lr=1e-2, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    return opt, p


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_8bit_codes_are_saved_with_a_trailing_dimension(shape):
    opt, p = _stepped(fused_optim.SGD, shape, momentum=0.9, state_dtype="8bit")
    saved = opt.state_dict()["state"][0]
    assert saved["momentum_buffer"].dtype == torch.uint8 and saved["momentum_buffer"].shape == (*shape, 1)
    assert opt.state[p]["momentum_buffer"].shape == shape  # the optimizer's own state keeps the param's shape


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ours,theirs", [
    ((fused_optim.AdamW, dict(weight_decay=0.0)), (torch.optim.AdamW, {})),
    ((fused_optim.AdamW, dict(weight_decay=0.0)), (torch.optim.Adam, {})),
    ((fused_optim.SGD, dict(momentum=0.9)), (torch.optim.SGD, dict(momentum=0.9))),
], ids=["adamw", "adam", "sgd"])
@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["loop", "foreach", "fused"])
def test_torch_optimizers_refuse_8bit_state_at_their_first_update(ours, theirs, impl, shape):
    """torch.optim casts the uint8 codes to the param's dtype and would step with them as
    moments (garbage of the size of the codes, 0..255); their saved shape makes its first update
    raise, before it changes the param (weight decay off, in the checkpoint's groups that torch
    loads: AdamW decays the param before its update)."""
    opt, p = _stepped(ours[0], shape, state_dtype="8bit", **ours[1])
    q = torch.nn.Parameter(p.detach().clone())
    other = theirs[0]([q], lr=1e-2, **theirs[1], **impl)
    other.load_state_dict(_roundtrip(opt.state_dict()))
    q.grad = torch.randn(shape)
    with pytest.raises(RuntimeError, match="shape|size"):
        other.step()
    assert torch.equal(q, p)


@pytest.mark.parametrize("cls,kwargs", [(fused_optim.AdamW, {}), (fused_optim.SGD, dict(momentum=0.9))],
                         ids=["adamw", "sgd"])
def test_8bit_state_saved_in_the_param_s_shape_still_loads_and_continues(cls, kwargs):
    """A state dict that holds the codes in the param's shape (as saved before the trailing
    dimension) continues exactly as the current form does."""
    opt, p = _stepped(cls, (5, 7), state_dtype="8bit", **kwargs)
    current = _roundtrip(opt.state_dict())
    older = _roundtrip(opt.state_dict())
    for key, value in older["state"][0].items():
        if value.dtype == torch.uint8:
            older["state"][0][key] = value.reshape(5, 7)
    results = []
    for state_dict in (current, older):
        q = torch.nn.Parameter(p.detach().clone())
        resumed = cls([q], lr=1e-2, state_dtype="8bit", **kwargs)
        resumed.load_state_dict(state_dict)
        q.grad = torch.ones(5, 7)
        resumed.step()
        results.append((q.detach().clone(), {k: v.clone() for k, v in resumed.state[q].items()}))
    (a, sa), (b, sb) = results
    assert torch.equal(a, b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sa["exp_avg" if cls is fused_optim.AdamW else "momentum_buffer"].shape == (5, 7)


def test_8bit_codes_of_another_size_than_the_param_are_refused():
    opt, _ = _stepped(fused_optim.AdamW, (300,), state_dtype="8bit")
    other = fused_optim.AdamW([torch.nn.Parameter(torch.zeros(301))], lr=1e-2, state_dtype="8bit")
    with pytest.raises(ValueError, match=r"param 0 of group 0 has 8-bit 'exp_avg' of 300 codes for a param of 301"):
        other.load_state_dict(_roundtrip(opt.state_dict()))
    assert len(other.state) == 0


def test_the_conversion_path_hands_8bit_state_to_torch_adamw():
    """Loaded into our AdamW with plain state, one step converts the moments (decode to fp32)
    and updates; its state dict then continues in torch.optim.AdamW as in ours. Both run the
    same fp32 rule in another operation order: per step the updates differ by a few roundings
    of the update (relative 2^-24 each, about ten operations), far below an ulp of the params
    (|p| ~ 1 here, ulp 2^-23), so the params differ by at most one rounding of the param per
    step: 3 steps, 3 ulps of the largest |p|."""
    opt, p = _stepped(fused_optim.AdamW, (300,), state_dtype="8bit")
    q = torch.nn.Parameter(p.detach().clone())
    plain = fused_optim.AdamW([q], lr=1e-2)
    plain.load_state_dict(_roundtrip(opt.state_dict()))
    q.grad = torch.randn(300)
    plain.step()
    assert plain.state[q]["exp_avg"].dtype == torch.float32
    r = torch.nn.Parameter(q.detach().clone())
    theirs = torch.optim.AdamW([r], lr=1e-2)
    theirs.load_state_dict(_roundtrip(plain.state_dict()))
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        g = torch.randn(300, generator=gen)
        q.grad, r.grad = g.clone(), g.clone()
        plain.step()
        theirs.step()
    ulp = torch.finfo(torch.float32).eps * q.abs().max().item()
    assert (q - r).abs().max().item() <= 3 * ulp
    decoded_before = sf.decode_8bit(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_absmax"], True)
    assert decoded_before.abs().max() > 0  # the moments handed over were not zeros
