"""The CPU emulation of CUDA (``csrc/emulation``, ``fused_optim.testing.emulated_cuda``) itself:
it runs barriers, shared memory and warp shuffles as CUDA does and fails a launch that misuses
them, checks launch configurations, and converts fp16/bf16 as CUDA does (cuda_emulation_checks.cpp);
its ops live in their own namespace, leaving the CPU ops alone. (The CUDA code run through it:
tests/emulation/test_cuda.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_optim
from fused_optim import _build, _ops

CHECKS = Path(__file__).with_name("cuda_emulation_checks.cpp")


def test_barriers_shuffles_launch_checks_and_conversions_behave_as_in_cuda(tmp_path):
    exe = tmp_path / "checks"
    compile_ = ["g++", "-std=c++17", "-O1", "-U_FORTIFY_SOURCE", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas",
                "-I", str(_build.CSRC / "emulation"), "-I", str(_build.CSRC / "cuda"), str(CHECKS), "-o", str(exe)]
    built = subprocess.run(compile_, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-4000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and ran.stdout.endswith("0 failures\n"), ran.stdout[-4000:] + ran.stderr[-2000:]


def test_the_emulated_ops_have_their_own_namespace_and_leave_the_cpu_ops_alone():
    """The binding compiled for the CPU registers the CPU key of fused_optim_emulated_cuda only;
    fused_optim's CPU kernels stay csrc/cpu's. Inside emulated_cuda() the list ops and norms
    resolve to the emulated ones, everything else (the bucket registry) to fused_optim's."""
    _build.load_emulated_cuda()
    real, emulated = (torch._C._dispatch_dump(f"{ns}::adam_") for ns in ("fused_optim", _ops.EMULATED_CUDA))
    assert "cpu/adam.cpp" in real and "binding.cpp" not in real
    assert "CPU: registered at" in emulated and "cuda/binding.cpp" in emulated
    assert _ops.op("adam_") is torch.ops.fused_optim.adam_
    with fused_optim.testing.emulated_cuda():
        assert _ops.op("adam_") is torch.ops.fused_optim_emulated_cuda.adam_
        assert _ops.op("l2norm") is torch.ops.fused_optim_emulated_cuda.l2norm
        assert _ops.op("bucket_new") is torch.ops.fused_optim.bucket_new
    assert _ops.op("adam_") is torch.ops.fused_optim.adam_


# The sanitizers' runtime, preloaded into a Python process that loads a sanitized library.
SANITIZED = {_build.EMULATION_SANITIZERS_ENV: "address,undefined", "ASAN_OPTIONS": "detect_leaks=0",
             "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
# The emulated op tests run under them: every op on aligned and misaligned fp32 and misaligned
# fp16 tensors (the vector and the scalar paths, every launch sequence), with master weights (lists
# of mixed storage types), the overflow skip, norms.
SANITIZED_TESTS = "emulated and (fp32 or fp16-misaligned or master_weights or found_inf or l2norm or own_grads)"


def _sanitizer_reports(output: str) -> list[str]:
    return [line for line in output.splitlines() if "ERROR: AddressSanitizer" in line or "runtime error:" in line]


@pytest.mark.slow
def test_the_emulation_and_the_cuda_code_run_clean_under_address_and_undefined_behavior_sanitizers(tmp_path):
    """The emulation's checks, and the CUDA binding, launcher and kernels running a subset of the
    emulated op tests (in a process preloading the sanitizers' runtime, the emulated library built
    with -fsanitize=address,undefined: out-of-bounds and misaligned accesses, fiber stacks announced
    to AddressSanitizer), without a report."""
    libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    env = {**os.environ, **SANITIZED, "LD_PRELOAD": libasan}
    exe = tmp_path / "checks"
    built = subprocess.run(["g++", "-std=c++17", "-O0", "-U_FORTIFY_SOURCE", "-fsanitize=address,undefined",
                            "-fno-omit-frame-pointer", "-Wno-unknown-pragmas", "-I", str(_build.CSRC / "emulation"),
                            "-I", str(_build.CSRC / "cuda"), str(CHECKS), "-o", str(exe)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-4000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0 and not _sanitizer_reports(ran.stderr), ran.stdout[-2000:] + ran.stderr[-4000:]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SANITIZED_TESTS,
                            str(Path(__file__).with_name("test_cuda.py"))],
                           capture_output=True, text=True, timeout=1800, env=env, cwd=tmp_path)
    output = tests.stdout + tests.stderr
    assert tests.returncode == 0 and " passed" in tests.stdout and not _sanitizer_reports(output), output[-6000:]
