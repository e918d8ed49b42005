"""DTensor params (FSDP2's ``fully_shard``, tensor parallelism) step through the kernels on their
shards, as the same params would whole (tests/workers/sharded_worker.py runs every registered
optimizer both ways in each of 2 and 4 gloo ranks).

* Elementwise optimizers (every element's update reads only that element): a shard's update is
  the update of those elements, so the sharded run equals the whole one bit for bit. So does
  SparsifiedSGD's: every rank draws the whole tensor's coordinates from the same generator state,
  and each shard applies those in its box (FSDP2 over tensor parallelism's ``_StridedShard`` too).
* 8-bit state is blocked per shard: a shard steps as its elements would as a plain tensor of
  their own (bit for bit, codes and absmaxes included), and as the whole tensor where every
  shard holds whole blocks of 256; without the kernels it is refused.
* Layer-wise ones (LARS, LAMB: a trust ratio from each tensor's norms; FusedLAMB's clip by the
  global grad norm) take the norms of the whole tensors, summed from the shards: the same sums
  in another order. A float64 sum of n squares in any order is within n·2⁻⁵³ (relative) of the
  exact one (n ≤ 1800 here: < 2e-13), so the ratios agree to ~1e-13 relative and the fp32
  update lr·r·u differs from the whole run's by at most one rounding of each product (2⁻²⁴
  relative of the update, 1e-2·|u| with |u| ≤ ~10 for LARS (1/(1 − 0.9) momentum) and ≤ 1 for
  LAMB's direction) per step; over 4 steps (plus one ulp of the param per step where a product
  rounds the other way: 2⁻²³·|p|, |p| ≤ ~5): atol = 4·(2⁻²⁴·0.1 + 2⁻²³·5) ≈ 2.4e-6, rtol 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fused_optim.specs import SPECS
from processes import run_ranks
from utils import WORKERS

LAYERWISE_TOL = dict(rtol=0.0, atol=4 * (2**-24 * 0.1 + 2**-23 * 5))
LAYERWISE_OPS = {name for name, spec in SPECS.items() if any(s.name == "norm_sums" for s in spec.scalars)}
REFUSED = {"fused_adam/state_8bit/fused=False": "is a DTensor with state_dtype='8bit', whose codes are blocked per "
                                                 "shard and stepped by the fused kernels only",
           "fused_adam/state_8bit/load_as_Shard(1)": "8-bit codes are blocked per shard and cannot be resharded",
           "fused_adam/state_8bit/load_whole": "saved from a sharded param (blocked per shard), but the param is a "
                                               "whole tensor",
           "fused_adam/state_8bit/load_without_layout": "has 8-bit 'exp_avg' without the 'block_layout' that codes "
                                                        "blocked per shard come with"}


def launch(world: int, tmp: Path) -> list[dict]:
    run_ranks(WORKERS / "sharded_worker.py", lambda r: (r, world, tmp), world, tmp)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    return launch(2, tmp_path_factory.mktemp("sharded2"))


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    return launch(4, tmp_path_factory.mktemp("sharded4"))


def _layerwise(case: str) -> bool:
    import fused_optim

    name = case.split("/")[0]
    return fused_optim.registry.get_spec(name).cls.op_name in LAYERWISE_OPS


def _judge(ranks: list[dict]) -> None:
    for r, result in enumerate(ranks):
        for case, expected in REFUSED.items():
            assert expected in result["errors"].pop(case, ""), f"rank {r}: {case} was not refused as expected"
        assert not result["errors"], f"rank {r}: " + "\n".join(f"{c}: {m}" for c, m in result["errors"].items())
        for case, run in result["runs"].items():
            what = f"rank {r}, {case}"
            assert run["implementation"] == "fused", f"{what}: stepped by {run['implementation']}"
            assert not run["warnings"], f"{what} warned: {run['warnings']}"
            for k, (sharded, whole) in enumerate(run["params"]):
                if _layerwise(case):
                    torch.testing.assert_close(sharded, whole, **LAYERWISE_TOL, msg=lambda m: f"{what} param {k}: {m}")
                else:
                    assert torch.equal(sharded, whole), f"{what}: param {k} differs from the whole run's"
            for sharded_keys, piece_keys in run.get("keys", []):  # a layout with 8-bit codes, and only then
                eight_bit = any(key.endswith("_absmax") for key in piece_keys)
                assert sharded_keys == sorted(piece_keys + ["block_layout"] * eight_bit), f"{what}: {sharded_keys}"
            for key, sharded, whole, placed_as_param in run["state"]:
                if key != "step":
                    assert placed_as_param, f"{what}: state {key!r} is not a DTensor placed as its param"
                if not _layerwise(case):
                    assert torch.equal(sharded, whole), f"{what}: state {key!r} differs from the whole run's"
    for case in ranks[0]["runs"]:  # every rank ends with the same whole tensors
        if ranks[0]["runs"][case].get("per_shard"):  # (compared on each rank's own shards)
            continue
        for k, (sharded, _) in enumerate(ranks[0]["runs"][case]["params"]):
            for other in ranks[1:]:
                assert torch.equal(other["runs"][case]["params"][k][0], sharded), f"{case}: ranks disagree"


@pytest.mark.slow
def test_two_ranks(ranks2):
    assert any(case.endswith("fully_shard") for case in ranks2[0]["runs"])
    _judge(ranks2)


@pytest.mark.slow
def test_norms_of_whole_tensors_under_fsdp2_over_tensor_parallelism(ranks4):
    """``_StridedShard`` dimensions are summed too (a dimension left out would miss half the squares:
    a factor √2). The kernel adds a shard's ≤ 60 squares in fp32 (each rounded, as is each
    addition) before the float64 all-reduce: relative ≤ (60 + 60)·2⁻²⁴ against the float64 sum
    of the whole tensor, which the square root halves."""
    for result in ranks4:
        got = result["strided_norms"]
        assert any("_StridedShard" in placements for placements in got["placements"]), got["placements"]
        torch.testing.assert_close(got["norms"], got["whole"], rtol=120 * 2**-24, atol=0.0)


@pytest.mark.slow
def test_four_ranks(ranks4):
    assert any(case.startswith("lars/2d-Replicate") for case in ranks4[0]["runs"])
    _judge(ranks4)
