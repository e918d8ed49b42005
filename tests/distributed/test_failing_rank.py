"""A kernel error on one rank under FSDP2 fails every rank within the process group's timeout,
never a hang, and the failing rank shows the original error (tests/workers/failing_rank_worker.py:
2 gloo ranks, rank 1's second step gets a float64 grad for a float32 param). FusedLAMB takes a
collective in its step (the global grad norm), before the kernel that fails; LARS's layer-wise
norms of DTensors take one between the op's two calls (fused_optim/sharding.py, run_layerwise),
after the first, which fails. Either way the other rank fails at its next collective: at once
when the failing rank's process has ended, after the timeout when it waits in another one."""

from __future__ import annotations

import re

import pytest

from processes import ranks_ended
from utils import WORKERS

WORLD = 2
TIMEOUT_S = 5  # the process group's
LAUNCH_S = 300  # start-up (imports, under load) and the timeout, with room: beyond it is a hang
GLOO_ERROR = re.compile(r"Connection closed by peer|Timed out waiting|Application timeout caused pair closure")


@pytest.mark.slow
@pytest.mark.parametrize("name, teardown", [("fused_lamb", "exit"), ("lars", "end_process_group")])
def test_a_kernel_error_on_one_rank_fails_every_rank(tmp_path, name, teardown):
    ended = ranks_ended(WORKERS / "failing_rank_worker.py", lambda r: (r, WORLD, tmp_path, name, TIMEOUT_S, teardown),
                        WORLD, tmp_path, timeout_s=LAUNCH_S)
    (status0, log0), (status1, log1) = ended
    op = "lamb_" if name == "fused_lamb" else "lars_"
    assert status1 != 0 and re.search(
        rf"RuntimeError: fused_optim::{op}: grads\[0\] \(param 0 of group 0\) \(Double, shape \[5, 6\], cpu\) "
        r"does not match its param \(Float", log1), log1[-3000:]
    assert "rank 1: step 1 done" not in log1
    assert status0 != 0 and GLOO_ERROR.search(log0), log0[-3000:]
    assert "rank 0: step 2 done" not in log0
