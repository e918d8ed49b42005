"""benchmarks/scaled_step.py at a toy size (one round): what each variant does to the grads, the
bytes it is charged for, and the rows' arithmetic."""

from __future__ import annotations

import pytest
import torch

from benchmarks import scaled_step as bench

TOY = [(1000,), (3000,)]


@pytest.mark.parametrize("optimizer", list(bench.OPTIMIZERS))
def test_scaled_variants_write_the_grads_back_and_the_others_do_not(optimizer):
    """Two steps of each variant (scales 16 then 1/16): the scaled ones and the separate pass
    leave the grads as they were (g/16·16), after the first step g/16; the unscaled ones never
    touch them."""
    written = set()
    for variant, step in bench.steppers(optimizer, TOY, torch.float32).items():
        before = [g.clone() for g in step.grads]
        step()
        if all(torch.equal(g, b / 16) for g, b in zip(step.grads, before)):
            written.add(variant)
        else:
            assert all(torch.equal(g, b) for g, b in zip(step.grads, before)), variant
        step()
        assert all(torch.equal(g, b) for g, b in zip(step.grads, before)), variant
    assert written == {"scaled", "unscaled + foreach", "torch fused, scaled"}


def test_bytes_count_the_extra_grad_traffic():
    assert bench.step_bytes("adamw", torch.float32, "unscaled") == 4 * 7  # p rw, g r, m rw, v rw
    assert bench.step_bytes("adamw", torch.float32, "scaled") == 4 * 8
    assert bench.step_bytes("sgd", torch.bfloat16, "unscaled + foreach") == 2 * (5 + 2)


def test_rows_are_bytes_over_time_against_the_probe_and_ours_unscaled():
    rows = bench.bench("sgd", "bf16", "toy", TOY, 1, 1, min_sample_s=1e-4)
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    ms = {r["variant"]: r["ms"] for r in rows}
    for r in rows:
        assert r["threads"] == 1 and r["ms"] > 0
        assert r["gb_per_s"] == pytest.approx(r["bytes"] * 4000 / (r["ms"] / 1e3) / 1e9)
        assert r["fraction_of_probe"] == pytest.approx(r["gb_per_s"] / r["probe_gb_per_s"])
        assert r["vs_unscaled"] == pytest.approx(r["ms"] / ms["unscaled"])
    lines = bench.markdown(rows)
    assert len(lines) == 7 + len(rows) and lines[-1].startswith("| sgd | bf16 | toy | 1 | torch fused, scaled |")
