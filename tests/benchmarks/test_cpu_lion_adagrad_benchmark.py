"""benchmarks/cpu_lion_adagrad.py at a toy size (a few thousand elements, one round) without
DeepSpeed (not a dependency; its rows are the same code path): the step check before timing, the
rows' arithmetic and the table."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import cpu_lion_adagrad as bench

TOY = [(1000,), (3000,)]


@pytest.fixture(autouse=True)
def no_deepspeed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # its import raises ModuleNotFoundError


def test_torch_adagrad_takes_our_step():
    """torch's Adagrad is the same update, within the rounding bound, in both its modes."""
    diff = bench.step_differences("adagrad")
    assert set(diff) == set(bench.TORCH)
    assert all(0 <= d <= bench.ULPS_PER_STEP for d in diff.values()), diff


def test_a_different_update_is_beyond_the_bound(monkeypatch):
    """A peer with a 10% larger lr moves every param by ~10% of its step more: far beyond a few ulps."""
    wrong = {"fused_optim": bench.variants("adagrad")["fused_optim"],
             "off": lambda ps: torch.optim.Adagrad(ps, **{**bench.KW["adagrad"], "lr": 1.1e-2})}
    monkeypatch.setattr(bench, "variants", lambda opt: wrong)
    assert bench.step_differences("adagrad")["off"] > 100 * bench.ULPS_PER_STEP


def test_rows_are_bytes_over_time_against_the_probe_and_the_fastest_torch():
    rows = bench.bench("adagrad", "toy", TOY, 1, 1, min_sample_s=1e-4)
    assert [r["variant"] for r in rows] == ["fused_optim", *bench.TORCH]
    ms = {r["variant"]: r["ms"] for r in rows}
    for r in rows:
        assert r["threads"] == 1 and r["ms"] > 0 and r["vs_deepspeed"] is None
        assert r["gb_per_s"] == pytest.approx(bench.BYTES * 4000 / (r["ms"] / 1e3) / 1e9)
        assert r["fraction_of_probe"] == pytest.approx(r["gb_per_s"] / r["probe_gb_per_s"])
        assert r["vs_torch"] == pytest.approx(min(ms[t] for t in bench.TORCH) / r["ms"])


def test_lion_without_deepspeed_has_no_peer_and_says_so():
    notes = {"lion": bench.deepspeed_optimizer(*bench.DEEPSPEED["lion"])[1]}
    diffs = {"lion": bench.step_differences("lion")}
    rows = bench.bench("lion", "toy", TOY, 2, 1, min_sample_s=1e-4)
    assert diffs == {"lion": {}} and [r["variant"] for r in rows] == ["fused_optim"]
    assert rows[0]["vs_deepspeed"] is None and rows[0]["vs_torch"] is None
    lines = bench.markdown(rows, diffs, notes)
    assert "DeepSpeedCPULion: not installed, its rows and column n/a" in lines[3] and "lion: no peer" in lines[3]
    assert lines[-1].endswith("| n/a | n/a |")


def test_the_table_marks_a_variant_beyond_the_bound():
    rows = [dict(optimizer="adagrad", params="toy", threads=1, variant=v, ms=1.0, gb_per_s=1.0,
                 fraction_of_probe=1.0, probe_gb_per_s=1.0, vs_deepspeed=None, vs_torch=1.0)
            for v in ("fused_optim", *bench.TORCH)]
    diffs = {"adagrad": {bench.TORCH[0]: bench.ULPS_PER_STEP + 0.5, bench.TORCH[1]: 0.5}}
    lines = bench.markdown(rows, diffs, {"adagrad": "not installed"})
    assert [" ⚠ |" in line for line in lines[-3:]] == [False, True, False]
    assert f"{bench.TORCH[0]} {bench.ULPS_PER_STEP + 0.5:.2f}" in lines[3]
