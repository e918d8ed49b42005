"""``make check-gpu``: the CUDA kernels checked on a real GPU in one command, under a time budget
(default 480 s), with no network. Steps, each a process with its own timeout (cut to what is left of
the budget; a step the budget no longer reaches is reported NOT RUN):

1. install: this checkout installed with ``pip install --no-deps --no-build-isolation --no-index
   --target <scratch>`` over the machine's own torch; every later step imports that copy.
2. build: the CPU kernels and the CUDA library for the GPU present (``tools/gpu_steps.py build``),
   each build's wall time printed (the first-build time on a machine with an empty cache).
3. errors: a C++ error in a kernel reaches Python as a RuntimeError (``gpu_steps.py errors``: a
   minimal extension's, then fused_optim's CPU and CUDA ops'); a crash here is the toolchain's.
4. tests: ``pytest -m cuda -k "not refused" tests/emulation/test_cuda.py
   tests/emulation/test_compact_cuda.py tests/emulation/test_norm_sums_phases_cuda.py
   tests/core/test_unscaled_grads.py tests/distributed/test_cpu_offload.py``: the GPU backend of
   the CUDA op tests (every op in four dtypes, multi-launch sizes, misaligned storage, found_inf,
   master weights, every registered optimizer's trajectory vs the CPU kernels, GradScaler and the
   unscaled grads it leaves, CUDA graph capture and replay of a step, the layer-wise ops' two calls
   of a sharded step, ...) and FSDP2's CPU offload on a one-GPU NCCL mesh;
   refusals: the same files' ``-k refused`` tests (bad arguments raise and write nothing), apart,
   so that a crash in them cannot hide the others' results.
5. compile: ``torch.compile(fullgraph=True)`` of a FusedSGD and a FusedAdam step == eager.
6. memcheck, racecheck: ``compute-sanitizer --tool memcheck|racecheck`` over one small step of every
   registered optimizer and one norm (``tools/gpu_steps.py one-step``); SKIPPED, saying so, where
   compute-sanitizer is not on PATH.
7. bench: ``python -m benchmarks --device cuda`` (benchmarks/cuda.py: ours vs torch fused and
   foreach, CUDA events, the copy-bandwidth probe) on ``--bench-lists``; its tables land in
   ``<out>/bench``.

Writes ``<out>/check_gpu.md`` and ``<out>/check_gpu.json`` (every step's status, seconds, command
and output tail; full logs in ``<out>/logs``) and exits 1 if any step FAILED, TIMED OUT or was NOT
RUN. ``--dry-run``: the same steps on a machine without a GPU, through the CUDA emulation on the
CPU (``gpu_steps.py --emulated``, a few emulated tests), sanitizers and benchmark skipped: it tests
this script (tests/build/test_check_gpu.py). docs/gpu.md says how to run it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS_SCRIPT = str(REPO / "tools" / "gpu_steps.py")
# What the wheel is built from (pyproject.toml's packages, package-dir and readme).
SOURCES = ("pyproject.toml", "README.md", "csrc", "fused_optim", "lightning_optim", "mmengine_optim")
CUDA_TEST_FILES = [*(str(REPO / "tests" / "emulation" / name)
                     for name in ("test_cuda.py", "test_compact_cuda.py", "test_norm_sums_phases_cuda.py")),
                   str(REPO / "tests" / "core" / "test_unscaled_grads.py"),
                   str(REPO / "tests" / "distributed" / "test_cpu_offload.py")]
DRY_RUN_TESTS = ["-m", "not cuda", "-k", "emulated and found_inf"]  # a few seconds of emulated tests
DRY_RUN_REFUSALS = ["-m", "not cuda", "-k", "emulated and sums_only_without_norm_sums"]  # 4 of them
TAIL_LINES = 40
FAILING = ("FAILED", "TIMEOUT", "NOT RUN")


@dataclass
class Step:
    """One check: its command (None: skipped, ``reason`` says why) and its own time limit."""

    name: str
    what: str
    timeout_s: float
    command: list[str] | None
    reason: str = ""
    status: str = "NOT RUN"
    seconds: float = 0.0
    exit_code: int | None = None
    output_tail: str = ""
    log: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/check_gpu.sh", description="The CUDA kernels on a real GPU: "
                                     "install, build, tests, sanitizers, benchmark; one markdown and one JSON report.")
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or "gpu-check",
                        help="report folder (default: $OUT, else ./gpu-check)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together (default 480)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: the CUDA emulation on the CPU, few tests, no sanitizer or benchmark")
    parser.add_argument("--python", default=sys.executable, help="the Python with torch (default: this one)")
    parser.add_argument("--scratch", default=None, help="where to install the package (default: a temporary folder)")
    parser.add_argument("--bench-lists", nargs="+", default=["25M", "100M", "1B"],
                        choices=["1M", "25M", "100M", "1B"],
                        help="benchmark param lists (benchmarks/cuda.py LISTS; default 25M 100M 1B)")
    parser.add_argument("--bench-repeats", type=int, default=5, help="benchmark rounds per case (default 5)")
    parser.add_argument("--skip", nargs="+", default=[], metavar="STEP",
                        help="steps not to run (a rerun's time for the others: --skip build bench)")
    parser.add_argument("--inject-failure", metavar="STEP", default=None,
                        help="make STEP fail (its command replaced by one that exits 1): tests the failure path")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget {args.budget}: give a positive number of seconds")
    if args.bench_repeats < 1:
        parser.error(f"--bench-repeats {args.bench_repeats}: give an int >= 1")
    return args


def plan(args, site: Path, out: Path) -> list[Step]:
    """The steps in order, with their commands for a GPU run or the dry run."""
    py, dry = args.python, args.dry_run
    emulated = ["--emulated"] if dry else []
    sanitizer = shutil.which("compute-sanitizer")
    no_sanitizer = "dry run: no GPU" if dry else "compute-sanitizer is not on PATH"
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TEST_FILES]
    steps = [
        Step("install", "pip install --no-deps --no-build-isolation --target <scratch>", 120,
             [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
              "--no-build-isolation", "--no-index", "--target", str(site), str(site.parent / "src")]),
        Step("build", "CPU kernels and " + ("the emulated CUDA library" if dry else "the CUDA library, first build"),
             300, [py, STEPS_SCRIPT, "build", *emulated]),
        Step("errors", "a kernel's C++ error raises in Python (a minimal extension, then ours)", 120,
             [py, STEPS_SCRIPT, "errors", *emulated]),
        Step("tests", "pytest: the " + ("emulated (a few)" if dry else "GPU") + " backend of the CUDA op tests", 240,
             [*pytest, *(DRY_RUN_TESTS if dry else ["-m", "cuda", "-k", "not refused"])]),
        Step("refusals", "pytest: the CUDA op tests' bad arguments, refused with an error", 60,
             [*pytest, *(DRY_RUN_REFUSALS if dry else ["-m", "cuda", "-k", "refused"])]),
        Step("compile", "torch.compile(fullgraph=True) of a FusedSGD and a FusedAdam step == eager", 150,
             [py, STEPS_SCRIPT, "compile", *emulated]),
    ]
    for tool, limit in (("memcheck", 120), ("racecheck", 150)):
        # CUDA API errors not reported: torch's own probing (peer access, say) returns some by design;
        # a failing launch of ours raises in the program all the same.
        command = None if dry or not sanitizer else [sanitizer, "--tool", tool, "--error-exitcode", "1",
                                                     "--report-api-errors", "no", py, STEPS_SCRIPT, "one-step"]
        steps.append(Step(tool, f"compute-sanitizer --tool {tool}: one step of every optimizer", limit, command,
                          reason="" if command else no_sanitizer))
    bench = None if dry else [py, "-m", "benchmarks", "--device", "cuda", "--lists", *args.bench_lists,
                              "--repeats", str(args.bench_repeats), "--out", str(out / "bench")]
    steps.append(Step("bench", f"ours vs torch fused/foreach at {' '.join(args.bench_lists)} (benchmarks/cuda.py)",
                      300, bench, reason="" if bench else "dry run: no GPU to time"))
    return apply_options(steps, args)


def apply_options(steps: list[Step], args) -> list[Step]:
    """``--skip`` and ``--inject-failure`` applied to the planned steps (an unknown step name: an error)."""
    py = args.python
    names = [s.name for s in steps]
    injected = [args.inject_failure] if args.inject_failure else []
    for option, given in (("--skip", args.skip), ("--inject-failure", injected)):
        if set(given) - set(names):
            raise SystemExit(f"tools/check_gpu.sh: error: {option} {' '.join(sorted(set(given) - set(names)))}: "
                             f"no such step (choose from {', '.join(names)})")
    for step in steps:
        if step.name in args.skip:
            step.command, step.reason = None, "--skip"
        if step.name == args.inject_failure:
            step.command = [py, "-c", f"import sys; sys.exit('failure injected into {step.name} (--inject-failure)')"]
    return steps


def copy_sources(src: Path) -> None:
    """The files the wheel is built from, copied: pip's build then writes nothing into the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "*.egg-info")
    src.mkdir(parents=True)
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)


