"""The CUDA code compiles without a GPU: every kernel file with this machine's nvcc for every
targeted architecture (sm_80, sm_90), warnings as errors, without torch headers; and the torch
binding against this torch's headers. CI runs these wherever nvcc is present. With a CUDA build of
torch (``make check-cuda-build``), the whole CUDA library is built as the first fused CUDA step
builds it: compiled, linked, loaded, every CUDA op registered. (Running the kernels needs a GPU:
tests marked ``cuda``, in tests/emulation/test_cuda.py.)"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fused_optim import _build, cli

NVCC = shutil.which("nvcc")
BUILD_TIMEOUT = 1800  # catches a hang only: a cold CUDA build takes 2-3 minutes on 2 idle cores


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


@pytest.fixture
def fresh_cuda_library(monkeypatch, tmp_path):
    """This process's record of the CUDA library, new for the test and dropped after it (the error
    of a failed build is otherwise kept for the process's life); its build directory in tmp_path."""
    monkeypatch.setattr(_build, "_CUDA", _build._Library("CUDA", _build.cuda_extension_name, _build._cuda_build_args))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))


def test_the_cuda_build_on_a_torch_without_cuda_says_why_and_leaves_the_cpu_kernels(fresh_cuda_library, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(_build.BuildError, match=r"could not build its CUDA kernels .*is not a CUDA build"):
        _build.load("cuda")
    assert not _build.is_available("cuda") and _build.is_available("cpu")
    assert "CUDA kernels" in _build.build_error("cuda") and _build.build_error("cpu") is None


def test_the_cuda_build_without_a_gpu_or_an_arch_list_says_what_is_missing(fresh_cuda_library, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(_build.BuildError, match=r"is_available\(\) is False and TORCH_CUDA_ARCH_LIST is unset"):
        _build.load("cuda")


def test_the_architectures_are_part_of_the_cuda_cache_key(monkeypatch):
    """A build for other GPUs is never loaded: each architecture list names its own build."""
    names = set()
    for archs in ("8.0", "9.0", _build.CHECK_CUDA_ARCH_LIST):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
        assert _build.cuda_archs() == archs
        names.add(_build.cuda_extension_name())
    assert len(names) == 3 and _build.CHECK_CUDA_ARCH_LIST == "8.0;9.0"


def test_build_cuda_fails_naming_the_ops_left_without_a_cuda_kernel(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(_build, "check_cuda_build", lambda: ["adam_", "l2norm"])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # where the message says the library is
    assert cli.main(["build", "--cuda"]) == 1
    assert "registers no CUDA kernel for adam_, l2norm: add them to the TORCH_LIBRARY_IMPL" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is None or NVCC is None,
                    reason="needs a CUDA build of torch and nvcc (`make check-cuda-build` installs that torch)")
def test_the_cuda_library_compiles_links_and_registers_every_op():
    """`fused-optim build --cuda`: the library the first fused CUDA step builds (same sources,
    flags and cache), for the visible GPUs or, without one, sm_80 and sm_90; it exits non-zero
    when the build, the link, the load (every symbol resolved) or a CUDA op's registration fails."""
    out = subprocess.run([sys.executable, "-m", "fused_optim.cli", "build", "--cuda"], capture_output=True, text=True,
                         timeout=BUILD_TIMEOUT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"{len(_build.CUDA_OPS)} ops registered for CUDA" in out.stdout
