"""8-bit state and outliers (docs/algorithms.md, "8-bit state and outliers"): a param group with
``state_dtype=None`` keeps plain state beside 8-bit groups, so the tensors prone to outliers can
be kept out of 8-bit blocks."""

import torch

import fused_optim


def _grads(steps: int, n: int, outlier: float) -> torch.Tensor:
    g = torch.randn(steps, n, generator=torch.Generator().manual_seed(0)) * 1e-2
    g[0, 0] = outlier
    return g


def test_a_group_with_plain_state_beside_8bit_groups_steps_as_if_alone():
    """The plain group's param and moments are bit for bit those of an optimizer with plain state
    only; the other group's moments are 8-bit codes (uint8)."""
    steps = 20
    outlier, other = _grads(steps, 256, 1e6), _grads(steps, 300, 1.0)
    p, q = torch.nn.Parameter(torch.zeros(256)), torch.nn.Parameter(torch.zeros(300))
    mixed = fused_optim.AdamW([{"params": [p], "state_dtype": None}, {"params": [q]}], lr=1e-3,
                              weight_decay=0.0, state_dtype="8bit")
    alone_p = torch.nn.Parameter(torch.zeros(256))
    alone = fused_optim.AdamW([alone_p], lr=1e-3, weight_decay=0.0)
    for t in range(steps):
        p.grad, q.grad, alone_p.grad = outlier[t].clone(), other[t].clone(), outlier[t].clone()
        mixed.step()
        alone.step()
    assert torch.equal(p, alone_p)
    assert all(torch.equal(mixed.state[p][k], alone.state[alone_p][k]) for k in ("exp_avg", "exp_avg_sq"))
    assert mixed.state[q]["exp_avg"].dtype == torch.uint8 and mixed.state[p]["exp_avg"].dtype == torch.float32
    assert [g.get("state_dtype") for g in mixed.param_groups] == [None, "8bit"]