def copy_layout(site: Path) -> None:
    """The packages' files as the wheel lays them out (csrc/ as fused_optim/csrc): what the later steps
    import when pip cannot build the wheel (no setuptools beside the machine's torch, say)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o")
    shutil.rmtree(site, ignore_errors=True)
    for name in ("fused_optim", "lightning_optim", "mmengine_optim"):
        shutil.copytree(REPO / name, site / name, ignore=ignore)
    shutil.copytree(REPO / "csrc", site / "fused_optim" / "csrc", ignore=ignore)


def run_step(step: Step, env: dict, deadline: float, logs: Path, cwd: Path) -> None:
    """Run ``step`` in ``cwd`` (its process group killed at its timeout or the budget's end); fill in
    its result."""
    if step.command is None:
        step.status = "SKIPPED"
        return
    limit = min(step.timeout_s, deadline - time.monotonic())
    if limit <= 1:
        step.reason = "the time budget was spent before it started"
        return
    log = logs / f"{step.name}.log"
    step.log = str(log)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(step.command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            step.exit_code = proc.wait(timeout=limit)
            step.status = "PASSED" if step.exit_code == 0 else "FAILED"
            if step.exit_code < 0:  # a crash: the output's last lines say where
                step.reason = f"killed by {signal.Signals(-step.exit_code).name}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            step.status = "TIMEOUT"
            step.reason = f"killed after {limit:.0f} s (its limit {step.timeout_s:.0f} s, or the budget's end)"
    step.seconds = time.monotonic() - start
    step.output_tail = "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])


def device_name(dry_run: bool) -> str:
    if dry_run:
        return "no GPU (dry run: the CUDA emulation on the CPU)"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown GPU (no nvidia-smi on PATH)"
    result = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True)
    return result.stdout.strip().replace("\n", "; ") or f"unknown GPU (nvidia-smi: {result.stderr.strip()})"


def markdown(report: dict) -> str:
    steps = report["steps"]
    lines = [f"# GPU check: {report['result']}", "",
             f"{report['device']}; Python {report['python']}; started {report['started_utc']}; "
             f"{report['total_s']:.0f} s of a {report['budget_s']:.0f} s budget"
             + ("; **dry run**" if report["dry_run"] else "") + ".", "",
             "| step | status | seconds | what |", "|---|---|---:|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s['what']} |" for s in steps]
    lines.append("")
    lines += [f"{s['status']}: {s['name']}" + (f" (exit {s['exit_code']})" if s["exit_code"] not in (None, 0) else "")
              + (f": {s['reason']}" if s["reason"] else "") for s in steps if s["status"] != "PASSED"]
    for s in steps:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        if s["command"]:
            lines += [f"`{shlex.join(s['command'])}`", ""]
        if s["reason"]:
            lines += [s["reason"], ""]
        if s["output_tail"]:
            lines += ["```", s["output_tail"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, deadline = time.time(), time.monotonic() + args.budget
    out = Path(args.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="check-gpu-")).resolve()
    site = scratch / "site"
    steps = plan(args, site, out)
    for folder in (scratch / "src", site):  # a --scratch folder used before: emptied
        shutil.rmtree(folder, ignore_errors=True)
    copy_sources(scratch / "src")
    site.mkdir()
    # The installed copy first, then the checkout (its benchmarks/ and tests/); the steps run in
    # the install folder, so the checkout's fused_optim/ never shadows the installed one, even
    # where `python -m` puts the working directory on sys.path (PYTHONSAFEPATH: Python >= 3.11).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "PYTHONSAFEPATH": "1"}
    try:
        for step in steps:
            run_step(step, env, deadline, logs, cwd=site)
            if step.name == "install" and step.status != "PASSED":
                copy_layout(site)
                step.reason = "the later steps import the package's files copied as the wheel lays them out"
            print(f"check-gpu: {step.name:10} {step.status:8} {step.seconds:6.1f} s  {step.reason}", flush=True)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    failed = [s for s in steps if s.status in FAILING]
    report = {"result": "FAILED" if failed else "PASSED", "device": device_name(args.dry_run),
              "python": sys.version.split()[0], "dry_run": args.dry_run, "budget_s": args.budget,
              "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
              "total_s": time.time() - started,
              "steps": [asdict(s) for s in steps]}
    (out / "check_gpu.json").write_text(json.dumps(report, indent=2))
    (out / "check_gpu.md").write_text(markdown(report))
    print(f"check-gpu: {report['result']}: wrote {out / 'check_gpu.md'} and {out / 'check_gpu.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
