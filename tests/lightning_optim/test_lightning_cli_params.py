"""``lightning_optim.follow_module_params`` (``lightning_optim.LightningCLI``'s ``--optimizer``
under a strategy that replaces the module's params in ``configure_model``), in one process: the
optimizer made early takes the module's replaced params, in order; what it cannot follow raises."""

import pytest
import torch

import fused_optim
from lightning_optim.cli import follow_module_params


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _replace_params(module):
    """What fully_shard does to a module's params: each replaced by a new param of its shape."""
    for layer in module:
        for name, p in list(layer.named_parameters(recurse=False)):
            setattr(layer, name, torch.nn.Parameter(p.detach().clone() + 1.0))


def test_an_optimizer_made_before_the_params_were_replaced_steps_the_new_ones():
    module = _module()
    old = list(module.parameters())
    opt = fused_optim.FusedAdam([{"params": old[:2], "lr": 0.1}, {"params": old[2:]}], lr=1e-2, fused=True)
    _replace_params(module)
    new = list(module.parameters())
    follow_module_params(module, opt)
    assert [p for g in opt.param_groups for p in g["params"]] == new
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[1]["lr"] == 1e-2  # groups kept
    before = [p.detach().clone() for p in new]
    module(torch.randn(5, 3)).square().sum().backward()
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(new, before)) and opt.implementation == "fused"
    assert all(o.grad is None for o in old)


def test_an_optimizer_that_holds_the_module_s_params_is_left_as_it_is():
    module = _module()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    groups = opt.param_groups[0]["params"]
    follow_module_params(module, opt)
    assert opt.param_groups[0]["params"] is groups


@pytest.mark.parametrize("case, message", [
    ("some", "it holds some of the module's params and not others"),
    ("count", "it holds 3 params, the module has 4"),
    ("shape", r"param 0 has shape \(4, 3\), the module's \(4, 5\)"),
    ("state", "it has state already"),
])
def test_what_it_cannot_follow_raises_naming_it_and_changes_nothing(case, message):
    module = _module()
    old = list(module.parameters())
    opt = torch.optim.SGD(old[:3] if case == "count" else old, lr=0.1, momentum=0.9)
    if case == "state":
        for p in old:
            p.grad = torch.ones_like(p)
        opt.step()
    if case == "some":
        module[2].bias = torch.nn.Parameter(torch.zeros(2))
    else:
        _replace_params(module)
    if case == "shape":
        module[0].weight = torch.nn.Parameter(torch.zeros(4, 5))
    with pytest.raises(RuntimeError, match=f"SGD was made over params the module no longer has .*{message}"):
        follow_module_params(module, opt)
    assert [p for g in opt.param_groups for p in g["params"]] == (old[:3] if case == "count" else old)
