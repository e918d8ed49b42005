"""Replay of golden trajectories recorded from the published references (timm, torch-optimizer,
quadra, ColossalAI, mlbench_core) by tests/golden/make_golden.py: our optimizers, fed the same
grads, must follow the reference's params step by step (fp32: rtol 1e-5, atol 1e-6)."""


import pytest
import torch

import fused_optim
from utils import GOLDEN

TRAJECTORIES = ["timm_lamb", "torch_optimizer_lamb", "colossalai_lamb", "quadra_lars", "timm_lars",
                "colossalai_lars", "mlbench_signsgd"]
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def load(name: str) -> dict:
    return torch.load(GOLDEN / f"{name}.pt", weights_only=True)


def cases():
    for name in TRAJECTORIES:
        for case in load(name)["cases"]:
            yield pytest.param(name, case, id=f"{name}-{case['id']}")


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=["fp64", "fp32"])
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("name, case", list(cases()))
def test_replays_the_reference_trajectory(name, case, fused, dtype):
    params = [torch.nn.Parameter(t.clone().to(dtype)) for t in case["init"]]
    groups = [{"params": [params[i] for i in g["params"]], **g["options"]} for g in case["groups"]]
    opt = getattr(fused_optim, case["optimizer"])(groups, fused=fused, **case["defaults"])
    for step, (grads, expected) in enumerate(zip(case["grads"], case["expected"])):
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone().to(dtype)
        opt.step()
        for i, (p, e) in enumerate(zip(params, expected)):
            torch.testing.assert_close(p.detach().double(), e, **TOLERANCE[dtype],
                                       msg=lambda m: f"{name} {case['id']} step {step} param {i}: {m}")
    assert opt.implementation == ("fused" if fused else "reference")
