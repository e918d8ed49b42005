"""Our optimizers as ``ZeroRedundancyOptimizer(params, optimizer_class=...)``'s on 2 gloo ranks
(tests/workers/zero_worker.py), against the same params stepped by the optimizer alone.

ZeRO partitions whole params among the ranks, so every per-tensor rule (LARS's and LAMB's trust
ratios) sees whole tensors: every registered optimizer but two equals the unpartitioned run bit
for bit. FusedLAMB's clip by the global grad norm sums the partitions' squares over ZeRO's
process group (without that sum the params end ~2e-3 away: the test fails). The sum of the two
partitions' float64 sums is the whole sum in another order, within n·2⁻⁵³ (relative, n = 1800
squares here: < 2e-13) of it; the clip divides the fp32 grads by it, so a grad element rounds
at most one ulp apart, and the param one ulp more per step where the update's product rounds the
other way: over 4 steps atol = 4·(2⁻²⁴·0.1 + 2⁻²³·5) (|lr·r·u| ≤ 0.1, |p| ≤ 5), rtol 0.
SparsifiedSGD draws its coordinates from one generator, param after param: a rank's partition
draws another sequence than the whole list, so only that it steps fused is checked.
"""

from __future__ import annotations

import pytest
import torch

import fused_optim
from processes import run_ranks
from utils import WORKERS

WORLD = 2
CLIP_TOL = dict(rtol=0.0, atol=4 * (2**-24 * 0.1 + 2**-23 * 5))
DRAWS = {"sparsified_sgd"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    run_ranks(WORKERS / "zero_worker.py", lambda r: (r, WORLD, tmp), WORLD, tmp)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
def test_every_optimizer_steps_its_partition_fused_as_the_whole_run(ranks):
    for r, result in enumerate(ranks):
        assert not result["errors"], f"rank {r}: " + "\n".join(f"{c}: {m}" for c, m in result["errors"].items())
        assert set(result["runs"]) == set(fused_optim.list_optimizers())
        for name, run in result["runs"].items():
            what = f"rank {r}, {name}"
            assert run["implementation"] == "fused", f"{what}: stepped by {run['implementation']}"
            assert not run["warnings"], f"{what} warned: {run['warnings']}"
            assert 0 < run["owned"] < len(run["params"]), f"{what}: the rank's optimizer holds {run['owned']} params"
            if name in DRAWS:
                continue
            clips = fused_optim.registry.get_spec(name).cls is fused_optim.FusedLAMB
            for k, (zero, whole) in enumerate(run["params"]):
                if clips:
                    torch.testing.assert_close(zero, whole, **CLIP_TOL, msg=lambda m: f"{what} param {k}: {m}")
                else:
                    assert torch.equal(zero, whole), f"{what}: param {k} differs from the unpartitioned run's"


@pytest.mark.slow
def test_fused_lamb_finds_zeros_process_group(ranks):
    """FusedLAMB learns ZeRO's group from the stack when ZeRO builds it (fused_optim/zero_partition.py):
    if torch builds the local optimizer otherwise, this fails (and the clip would see one partition)."""
    for r, result in enumerate(ranks):
        for name, run in result["runs"].items():
            found = fused_optim.registry.get_spec(name).cls is fused_optim.FusedLAMB
            assert run["partition_group"] is found, f"rank {r}, {name}: partition group found: {run['partition_group']}"


def test_fused_lamb_made_alone_is_no_partition():
    opt = fused_optim.FusedLAMB([torch.nn.Parameter(torch.ones(3))])
    assert opt._partition_group is None
