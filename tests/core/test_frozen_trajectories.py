"""Every registered optimizer's CPU trajectory, in every format it offers, is bit for bit the one
recorded before the last change meant to preserve results (tests/frozen_trajectories.py says
how and when to record). Bitwise because the same kernels on the same inputs are deterministic;
a reordered reduction or a changed instruction sequence shows here, and only here, on purpose."""

import pytest
import torch

from frozen_trajectories import FORMATS, PATH, run
from fused_optim.registry import list_optimizers

RECORDED = torch.load(PATH, weights_only=True)["cases"]


def test_every_optimizer_is_recorded_in_fp32():
    """A newly registered optimizer gets recorded too (rerun the recorder after adding one)."""
    assert {name for name in list_optimizers() if f"{name}/fp32" not in RECORDED} == set()


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_trajectory_is_unchanged(case):
    name, fmt = case.split("/")
    assert fmt in FORMATS
    expected, actual = RECORDED[case], run(name, fmt)
    for step, (want, got) in enumerate(zip(expected["steps"], actual["steps"], strict=True)):
        assert want["params"] == got["params"], f"{case}: params differ after step {step + 1}"
        assert want["state"] == got["state"], f"{case}: state differs after step {step + 1}"
    for want, got in zip(expected["last_params"], actual["last_params"], strict=True):
        assert torch.equal(want, got)
