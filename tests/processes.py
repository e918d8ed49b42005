"""Launching the multi-process tests: worker scripts, one process per rank, and 2-rank
``torchrun`` runs (of a script, or of ``-m mmengine_optim.train --launcher pytorch``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 600  # far above a loaded run: a hang fails instead of blocking the suite


def run_ranks(script: Path, args_of_rank, ranks: int, log_dir: Path, env: dict | None = None) -> None:
    """``python script *args_of_rank(r)`` for r in range(ranks), all at once, with
    OMP_NUM_THREADS=1; raises with the rank's log tail when one fails or hangs."""
    for r, (returncode, log) in enumerate(ranks_ended(script, args_of_rank, ranks, log_dir, env)):
        assert returncode == 0, f"rank {r} of {ranks} failed:\n{log[-3000:]}"


def ranks_ended(script: Path, args_of_rank, ranks: int, log_dir: Path, env: dict | None = None,
                timeout_s: float = TIMEOUT_S) -> list[tuple[int, str]]:
    """(exit status, output) of each rank of :func:`run_ranks`' launch, once all have ended;
    raises when one is still running after ``timeout_s`` (a hang: it is killed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    logs = [open(log_dir / f"rank{r}.log", "w+") for r in range(ranks)]
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, args_of_rank(r))], env=env, stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(ranks)]
    try:
        for proc in procs:
            proc.wait(timeout=timeout_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ended = []
    for proc, log in zip(procs, logs):
        log.seek(0)
        ended.append((proc.returncode, log.read()))
        log.close()
    return ended


def torchrun(target: list[str], module_dir: Path) -> None:
    """``torchrun --nproc_per_node=2 *target`` (a script and its arguments, or ``-m module ...``) in
    ``module_dir``, with it on the path (for modules a config imports); raises with its output
    when it fails."""
    inherited = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(module_dir), *inherited]))
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", *target]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=module_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def torchrun_mmengine(config: Path, work_dir: Path, module_dir: Path) -> None:
    """``torchrun --nproc_per_node=2 -m mmengine_optim.train config --launcher pytorch`` (see :func:`torchrun`)."""
    torchrun(["-m", "mmengine_optim.train", str(config), "--launcher", "pytorch", "--work-dir", str(work_dir)],
             module_dir)
