"""benchmarks/offload_fsdp2.py at a toy size (one round): the params are FSDP2's offloaded DTensors,
ours steps them through its kernels, and the rows' arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fused_optim
from benchmarks import offload, offload_fsdp2

TOY = [(1000,), (3000,)]


@pytest.fixture(autouse=True)
def one_rank_group():
    """The benchmark makes a one-process gloo group; the tests after these must not see it."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_params_are_fsdp2_dtensors_with_grads_and_ours_steps_them_fused():
    params = offload_fsdp2.fsdp2_params(TOY, torch.float32)
    plain = offload.make_params(TOY, torch.float32)
    for p, q in zip(params, plain):
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements == p.placements
        assert torch.equal(p.full_tensor(), q) and torch.equal(p.grad.full_tensor(), q.grad)
    opt = fused_optim.FusedAdam(params, fused=True, **offload.KW)
    opt.step()
    assert opt.implementation == "fused" and isinstance(opt.state[params[0]]["exp_avg"], DTensor)


@pytest.mark.parametrize("mode", offload_fsdp2.MODES)
def test_rows_are_bytes_over_time_against_the_probe_and_the_plain_step(mode):
    rows = offload_fsdp2.bench(mode, "toy", TOY, 1, 1, min_sample_s=1e-4)
    assert [r["variant"] for r in rows] == [next(iter(offload.modes(None)[mode][1])), offload.TORCH,
                                            offload_fsdp2.PLAIN]
    torch_ms, plain_ms = rows[1]["ms"], rows[2]["ms"]
    for r in rows:
        assert r["ms"] > 0 and r["threads"] == 1
        assert r["vs_torch"] == pytest.approx(torch_ms / r["ms"]) and r["vs_plain"] == pytest.approx(plain_ms / r["ms"])
    assert rows[1]["gb_per_s"] == pytest.approx(28 * 4000 / (torch_ms / 1e3) / 1e9)  # torch keeps fp32 state
    lines = offload_fsdp2.markdown(rows)
    assert len(lines) == 7 + len(rows) and lines[-1].startswith(f"| {mode} | toy | 1 | {offload_fsdp2.PLAIN} |")
