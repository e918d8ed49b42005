"""AdaScale across processes: 2 gloo ranks under DDP against one process accumulating the same
micro-batches (and against fairscale under the same DDP loop), and a mid-window checkpoint
resumed in a fresh process. The subprocess side is tests/workers/adascale_worker.py."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fused_optim
from utils import WORKERS

WORKER = WORKERS / "adascale_worker.py"
TIMEOUT = 1800  # seconds for a subprocess (or a group of them): far above a loaded run; a hang fails the test
RTOL = 1e-9  # float64, each step from equal states: the derivation is in tests/core/test_adascale.py

_spec = importlib.util.spec_from_file_location("adascale_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(argvs: list[list[str]], logs: Path, worker: Path = WORKER) -> list[tuple[int, str]]:
    """Start ``worker *argv`` (default adascale_worker.py) for every argv at once (the environment inherited: see
    conftest.py for their PYTHONPATH); wait at most TIMEOUT for all, killing them all on a timeout.
    Returns (exit code, output) per worker."""
    procs = []
    for i, argv in enumerate(argvs):
        log = open(logs / f"worker{i}-{time.monotonic_ns()}.log", "w+")
        procs.append((subprocess.Popen([sys.executable, str(worker), *argv], stdout=log,
                                       stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outputs = []
        for _, log in procs:
            log.seek(0)
            outputs.append(log.read()[-3000:])
        pytest.fail(f"workers {argvs} did not finish in {TIMEOUT} s:\n" + "\n----\n".join(outputs))
    results = []
    for proc, log in procs:
        log.seek(0)
        results.append((proc.returncode, log.read()))
        log.close()
    return results


def check(results) -> None:
    for rc, out in results:
        assert rc == 0, f"worker failed (exit {rc}):\n{out[-5000:]}"


def replay_one_process(before: dict, two_groups: bool, step: int) -> tuple[float, list[float], list]:
    """One step of one process accumulating the 4 micro-batches that the 2 ranks saw, from the DDP
    run's state before that step: (gain read before step(), per-group gains, params after)."""
    model, groups = worker.model_and_groups(two_groups)
    opt = fused_optim.AdaScale(torch.optim.SGD(groups, lr=0.1, momentum=0.9), world_size=1,
                               num_gradients_to_accumulate=4)
    model.load_state_dict(before["model"])
    opt.load_state_dict(before["opt"])  # (N·c = 4 as in the DDP run: the same scale and smoothing)
    opt.set_num_gradients_to_accumulate(4, update_smoothing=False)  # the state dict said 2 per rank
    worker.window(model, step, range(4), 4, ddp=False)
    gain, gains = opt.gain(), [opt.gain(k) for k in range(len(opt.param_groups))]
    opt.step()
    return gain, gains, [p.detach().clone() for p in model.parameters()]


def test_documented_loop_two_process_ddp_equals_one_process_accumulating_4_and_fairscale(tmp_path):
    """fairscale's loop (backward; tau += opt.gain(); step()) on 2 gloo ranks × 2 micro-batches, in
    float64, each step compared from equal states (tolerance: see tests/core/test_adascale.py)."""
    for attempt in range(3):  # the free port may be taken between free_port() and the bind
        port = free_port()
        outs = [tmp_path / f"rank{r}-{attempt}.pt" for r in range(2)]
        results = run_workers([["ddp", str(r), str(port), str(outs[r])] for r in range(2)], tmp_path)
        if all(rc == 0 for rc, _ in results) or not any("ddress already in use" in o for _, o in results):
            break
    check(results)
    rank0, rank1 = (torch.load(out, weights_only=True) for out in outs)
    assert (rank0["world_size"], rank0["rank"], rank1["world_size"], rank1["rank"]) == (2, 0, 2, 1)

    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for two_groups in (False, True):
            ddp, ref, other_rank = (rank0["results"][two_groups]["ours"], rank0["results"][two_groups]["fairscale"],
                                    rank1["results"][two_groups]["ours"])
            assert len(ddp) == len(ref) == worker.STEPS >= 10
            tau = 0.0
            for step, (d, r, o) in enumerate(zip(ddp, ref, other_rank)):
                where = f"{'two groups' if two_groups else 'one group'}, step {step}"
                # the ranks agree exactly (DDP kept the params in sync; both all-reduced the same sums)
                assert (o["gain"], o["gains"], o["tau"]) == (d["gain"], d["gains"], d["tau"]), where
                assert all(torch.equal(p, q) for p, q in zip(o["params"], d["params"])), where
                # gain() read before step() is the gain step() applies; τ is the running sum of gains
                assert d["after_gain"] == d["gain"], where
                tau += d["gain"]
                assert d["tau"] == pytest.approx(tau, rel=1e-15), where
                # fairscale under the same DDP loop, from the same state
                assert d["gain"] == pytest.approx(r["gain"], rel=RTOL), where
                assert d["gains"] == pytest.approx(r["gains"], rel=RTOL), where
                for p, q in zip(d["params"], r["params"]):
                    torch.testing.assert_close(p, q, rtol=RTOL, atol=RTOL, msg=lambda m: f"{where} vs fairscale: {m}")
                # 2 ranks × 2 micro-batches == 1 process × 4 micro-batches, from the same state
                gain, gains, params = replay_one_process(d["before"], two_groups, step)
                assert d["gain"] == pytest.approx(gain, rel=RTOL), where
                assert d["gains"] == pytest.approx(gains, rel=RTOL), where
                for p, q in zip(d["params"], params):
                    torch.testing.assert_close(p, q, rtol=RTOL, atol=RTOL, msg=lambda m: f"{where}: {m}")
            assert ddp[-1]["gain"] > 1.0  # the statistics did something
            assert len(ddp[-1]["gains"]) == (2 if two_groups else 1)
    finally:
        torch.set_default_dtype(old_dtype)


def test_save_mid_window_reload_in_a_fresh_process_continues_identically(tmp_path):
    ckpt, resumed, straight = tmp_path / "ckpt.pt", tmp_path / "resumed.pt", tmp_path / "straight.pt"
    check(run_workers([["save", str(ckpt)], ["straight", str(straight)]], tmp_path))
    check(run_workers([["resume", str(ckpt), str(resumed)]], tmp_path))
    a, b = torch.load(resumed, weights_only=True), torch.load(straight, weights_only=True)
    assert (a["gain"], a["gains"], a["tau"]) == (b["gain"], b["gains"], b["tau"])
    assert a["gain"] > 1.0 and a["tau"] > 9.0
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
