"""The CUDA code compiles without a GPU: every kernel file with this machine's nvcc for every
targeted architecture (sm_80, sm_90), warnings as errors, without torch headers; and the torch
binding against this torch's headers. CI runs these wherever nvcc is present. (Running the
kernels needs a GPU: tests marked ``cuda``, in tests/test_cuda.py.)"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

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
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "kernel.o").stat().st_size > 0


def _cuda_include() -> Path | None:
    """The CUDA toolkit's include directory (CUDA_HOME, nvcc's toolkit, or /usr/local/cuda)."""
    candidates = [os.environ.get("CUDA_HOME"), NVCC and Path(NVCC).resolve().parent.parent, "/usr/local/cuda"]
    return next((Path(c) / "include" for c in candidates if c and (Path(c) / "include" / "cuda_runtime.h").is_file()),
                None)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or _cuda_include() is None,
                    reason="g++ and the CUDA toolkit's headers are needed to check the binding")
def test_binding_compiles_against_torch_and_cuda_headers(tmp_path):
    """The torch binding (binding.cpp) against this torch's headers, warnings as errors in our
    code. A CPU-only torch lacks one generated CUDA header (a single #define); it is stubbed."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), str(_cuda_include())]
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in includes):
        stub = tmp_path / "c10/cuda/impl/cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path))
    command = ["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
               *(flag for p in includes for flag in ("-isystem", p)), str(_build.CUDA_BINDING)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_the_cuda_build_without_a_gpu_says_why_and_leaves_the_cpu_kernels():
    with pytest.raises(_build.BuildError, match=r"could not build its CUDA kernels .*is_available\(\) is False"):
        _build.load("cuda")
    assert not _build.is_available("cuda") and _build.is_available("cpu")
    assert "CUDA kernels" in _build.build_error("cuda") and _build.build_error("cpu") is None
