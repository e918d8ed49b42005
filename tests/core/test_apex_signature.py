"""apex's FusedAdam signature: its positional order and keywords (``capturable``,
``master_weights``, ``set_grad_none``), so apex users' code and configs run unchanged; as apex's
own tests (tests/L0/run_optimizers/test_adam.py) build it."""

import inspect

import pytest
import torch

import fused_optim

# apex.optimizers.FusedAdam.__init__'s parameters, in order (apex 24.x)
APEX = ["params", "lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay", "amsgrad",
        "set_grad_none", "capturable", "master_weights"]


def test_the_positional_order_is_apexs():
    names = [p.name for p in inspect.signature(fused_optim.FusedAdam).parameters.values()
             if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert names == APEX


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_positional_arguments_build_what_keywords_build(adam_w_mode):
    """Every argument given by position lands where apex puts it: both optimizers step alike."""
    def make(positional):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 37))
        if positional:
            opt = fused_optim.FusedAdam([p], 2e-3, False, (0.8, 0.9), 1e-6, adam_w_mode, 0.1, True, False, True, False)
        else:
            opt = fused_optim.FusedAdam([p], lr=2e-3, bias_correction=False, betas=(0.8, 0.9), eps=1e-6,
                                        adam_w_mode=adam_w_mode, weight_decay=0.1, amsgrad=True,
                                        set_grad_none=False, capturable=True, master_weights=False)
        for step in range(3):
            p.grad = torch.cos(torch.arange(37.0) + step)
            opt.step()
        return p, opt

    (p, opt), (q, ref) = make(True), make(False)
    assert torch.equal(p, q) and opt.param_groups[0] == {**ref.param_groups[0], "params": opt.param_groups[0]["params"]}
    group = opt.param_groups[0]
    assert (group["lr"], group["bias_correction"], group["betas"], group["eps"], group["decoupled_weight_decay"],
            group["weight_decay"], group["amsgrad"], group["capturable"]) == (2e-3, False, (0.8, 0.9), 1e-6,
                                                                             adam_w_mode, 0.1, True, True)
    assert opt.set_grad_none is False


def test_capturable_changes_nothing_on_the_cpu_and_goes_through_state_dicts():
    def run(capturable):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 300))
        opt = fused_optim.FusedAdam([p], lr=1e-2, capturable=capturable)
        for step in range(3):
            p.grad = torch.sin(torch.arange(300.0) * (step + 1))
            opt.step()
        return p, opt

    (p, opt), (q, _) = run(True), run(False)
    assert torch.equal(p, q)
    again = fused_optim.FusedAdam([torch.nn.Parameter(q.detach().clone())], lr=1e-2)
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[0]["capturable"] is True


def test_a_non_boolean_capturable_is_refused_by_name():
    with pytest.raises(ValueError, match="capturable"):
        fused_optim.FusedAdam([torch.nn.Parameter(torch.zeros(2))], capturable="yes")
