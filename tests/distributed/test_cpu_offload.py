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
``CPUOffloadPolicy(pin_memory=False)`` is the policy that runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from processes import run_ranks
from utils import WORKERS

PINNED_ERROR = "Cannot access accelerator device when none is available"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("offload")
    run_ranks(WORKERS / "offload_worker.py", lambda r: (r, 2, out), 2, out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_offloaded_params_step_fused_as_resident_ones(ranks):
    for r, result in enumerate(ranks):
        assert not result["errors"], f"rank {r}: " + "\n".join(f"{c}: {m}" for c, m in result["errors"].items())
        assert len(result["runs"]) == 8
        for case, run in result["runs"].items():
            what = f"rank {r}, {case}"
            stepped_by = run["offloaded"]["implementation"]
            assert stepped_by == "fused", f"{what}: stepped by {stepped_by}"
            assert not run["warnings"], f"{what} warned: {run['warnings']}"
            assert run["devices"] == ["cpu"], f"{what}: offloaded tensors on {run['devices']}"
            assert run["dtensor_state"], f"{what}: state of offloaded params is not sharded like them"
            offloaded, resident = run["offloaded"], run["resident"]
            for fqn, value in resident["params"].items():
                assert offloaded["params"][fqn].dtype == value.dtype, f"{what}: {fqn} dtype"
                assert torch.equal(offloaded["params"][fqn], value), f"{what}: {fqn} differs from the resident run's"
                for key, state in resident["state"][fqn].items():
                    assert torch.equal(offloaded["state"][fqn][key], state), f"{what}: state {key!r} of {fqn} differs"


@pytest.mark.slow
def test_pinned_offload_needs_an_accelerator(ranks):
    if torch.accelerator.is_available():
        assert ranks[0]["pinned_error"] is None  # (the worker only tries it where there is none)
    else:
        for result in ranks:
            assert PINNED_ERROR in (result["pinned_error"] or ""), result["pinned_error"]
