"""Params the kernels do not take: on the ``meta`` device (how shapes are traced) or not floating
point. ``fused=None`` / ``False`` step meta params by the reference implementation as torch.optim
does; ``fused=True`` refuses them with torch's own words (so code matching torch's message matches
ours) followed by our explanation."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import Parameter

import fused_optim
from fused_optim.fallback import TORCH_FUSED_REFUSAL

NAMES = ("SGD", "Adam", "AdamW")
KWARGS = {"SGD": {"lr": 0.1, "momentum": 0.9}, "Adam": {"lr": 0.1}, "AdamW": {"lr": 0.1}}


def _meta_params():
    params = [Parameter(torch.empty(4, 3, device="meta")), Parameter(torch.empty(3, device="meta"))]
    for p in params:
        p.grad = torch.empty_like(p)
    return params


def test_torch_says_the_words_we_repeat():
    """Guards TORCH_FUSED_REFUSAL against a torch that words its refusal differently."""
    for p in (_meta_params()[0], torch.zeros(3, dtype=torch.int64)):
        p.grad = torch.zeros_like(p)
        with pytest.raises(RuntimeError, match=TORCH_FUSED_REFUSAL):
            torch.optim.AdamW([p], lr=0.1, fused=True).step()


@pytest.mark.parametrize("fused", [None, False], ids=["auto", "reference"])
@pytest.mark.parametrize("name", NAMES)
def test_meta_params_step_like_torch(name, fused):
    """Two steps on meta params leave the same state as torch.optim's: the same keys, meta
    tensors of the params' shapes, and step counters on the CPU that count the steps."""
    ours_params, torch_params = _meta_params(), _meta_params()
    ours = getattr(fused_optim, name)(ours_params, **KWARGS[name], fused=fused)
    theirs = getattr(torch.optim, name)(torch_params, **KWARGS[name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ours.step()
            theirs.step()
    if fused is None:  # the one fallback warning says why
        assert [str(w.message) for w in caught if "is on meta" in str(w.message)]
    assert ours.implementation == "reference"
    for p, q in zip(ours_params, torch_params):
        assert p.device.type == "meta"
        mine, ref = ours.state[p], theirs.state[q]
        assert set(mine) == set(ref)
        for key, value in ref.items():
            assert (mine[key].device, mine[key].shape) == (value.device, value.shape), key
            if key == "step":
                assert mine[key].item() == value.item() == 2.0


@pytest.mark.parametrize("name", NAMES)
def test_fused_true_refuses_meta_params_in_torchs_words(name):
    opt = getattr(fused_optim, name)(_meta_params(), **KWARGS[name], fused=True)
    with pytest.raises(RuntimeError, match=TORCH_FUSED_REFUSAL) as info:
        opt.step()
    assert "but torch.float32 and meta" in str(info.value)
    assert "param 0 of group 0 is on meta, which has no fused kernel" in str(info.value)


@pytest.mark.parametrize("fused", [True, None, False], ids=["fused", "auto", "reference"])
@pytest.mark.parametrize("name", NAMES)
def test_non_floating_params_are_refused(name, fused):
    """Refused with every ``fused`` (torch.optim fails on them too); torch's words only where
    torch says them, under ``fused=True``."""
    p = torch.zeros(3, dtype=torch.int64)
    p.grad = torch.zeros(3, dtype=torch.int64)
    opt = getattr(fused_optim, name)([p], **KWARGS[name], fused=fused)
    with pytest.raises(RuntimeError, match="param 0 of group 0 has dtype torch.int64; only floating-point") as info:
        opt.step()
    assert (TORCH_FUSED_REFUSAL in str(info.value)) == (fused is True)
    assert not opt.state
