"""A spawned rank that raises ends the whole run, with its error shown, under each spawn strategy of
lightning_optim (as under Lightning's own ``"ddp_spawn"``): the failing rank must not wait at exit
for ranks blocked in a collective with it (see lightning_optim/strategy.py, GroupEndingDDPStrategy).
One launch of tests/workers/lightning_failing_rank_worker.py runs the three fits in turn."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from utils import WORKERS

WORKER = WORKERS / "lightning_failing_rank_worker.py"
STRATEGIES = ("adascale_ddp_spawn", "centralized_spawn", "powersgd_ddp_spawn")
# Each fit fails within ~30 s on an idle 2-core machine (process start and imports); a hung rank
# would wait for the process group's timeout (30 min by default), far above this bound.
TIMEOUT = 200 * len(STRATEGIES)


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_with_its_error(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = subprocess.Popen([sys.executable, str(WORKER), *STRATEGIES], env=env, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = worker.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)  # the worker and its ranks (a blocked rank ignores SIGTERM)
        out, err = worker.communicate()
        pytest.fail(f"a failing rank left the run hanging for {TIMEOUT} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert worker.returncode == 0, err[-5000:]
    # the worker's report: one "<strategy> raised <type>: <text>" per fit, the text multi-line
    chunks = re.split(f"^(?=(?:{'|'.join(STRATEGIES)}) )", out, flags=re.MULTILINE)
    runs = {chunk.split(" ", 1)[0]: chunk for chunk in chunks if chunk.split(" ", 1)[0] in STRATEGIES}
    assert list(runs) == list(STRATEGIES), out[-3000:]
    for strategy, run in runs.items():
        assert run.startswith(f"{strategy} raised ProcessRaisedException"), run[:500]
        assert "ValueError: rank 1 fails on purpose at batch 1" in run, run[-3000:]  # the original error
