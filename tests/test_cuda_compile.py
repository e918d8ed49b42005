"""The CUDA kernels compile with this machine's nvcc for every targeted architecture (sm_80,
sm_90), warnings as errors, without a GPU and without torch headers: the check CI runs wherever
nvcc is present. (Running them needs a GPU: tests marked ``cuda``.)"""

import shutil
import subprocess
from pathlib import Path

import pytest

from fused_optim import _build

NVCC = shutil.which("nvcc")


def test_the_compile_targets_every_arch():
    command = _build.cuda_compile_command("nvcc", "k.cu", "k.o")
    assert {"arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90"} <= set(command)
    assert "sgd.cu" in {Path(s).name for s in _build.cuda_sources()}


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: the compile check needs the CUDA toolkit")
@pytest.mark.parametrize("source", _build.cuda_sources(), ids=lambda s: Path(s).name)
def test_kernel_file_compiles_for_every_arch(source, tmp_path):
    out = subprocess.run(_build.cuda_compile_command(NVCC, source, str(tmp_path / "kernel.o")),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "kernel.o").stat().st_size > 0
