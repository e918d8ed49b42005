"""The op scalars an optimizer reads as an item of a group value (``Scalar(..., ("betas", i))``,
fused_optim/spec.py) reach the op as floats: Tensor betas (torch.optim.Adam takes them) step every
optimizer with betas exactly as the same values given as floats, through the kernels and through
the reference, which both receive the same Python float."""

import inspect

import pytest
import torch

import fused_optim
from fused_optim.optimizer import FusedOptimizer

WITH_ITEMS = sorted(name for name in fused_optim.__all__
                    if inspect.isclass(cls := getattr(fused_optim, name)) and issubclass(cls, FusedOptimizer)
                    and getattr(cls, "_item_scalars", ()))


def test_every_optimizer_with_betas_reads_them_as_items():
    assert {"Adam", "AdamW", "FusedAdam", "FusedLAMB", "Lamb", "Lion"} <= set(WITH_ITEMS)
    for name in WITH_ITEMS:
        assert getattr(fused_optim, name)._item_scalars == (("beta1", "betas", 0), ("beta2", "betas", 1))


def _trajectory(cls, betas, fused: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300)]
    opt = cls(params, lr=1e-2, betas=betas, fused=fused)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert opt.implementation == ("fused" if fused else "reference")
    return [p.detach() for p in params]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("name", WITH_ITEMS)
def test_tensor_betas_step_as_their_float_values(name, fused):
    cls = getattr(fused_optim, name)
    as_floats = _trajectory(cls, (0.9, 0.99), fused)
    # float64 Tensors hold 0.9 and 0.99 exactly as the Python floats do
    as_tensors = _trajectory(cls, (torch.tensor(0.9, dtype=torch.float64), torch.tensor([0.99], dtype=torch.float64)),
                             fused)
    assert all(torch.equal(a, b) for a, b in zip(as_floats, as_tensors))
