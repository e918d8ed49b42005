"""benchmarks/offload.py at a toy size (a few thousand elements, one round): every mode's rows,
their arithmetic, the "max" size's memory rule, and the DeepSpeed column where DeepSpeed is
missing (it is not a dependency; the rows of an installed one are the same code path)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import offload

TOY = [(1000,), (3000,)]


@pytest.fixture
def no_deepspeed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # its import raises ModuleNotFoundError
    return offload.deepspeed_adam()


def test_without_deepspeed_its_column_says_so(no_deepspeed):
    cls, note = no_deepspeed
    assert (cls, note) == (None, "not installed")
    rows = [r for mode in offload.modes(None) for r in offload.bench(mode, "toy", TOY, 1, 1, None, min_sample_s=1e-4)]
    lines = offload.markdown(rows, cls, note)
    assert "DeepSpeed: not installed, its rows and column n/a" in lines[3]
    assert lines[-1].startswith(f"| all | – | – | {offload.DEEPSPEED} | not installed |")
    table = lines[7:-1]
    assert len(table) == len(rows) == 7  # fp32: 2 variants, bf16 state: 2, bf16 params: 3
    assert all(line.endswith("| n/a |") for line in table)


def test_rows_are_bytes_over_time_against_the_probe():
    rows = offload.bench("bf16 params", "toy", TOY, 2, 1, None, min_sample_s=1e-4)
    moved = {name: b for name, (_, b) in offload.modes(None)["bf16 params"][1].items()}
    torch_ms = next(r["ms"] for r in rows if r["variant"] == offload.TORCH)
    for r in rows:
        assert r["threads"] == 2 and r["ms"] > 0
        assert r["gb_per_s"] == pytest.approx(moved[r["variant"]] * 4000 / (r["ms"] / 1e3) / 1e9)
        assert r["fraction_of_probe"] == pytest.approx(r["gb_per_s"] / r["probe_gb_per_s"])
        assert r["vs_torch"] == pytest.approx(torch_ms / r["ms"])


def test_bench_restores_the_thread_count():
    before = torch.get_num_threads()
    offload.bench("fp32", "toy", TOY, 1 if before != 1 else 2, 1, None, min_sample_s=1e-4)
    assert torch.get_num_threads() == before


def test_max_size_fits_the_memory_of_every_variant_at_once():
    """fp32 mode: ours, torch's (p, g, m, v: 16 bytes each) and the probe's 8: 40 bytes per element,
    plus the step counters (4 bytes per tensor, measured on one of 81920 elements: < 1e-4 byte)."""
    numel = offload.max_numel("fp32", 40 * 1_000_000, None)
    assert 1_000_000 * (1 - 1e-4 / 40) - offload.MAX_TENSORS <= numel <= 1_000_000
    assert numel % offload.MAX_TENSORS == 0
    label, shapes = offload.shapes_of("max", "fp32", 40 * 1_000_000, None)
    assert shapes == [(numel // offload.MAX_TENSORS,)] * offload.MAX_TENSORS and "1M (max)" in label
    # ours with bf16 state holds 12 bytes per element, not 16: 36 in all
    assert offload.max_numel("fp32, bf16 state", 36 * 1_000_000, None) == numel
