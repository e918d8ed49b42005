"""The sharded-norms benchmark runs end to end (2 spawned ranks, ResNet-50's first 10 tensors,
one short round) and reports the all-reduce of 16 bytes per tensor."""

import pytest

from benchmarks import sharded_norms


@pytest.mark.slow
def test_the_benchmark_runs_on_two_ranks(tmp_path):
    text = sharded_norms.run([2], tmp_path, repeats=1, min_sample_s=0.001, tensors=10)
    assert (tmp_path / "sharded_norms.md").read_text() == text
    rows = [line for line in text.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["FusedAdam", "FusedLAMB", "LARS"]
    assert all(row.split("|")[6].strip() == "160" for row in rows[1:])  # 10 tensors x 2 float64 sums
