"""``AdaScaleCallback`` and ``NoiseScaleCallback`` under Lightning's ``ModelParallelStrategy`` on 2
gloo CPU ranks: with tensor parallelism (one replica split over both ranks) the statistics and the
params equal the same module trained unsharded on one device; data-parallel under FSDP2 they
equal DDP's (tests/workers/lightning_model_parallel_worker.py; Lightning's popen launcher runs
rank 1).

Tolerance: float64. The tensor-parallel forward and backward add the layers' 8- and 16-term dot
products in another order (two halves and an all-reduce), so each gradient element differs by
~17 ulps of its terms; the sums of squares then differ by ~1e-15 relative, the estimates var =
a·L − b·T and |G|² = T − var/S by that times their cancellation (FSDP2 against DDP: the same
dot products, averaged over the ranks in another order: fewer ulps than that) (|G|² is ~1/100 of T where
b_simple ≈ 160: a factor ~1e2), and 6 updates of SGD carry it into the params: ~1e-13 relative
at most (of each tensor's largest element, for the params). 1e-10 leaves a margin of 1000 and is
8 orders below what a shard's norm in place of the tensor's makes (tens of percent). A first
window whose |G|² estimate is not positive gives B_simple = inf in both runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils import WORKERS

pytestmark = pytest.mark.slow  # processes

WORKER = WORKERS / "lightning_model_parallel_worker.py"
TIMEOUT = 900  # seconds per launch: far above a loaded run; a hang fails the test
RTOL = 1e-10


def launch(out: Path, mode: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)  # rank 0 launches; Lightning sets LOCAL_RANK=1 for the other
    done = subprocess.run([sys.executable, str(WORKER), str(out), mode], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_model_parallel")
    launch(out, "model_parallel")
    launch(out, "single")
    load = lambda name: torch.load(out / f"{name}.pt", weights_only=False)  # noqa: E731
    return load("model_parallel-rank0"), load("model_parallel-rank1"), load("single-rank0")


@pytest.mark.parametrize("run", ["adascale", "noise_scale"])
def test_tensor_parallel_statistics_equal_the_unsharded_run(results, run):
    rank0, rank1, single = (r[run] for r in results)
    assert (rank0["rank"], rank1["rank"]) == (0, 1)
    assert rank0["rows"] == rank1["rows"]  # both ranks measured the same whole tensors
    assert len(rank0["rows"]) == len(single["rows"]) == 6
    for step, (tp, one) in enumerate(zip(rank0["rows"], single["rows"])):
        assert tp["world_size"] == one["world_size"] == 1, step  # one replica: N is the data-parallel size
        assert (tp["gain"] is None) == (one["gain"] is None) == (run == "noise_scale"), step
        for key in ("gain", "b_simple") if run == "adascale" else ("b_simple",):
            assert tp[key] == pytest.approx(one[key], rel=RTOL), f"step {step}: {key}"
    assert any(row["b_simple"] < 100 for row in rank0["rows"])  # the statistics measured something
    for k, (p, q) in enumerate(zip(rank0["params"], single["params"])):
        assert p.dtype == torch.float64, k
        torch.testing.assert_close(p, q, rtol=0.0, atol=RTOL * float(q.abs().max()), msg=lambda m: f"param {k}: {m}")


@pytest.mark.parametrize("run", ["adascale", "noise_scale"])
def test_fsdp2_statistics_equal_ddps(results, run):
    """Data-parallel over 2 ranks (N = 2): FSDP2's statistics, taken on the tensors it unshards
    (the callbacks pass the LightningModule), equal DDP's."""
    (fsdp0, fsdp1), (ddp0, ddp1) = ((r[parallel][run] for r in results[:2]) for parallel in ("fsdp2", "ddp"))
    assert fsdp0["rows"] == fsdp1["rows"] and ddp0["rows"] == ddp1["rows"]  # each pooled both ranks' micro-batches
    assert len(fsdp0["rows"]) == len(ddp0["rows"]) == 6
    for step, (sharded, whole) in enumerate(zip(fsdp0["rows"], ddp0["rows"])):
        assert sharded["world_size"] == whole["world_size"] == 2, step
        for key in ("gain", "b_simple") if run == "adascale" else ("b_simple",):
            assert sharded[key] == pytest.approx(whole[key], rel=RTOL), f"step {step}: {key}"
    assert any(row["b_simple"] < 100 for row in fsdp0["rows"])  # the statistics measured something
    for k, (p, q) in enumerate(zip(fsdp0["params"], ddp0["params"])):
        torch.testing.assert_close(p, q, rtol=0.0, atol=RTOL * float(q.abs().max()), msg=lambda m: f"param {k}: {m}")
