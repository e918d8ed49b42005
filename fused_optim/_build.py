"""Lazy, cached JIT build of the native kernels.

Nothing is compiled at import. The first fused step (or :func:`load`, ``fused-optim build``)
compiles ``csrc/cpu/*.cpp`` (grouped into one translation unit per core, see
:func:`translation_units`) with ``torch.utils.cpp_extension.load`` into a library that only
registers op implementations (no pybind). cpp_extension provides the file lock between processes
and rebuilds when sources or flags change; the result is cached under ``TORCH_EXTENSIONS_DIR``.
The CUDA kernels (``csrc/cuda``: ``*.cu`` plus the binding) are a second library, built by
``load("cuda")`` — the first fused step on a CUDA tensor — and only when ``torch.cuda.is_available()``.

The CPU extension name carries a CPU-ISA tag and the torch version, so a ``-march=native`` build
made on one CPU (or for one torch) is never loaded on another; the CUDA one carries the torch and
CUDA versions (cpp_extension compiles for the visible GPUs' architectures, or TORCH_CUDA_ARCH_LIST).
Both carry a hash of the sources' location (:func:`tree_tag`).

Environment:
    TORCH_EXTENSIONS_DIR         where builds are cached (torch's default: ~/.cache/torch_extensions)
    FUSED_OPTIM_VERBOSE_BUILD=1  print the compiler commands and output
    TORCH_CUDA_ARCH_LIST         the GPU architectures of the CUDA build (default: the visible GPUs')
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time
from pathlib import Path

import torch

from . import _ops  # noqa: F401  (schemas must exist before the library registers impls)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-fopenmp", "-march=native", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict = {"loaded": False, "error": None, "seconds": None}
_cuda_state: dict = {"loaded": False, "error": None, "seconds": None}


class BuildError(RuntimeError):
    """The native kernels could not be built or loaded."""


def cpu_sources() -> list[str]:
    return sorted(str(p) for p in (CSRC / "cpu").glob("*.cpp"))


# The CUDA kernels (csrc/cuda/*.cu) need only CUDA headers, so they compile without a GPU and
# without torch: the compile check builds them for every architecture we target, warnings as
# errors, with the language level and half/bfloat16 macros cpp_extension's JIT build uses. The JIT
# build adds only -O3 (cpp_extension picks the architectures). `--threads 0`: one thread per core
# for the architectures' compilations.
CUDA_ARCHS = ("80", "90")
NVCC_FLAGS = ["-std=c++20", "-O3", "--Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra", "--threads", "0",
              *(flag for arch in CUDA_ARCHS for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}"))]
CUDA_BINDING = CSRC / "cuda" / "binding.cpp"


def cuda_sources() -> list[str]:
    return sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))


def cuda_compile_command(nvcc: str, source: str, output: str) -> list[str]:
    """The nvcc command that compiles one kernel file to an object (the compile check)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return [nvcc, *NVCC_FLAGS, *COMMON_NVCC_FLAGS, "-c", source, "-o", output]


def cuda_extension_name() -> str:
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"fused_optim_cuda_torch{version}_cu{(torch.version.cuda or 'none').replace('.', '_')}_{tree_tag()}"


def translation_units(directory: Path) -> list[str]:
    """The files to compile: one per core, each ``#include``-ing a share of ``cpu_sources()``.

    Most of a kernel file's compile time is the ATen headers (~4.5 s), so on 2 cores two units
    build about twice as fast as one per file. ninja's header dependencies still cover the
    included files, so editing any of them rebuilds. (Names in anonymous namespaces must therefore
    be unique across csrc/cpu.) A unit is rewritten only when its text changes.
    """
    sources = cpu_sources()
    count = max(1, min(len(sources), os.cpu_count() or 1))
    directory.mkdir(parents=True, exist_ok=True)
    units = []
    for k in range(count):
        path = directory / f"unit{k}.cpp"
        text = "".join(f'#include "{src}"\n' for src in sources[k::count])
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        units.append(str(path))
    return units


def isa_tag() -> str:
    """ATen's CPU capability plus a short hash of the CPU's feature flags (what -march=native sees)."""
    flags = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    digest = hashlib.sha1(flags.encode()).hexdigest()[:8]
    return f"{torch.backends.cpu.get_cpu_capability().lower()}_{digest}"


def tree_tag() -> str:
    """A short hash of where the sources are. Each source tree gets its own build: the translation
    units name the sources by path, so a repo checkout and an installed copy sharing one build
    directory would rebuild it (~25 s) every time a process of the other one loads it."""
    return hashlib.sha1(str(CSRC.resolve()).encode()).hexdigest()[:6]


def extension_name() -> str:
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"fused_optim_cpu_{isa_tag()}_torch{version}_{tree_tag()}"


def verbose() -> bool:
    return os.environ.get("FUSED_OPTIM_VERBOSE_BUILD", "") not in ("", "0")


def load(device_type: str = "cpu") -> None:
    """Build (or load from cache) the CPU kernels, and for ``"cuda"`` the CUDA kernels too; raise
    :class:`BuildError` saying how to debug."""
    _load_library(_state, "CPU", _build_cpu, extension_name)
    if device_type == "cuda":
        _load_library(_cuda_state, "CUDA", _build_cuda, cuda_extension_name)


def _build_cpu(cpp_extension) -> None:
    cpp_extension.load(
        name=extension_name(),
        sources=translation_units(Path(build_directory()) / "units"),
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        extra_include_paths=[str(CSRC / "cpu")],
        is_python_module=False,
        with_cuda=False,
        verbose=verbose(),
    )


def _build_cuda(cpp_extension) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("error: torch.cuda.is_available() is False (no GPU, or a CPU-only torch)")
    cpp_extension.load(
        name=cuda_extension_name(),
        sources=[*cuda_sources(), str(CUDA_BINDING)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        is_python_module=False,
        with_cuda=True,
        verbose=verbose(),
    )


def _load_library(state: dict, kind: str, build, name) -> None:
    if state["loaded"]:  # the per-step fast path takes no lock (and stays traceable by dynamo)
        return
    with _lock:
        if state["loaded"]:
            return
        if state["error"] is not None:
            raise BuildError(state["error"])
        from torch.utils import cpp_extension

        start = time.perf_counter()
        try:
            build(cpp_extension)
        except Exception as exc:  # compiler missing, compile error, bad cache...
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = next((ln.strip() for ln in lines if "error" in ln.lower()), lines[-1])
            state["error"] = (
                f"fused_optim could not build its {kind} kernels ({type(exc).__name__}: {first}). "
                "Run `FUSED_OPTIM_VERBOSE_BUILD=1 fused-optim build` to see the full compiler log "
                f"(build directory: {build_directory(name())}); pass fused=False to use the pure-PyTorch "
                "implementation instead."
            )
            raise BuildError(state["error"]) from exc
        state["seconds"] = time.perf_counter() - start
        state["loaded"] = True


def is_available(device_type: str = "cpu") -> bool:
    """True when the kernels for ``device_type`` ("cpu" or "cuda") are built and loaded (builds
    them on first call)."""
    try:
        load(device_type)
    except BuildError:
        return False
    return True


def build_error(device_type: str = "cpu") -> str | None:
    """The message of a failed build, or None (no build attempted yet, or it succeeded)."""
    return _state["error"] or (_cuda_state["error"] if device_type == "cuda" else None)


def build_seconds() -> float | None:
    """Wall time of the build/load in this process, or None before it happened."""
    return _state["seconds"]


def build_directory(name: str | None = None) -> str:
    """Where the extension ``name`` (default: the CPU one) is built and cached."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name or extension_name(), verbose=False)
