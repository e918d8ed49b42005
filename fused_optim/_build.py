"""Lazy, cached JIT build of the native kernels.

Nothing is compiled at import. The first fused step (or :func:`load`, ``fused-optim build``)
compiles ``csrc/cpu/*.cpp`` (grouped into one translation unit per core, see
:func:`translation_units`) with ``torch.utils.cpp_extension.load`` into a library that only
registers op implementations (no pybind). cpp_extension provides the file lock between processes
and rebuilds when sources or flags change; the result is cached under ``TORCH_EXTENSIONS_DIR``.

The extension name carries a CPU-ISA tag and the torch version, so a ``-march=native`` build made
on one CPU (or for one torch) is never loaded on another.

Environment:
    TORCH_EXTENSIONS_DIR         where builds are cached (torch's default: ~/.cache/torch_extensions)
    FUSED_OPTIM_VERBOSE_BUILD=1  print the compiler commands and output
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


class BuildError(RuntimeError):
    """The native kernels could not be built or loaded."""


def cpu_sources() -> list[str]:
    return sorted(str(p) for p in (CSRC / "cpu").glob("*.cpp"))


# The CUDA kernels (csrc/cuda/*.cu) need only CUDA headers, so they compile without a GPU and
# without torch: for every architecture we target, warnings as errors.
CUDA_ARCHS = ("80", "90")
NVCC_FLAGS = ["-std=c++17", "-O3", "--Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra",
              *(flag for arch in CUDA_ARCHS for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}"))]


def cuda_sources() -> list[str]:
    return sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))


def cuda_compile_command(nvcc: str, source: str, output: str) -> list[str]:
    """The nvcc command that compiles one kernel file to an object (the compile check)."""
    return [nvcc, *NVCC_FLAGS, "-c", source, "-o", output]


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


def extension_name() -> str:
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"fused_optim_cpu_{isa_tag()}_torch{version}"


def verbose() -> bool:
    return os.environ.get("FUSED_OPTIM_VERBOSE_BUILD", "") not in ("", "0")


def load() -> None:
    """Build (or load from cache) the CPU kernels; raise :class:`BuildError` saying how to debug."""
    if _state["loaded"]:  # the per-step fast path takes no lock (and stays traceable by dynamo)
        return
    with _lock:
        if _state["loaded"]:
            return
        if _state["error"] is not None:
            raise BuildError(_state["error"])
        from torch.utils import cpp_extension

        start = time.perf_counter()
        try:
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
        except Exception as exc:  # compiler missing, compile error, bad cache...
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = next((ln.strip() for ln in lines if "error" in ln.lower()), lines[-1])
            _state["error"] = (
                f"fused_optim could not build its CPU kernels ({type(exc).__name__}: {first}). "
                "Run `FUSED_OPTIM_VERBOSE_BUILD=1 fused-optim build` to see the full compiler log "
                f"(build directory: {build_directory()}); pass fused=False to use the pure-PyTorch "
                "implementation instead."
            )
            raise BuildError(_state["error"]) from exc
        _state["seconds"] = time.perf_counter() - start
        _state["loaded"] = True


def is_available() -> bool:
    """True when the CPU kernels are built and loaded (builds them on first call)."""
    try:
        load()
    except BuildError:
        return False
    return True


def build_error() -> str | None:
    """The message of a failed build, or None (no build attempted yet, or it succeeded)."""
    return _state["error"]


def build_seconds() -> float | None:
    """Wall time of the build/load in this process, or None before it happened."""
    return _state["seconds"]


def build_directory() -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(extension_name(), verbose=False)
