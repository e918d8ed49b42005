"""FSDP2 with ``CPUOffloadPolicy`` steps the offloaded params through our CPU kernels
(tests/workers/offload_worker.py, 2 gloo ranks): FusedAdam, CPUAdam and FusedLAMB, with
``state_dtype=torch.bfloat16``, with ``master_weights`` for bf16 params, and fp32 params under a
bf16 ``MixedPrecisionPolicy`` (ZeRO-Offload's setting).

The offload policy moves the sharded params, their grads and so the optimizer state to the CPU;
the numbers are the same, so the offloaded run equals the same model sharded without offload bit
for bit (the same kernels on the same shards), and ``implementation`` is ``"fused"``. On a
CPU-only machine the offloaded and resident runs both live on the CPU: what this checks there is
that FSDP2's offload path (grads handed to the CPU after the reduce-scatter, params copied to
the compute device before the all-gather) gives our optimizers DTensors they step fused.

``CPUOffloadPolicy()`` pins its host memory by default, which needs an accelerator: on a machine
without one ``fully_shard`` raises at once (docs/sharding.md quotes the error), and
``CPUOffloadPolicy(pin_memory=False)`` is the policy that runs. Beside a GPU (``make check-gpu``)
the fp32 cases also run on a one-GPU NCCL mesh, where the shards sit on the CPU of a CUDA mesh.
AdaScale given the model is one more case: its gains are the resident run's too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from processes import run_ranks
from utils import WORKERS

PINNED_ERROR = "Cannot access accelerator device when none is available"


def launch(out: Path, world: int, device: str) -> list[dict]:
    run_ranks(WORKERS / "offload_worker.py", lambda r: (r, world, out, device), world, out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("offload"), 2, "cpu")


def judge(ranks: list[dict], cases: int, same) -> None:
    """Every case ran fused, offloaded (params, grads and state on the CPU, state DTensors), and
    ``same(offloaded, resident, what)`` holds for each param, state tensor and AdaScale gain."""
    for r, result in enumerate(ranks):
        assert not result["errors"], f"rank {r}: " + "\n".join(f"{c}: {m}" for c, m in result["errors"].items())
        assert len(result["runs"]) == cases
        for case, run in result["runs"].items():
            what = f"rank {r}, {case}"
            stepped_by = run["offloaded"]["implementation"]
            assert stepped_by == "fused", f"{what}: stepped by {stepped_by}"
            assert not run["warnings"], f"{what} warned: {run['warnings']}"
            assert run["devices"] == ["cpu"], f"{what}: offloaded tensors on {run['devices']}"
            assert run["dtensor_state"], f"{what}: state of offloaded params is not sharded like them"
            offloaded, resident = run["offloaded"], run["resident"]
            if "gains" in resident:
                assert min(resident["gains"]) > 1.0, f"{what}: {resident['gains']}"  # (it measured something)
                same(torch.tensor(offloaded["gains"]), torch.tensor(resident["gains"]), f"{what}: gains")
            for fqn, value in resident["params"].items():
                assert offloaded["params"][fqn].dtype == value.dtype, f"{what}: {fqn} dtype"
                same(offloaded["params"][fqn], value, f"{what}: {fqn}")
                for key, state in resident["state"][fqn].items():
                    same(offloaded["state"][fqn][key], state, f"{what}: state {key!r} of {fqn}")


def bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(a, b), f"{what} differs from the resident run's"


@pytest.mark.slow
def test_offloaded_params_step_fused_as_resident_ones(ranks):
    judge(ranks, 9, bitwise)


@pytest.mark.slow
@pytest.mark.cuda
def test_offloaded_params_of_a_gpu_mesh_step_on_the_cpu_as_resident_ones_on_the_gpu(tmp_path):
    """One GPU, NCCL only, ``CPUOffloadPolicy()``, the worker's fp32 cases: the offloaded run's CPU
    kernels against the resident run's CUDA kernels, the forward and backward on the GPU in both.
    Their updates differ in fused multiply-adds and, for LAMB's trust ratios and AdaScale's
    ``.grad`` sums, in the summation order: about 1 ulp per step (the bound of
    tests/emulation/test_cuda.py's trajectories); 3 steps here: 4 ulps of fp32 of the values'
    scale (≤ 1). The gains (float64) come from sums of squares the kernels add in fp32, per tensor
    (≤ 60 squares here) in their own order: each sum within 60·2⁻²⁴ (3.6e-6) of the other device's,
    relative; a gain, a ratio of such sums through EWMAs with positive weights, within twice that,
    plus the few ulps by which the params, and so the next grads, differ: 1e-5."""
    limits = {torch.float32: 4 * torch.finfo(torch.float32).eps, torch.float64: 1e-5}

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        limit = limits[a.dtype]
        torch.testing.assert_close(a, b, rtol=limit, atol=limit, msg=lambda m: f"{what}: {m}")
    judge(launch(tmp_path, 1, "cuda"), 4, close)


@pytest.mark.slow
def test_pinned_offload_needs_an_accelerator(ranks):
    if torch.accelerator.is_available():
        assert ranks[0]["pinned_error"] is None  # (the worker only tries it where there is none)
    else:
        for result in ranks:
            assert PINNED_ERROR in (result["pinned_error"] or ""), result["pinned_error"]
