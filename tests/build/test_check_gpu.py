"""``make check-gpu`` (tools/check_gpu.sh, tools/check_gpu.py) in its dry run: the same steps on the
CPU through the CUDA emulation, so the script itself (arguments, the install into a scratch
target, the reports, the exit codes, timeouts) is tested on every machine. What it checks on a GPU
is docs/gpu.md's."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "check_gpu.sh"
STEPS = ["install", "build", "errors", "tests", "refusals", "compile", "memcheck", "racecheck", "bench"]
RUN_DRY = 6  # the steps a dry run runs; the sanitizers and the benchmark are SKIPPED


@functools.cache
def _check_gpu_module():
    """tools/check_gpu.py imported by path (tools/ is no package), registered first: its dataclass
    looks its module up."""
    spec = importlib.util.spec_from_file_location("check_gpu", REPO / "tools" / "check_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _dry_run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path / "out"
    proc = subprocess.run([str(SCRIPT), str(out), "--dry-run", "--scratch", str(tmp_path / "scratch"), *args],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=240)
    report = json.loads((out / "check_gpu.json").read_text())
    return proc, report, (out / "check_gpu.md").read_text()


def test_dry_run_installs_into_the_scratch_target_runs_every_step_and_reports(tmp_path):
    proc, report, md = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert list(status) == STEPS
    assert status == {**dict.fromkeys(STEPS[:RUN_DRY], "PASSED"), **dict.fromkeys(STEPS[RUN_DRY:], "SKIPPED")}
    assert report["result"] == "PASSED" and report["dry_run"] is True and report["budget_s"] == 480
    assert all(s["reason"].startswith("dry run") for s in report["steps"][RUN_DRY:])
    site = tmp_path / "scratch" / "site"
    assert (site / "fused_optim" / "csrc" / "cuda").is_dir()  # the wheel's layout, by pip
    steps = {s["name"]: s for s in report["steps"]}
    # Every later step imported the installed copy, not the checkout.
    assert f"from {site / 'fused_optim'}" in steps["build"]["output_tail"]
    for name in ("tests", "refusals"):
        assert " passed" in steps[name]["output_tail"] and "failed" not in steps[name]["output_tail"]
    assert "fused_optim's CUDA library (emulated): raised RuntimeError" in steps["errors"]["output_tail"]
    assert "FusedAdam: torch.compile(fullgraph=True, backend=eager) == eager" in steps["compile"]["output_tail"]
    assert Path(steps["tests"]["log"]).read_text().endswith(steps["tests"]["output_tail"] + "\n")
    assert md.startswith("# GPU check: PASSED")
    assert "| install | PASSED |" in md and "| memcheck | SKIPPED |" in md and "FAILED" not in md
    assert "SKIPPED: bench: dry run: no GPU to time" in md


def test_a_failing_step_fails_the_run_the_others_still_run(tmp_path):
    """Also: a --scratch folder used before is emptied first (a stale file there would be imported)."""
    for stale in ("site/stale.py", "src/pyproject.toml"):
        (tmp_path / "scratch" / stale).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "scratch" / stale).write_text("stale")
    proc, report, md = _dry_run(tmp_path, "--inject-failure", "tests", "--skip", "compile")
    assert not (tmp_path / "scratch" / "site" / "stale.py").exists()
    assert proc.returncode == 1
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status["tests"] == "FAILED" and status["build"] == status["install"] == "PASSED"
    assert status["compile"] == "SKIPPED"
    assert report["result"] == "FAILED" and md.startswith("# GPU check: FAILED")
    assert "FAILED: tests (exit 1)" in md.splitlines()
    assert "failure injected into tests" in md
    assert "check-gpu: FAILED" in proc.stdout


def test_a_step_past_its_time_is_killed_and_one_past_the_budget_not_run(tmp_path):
    """The step's process group is killed at its limit (the sleeping grandchild too: the wait returns
    in about 2 s, not 30); a step with under a second of budget left does not start. Both fail the run."""
    check_gpu = _check_gpu_module()
    sleeper = [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
               "'import time; time.sleep(30)']); print('unreachable')"]
    slow = check_gpu.Step("slow", "sleeps", timeout_s=2, command=sleeper)
    start = time.monotonic()
    check_gpu.run_step(slow, dict(os.environ), time.monotonic() + 100, tmp_path, cwd=tmp_path)
    assert slow.status == "TIMEOUT" and time.monotonic() - start < 15
    assert "killed after 2 s" in slow.reason and "unreachable" not in slow.output_tail
    late = check_gpu.Step("late", "never starts", timeout_s=60, command=[sys.executable, "-c", "pass"])
    check_gpu.run_step(late, dict(os.environ), time.monotonic() + 0.5, tmp_path, cwd=tmp_path)
    assert late.status == "NOT RUN" and "budget was spent" in late.reason
    assert {"TIMEOUT", "NOT RUN"} <= set(check_gpu.FAILING)


def test_a_crashed_step_names_its_signal(tmp_path):
    """A step whose process dies of a signal (a segfault in a kernel, say) FAILS, naming it; its
    output up to the crash is kept."""
    check_gpu = _check_gpu_module()
    crash = [sys.executable, "-c",
             "import os, signal; print('last words', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"]
    step = check_gpu.Step("crash", "segfaults", timeout_s=30, command=crash)
    check_gpu.run_step(step, dict(os.environ), time.monotonic() + 100, tmp_path, cwd=tmp_path)
    assert step.status == "FAILED" and step.exit_code == -11 and step.reason == "killed by SIGSEGV"
    assert "last words" in step.output_tail


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "--budget 0.0: give a positive number of seconds"),
    (["--skip", "nosuch"], "--skip nosuch: no such step (choose from install, build, errors, tests"),
    (["--inject-failure", "nosuch"], "--inject-failure nosuch: no such step"),
])
def test_bad_arguments_exit_naming_the_option_and_the_fix(tmp_path, capsys, argv, message):
    check_gpu = _check_gpu_module()
    with pytest.raises(SystemExit) as exc:
        check_gpu.main([str(tmp_path / "out"), "--dry-run", "--scratch", str(tmp_path / "s"), *argv])
    assert exc.value.code != 0
    assert message in f"{exc.value.code}{capsys.readouterr().err}"


@pytest.mark.parametrize("sanitizer", [True, False], ids=["compute-sanitizer", "none"])
def test_the_gpu_plan_runs_the_gpu_tests_the_sanitizers_where_found_and_the_benchmark(tmp_path, monkeypatch,
                                                                                      sanitizer):
    """Without --dry-run: the tests marked cuda, gpu_steps.py without --emulated, each sanitizer tool
    over the one-step program (SKIPPED, saying why, where compute-sanitizer is not on PATH), the GPU
    benchmark on the lists asked for, its tables under the report folder."""
    check_gpu = _check_gpu_module()
    if sanitizer:
        fake = tmp_path / "bin" / "compute-sanitizer"
        fake.parent.mkdir()
        fake.write_text("#!/bin/sh\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    args = check_gpu.parse_args([str(tmp_path / "out"), "--bench-lists", "1M", "--bench-repeats", "3"])
    steps = {s.name: s for s in check_gpu.plan(args, tmp_path / "site", tmp_path / "out")}
    assert list(steps) == STEPS
    assert steps["tests"].command[-4:] == ["-m", "cuda", "-k", "not refused"]
    assert steps["refusals"].command[-4:] == ["-m", "cuda", "-k", "refused"]
    assert all("--emulated" not in steps[name].command for name in ("build", "errors", "compile"))
    for tool in ("memcheck", "racecheck"):
        if sanitizer:
            assert steps[tool].command == [str(fake), "--tool", tool, "--error-exitcode", "1", "--report-api-errors",
                                           "no", sys.executable, check_gpu.STEPS_SCRIPT, "one-step"]
        else:
            assert steps[tool].command is None and steps[tool].reason == "compute-sanitizer is not on PATH"
    assert steps["bench"].command[1:] == ["-m", "benchmarks", "--device", "cuda", "--lists", "1M", "--repeats", "3",
                                          "--out", str(tmp_path / "out" / "bench")]
