"""Lazy, cached JIT build of the native kernels.

Nothing is compiled at import. The first fused step (or :func:`load`, ``fused-optim build``)
compiles ``csrc/cpu/*.cpp`` (:data:`CSRC`, grouped into one translation unit per core, see
:func:`translation_units`) with ``torch.utils.cpp_extension.load`` into a library that only
registers op implementations (no pybind); the result is cached under ``TORCH_EXTENSIONS_DIR``.
The CUDA kernels (``csrc/cuda``: ``*.cu`` plus the binding) are a second library, built by
``load("cuda")`` — the first fused step on a CUDA tensor — with a CUDA build of torch, for the visible
GPUs' architectures or ``TORCH_CUDA_ARCH_LIST``. With that list set it needs no GPU: the library is
compiled, linked and loaded (loading needs no driver), so :func:`check_cuda_build` (``fused-optim
build --cuda``) proves the CUDA library builds on a machine without a GPU.
A third, the emulated CUDA library, is the same CUDA sources compiled for the CPU with the host
compiler and ``csrc/emulation`` first on the include path (:func:`load_emulated_cuda`, on the first
use of ``fused_optim.testing.emulated_cuda``); its ops take CPU tensors.

Cache key. The extension name, and with it the build directory, carries a CPU-ISA tag and the
torch version (CPU; a ``-march=native`` build made on one CPU, or for one torch, is never loaded
on another), or the torch and CUDA versions (CUDA), and a hash of what determines the binary
(:func:`content_tag`): the sources' content, the compiler flags, and the toolchain
(:func:`toolchain`: torch's full version and commit, the Python ABI, the compilers' ``--version``);
for CUDA, the flags include the GPU architectures compiled for (:func:`cuda_archs`), so a build
for other GPUs is never loaded. Install locations do not count: two venvs with the same torch and
sources share one build, and another compiler (``CXX``) builds beside the first one's build
instead of over it. ninja compiles copies of the sources staged in the build directory
(:func:`stage_sources`), each rewritten only when its content differs.

Integrity. After a successful build and load, a manifest (``MANIFEST``) records the size and
SHA-256 of each build output (the library and the objects). Before each build or load, every
output the manifest does not vouch for (truncated or zeroed on disk, left by a killed build, or
no manifest at all) is deleted. A library the manifest vouches for is loaded as it is (no
compiler, no ninja, whichever installation's headers: a cached load is the same in every venv);
anything else is built (ninja, going by mtimes, would not rebuild a damaged output: it is gone).
A failed build raises :class:`BuildError`, which ``fused=None`` turns into one warning and the
reference implementation.

Safety. Loading runs the library's code, and a build runs ``build.ninja``'s commands: before
either, :func:`cache_problem` checks, as ssh's StrictModes does, that nobody else can write in the
build directory or above it (owners, modes, symlinks), and a build directory that fails is refused
with a :class:`BuildError` saying what to fix. Folders we create are 0o755 and a build runs under
umask 0o022, so what we build passes the check.

Locking. Builds and loads of one extension are serialized by an ``flock`` on ``LOCK`` (mode
0o600, opened without following a symlink) in its build directory; the kernel releases it when
its holder dies. A process that waits for it longer than a cached load takes
(``QUIET_WAIT_SECONDS``) says whose build it waits for. Where cpp_extension's own lock file
(``CPP_EXTENSION_LOCK``) blocks by existing (a ``FileBaton``, up to torch 2.13), a killed build
never removes it and every later process would wait forever; found while holding the flock, it
can only be such a leftover, so it is removed. Newer torch flocks that file instead (it stays
after every build and blocks nobody once its holder is gone): it is left.

Messages: one line on stderr when any build starts (what, where, that it is one-time), then its
progress (units compiled of all, time elapsed: when a unit is done, and every
``PROGRESS_SECONDS``) and its time; one line when waiting for another process's build, and when
removing a stale lock; a cached load prints nothing. stderr rather than ``warnings`` or
``logging``: these report progress, not a problem, and must be seen by default — a warnings
filter (``-W error``, pytest's) could hide them or turn them into exceptions, and an unconfigured
logger drops INFO.

A build directory that cannot be created, locked or written (a read-only or invalid
``TORCH_EXTENSIONS_DIR``) raises :class:`BuildError` naming the directory and the fix.

Environment:
    TORCH_EXTENSIONS_DIR         where builds are cached (torch's default: ~/.cache/torch_extensions)
    CXX                          the host compiler (cpp_extension's default: c++); part of the cache key
    FUSED_OPTIM_VERBOSE_BUILD=1  print the compiler commands and output
    TORCH_CUDA_ARCH_LIST         the GPU architectures of the CUDA build (default: the visible GPUs')
    CUDA_HOME                    the CUDA toolkit (cpp_extension's default: nvcc's grandparent folder)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from . import _ops  # the schemas must exist before a library registers implementations


def sources_root(package: Path) -> Path:
    """Where the kernel sources of the package in folder ``package`` are: ``package/csrc`` when it is
    installed (the wheel puts the checkout's top-level ``csrc/`` there, see pyproject.toml's
    package-dir), else, running from a checkout, the ``csrc/`` next to the package."""
    installed = package / "csrc"
    return installed if installed.is_dir() else package.parent / "csrc"


CSRC = sources_root(Path(__file__).parent)
CFLAGS = ["-O3", "-fopenmp", "-march=native", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]
CUDA_JIT_FLAGS = ["-O3"]  # the JIT build's host and nvcc flags (cpp_extension picks the architectures)
SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
MANIFEST = "fused_optim_manifest.json"  # name -> [size, sha256] of each build output
LOCK = "fused_optim.lock"  # flock'ed while building or loading; holds its owner's pid and host
CPP_EXTENSION_LOCK = "lock"  # cpp_extension's lock file (a FileBaton up to torch 2.13, then flock'ed)
CPUINFO = Path("/proc/cpuinfo")
QUIET_WAIT_SECONDS = 5.0  # a wait for the build lock shorter than this is not reported

_lock = threading.Lock()


class BuildError(RuntimeError):
    """The native kernels could not be built or loaded."""


def cpu_sources() -> list[str]:
    return sorted(str(p) for p in (CSRC / "cpu").glob("*.cpp"))


# The CUDA kernels (csrc/cuda/*.cu) need only CUDA headers, so they compile without a GPU and
# without torch: the compile check builds them for every architecture we target, warnings as
# errors, with the language level and half/bfloat16 macros cpp_extension's JIT build uses. The JIT
# build adds only CUDA_JIT_FLAGS. `--threads 0`: one thread per core for the architectures'
# compilations.
CUDA_ARCHS = ("80", "90")
NVCC_FLAGS = ["-std=c++20", "-O3", "--Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra", "--threads", "0",
              *(flag for arch in CUDA_ARCHS for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}"))]
CUDA_BINDING = CSRC / "cuda" / "binding.cpp"
# The architectures of the CUDA build where torch sees no GPU (check_cuda_build): those above.
CHECK_CUDA_ARCH_LIST = ";".join(f"{arch[:-1]}.{arch[-1]}" for arch in CUDA_ARCHS)
# The ops binding.cpp registers for the CUDA key: the list ops and their compact twins (the bucket
# twins are composite: any device).
CUDA_OPS = (*_ops.UPDATE_OPS, *_ops.COMPACT_OPS, "l2norm", "sum_squares_")

# The emulated CUDA library: the binding registers the ops of _ops.EMULATED_CUDA for CPU tensors;
# _FORTIFY_SOURCE's longjmp would refuse the emulation's fiber switches (csrc/emulation/scheduler.h).
# -march=native: fma() an instruction, and a*b + c contracted to one, as nvcc does by default.
EMULATION_FLAGS = ["-march=native", "-U_FORTIFY_SOURCE", "-Wno-unknown-pragmas",
                   f"-DFUSED_OPTIM_CUDA_LIBRARY={_ops.EMULATED_CUDA}", "-DFUSED_OPTIM_CUDA_KEY=CPU"]
# Set to e.g. "address,undefined", a build of the emulated CUDA library of its own under those
# sanitizers (the process must preload their runtime: tests/emulation/test_cuda_emulation.py shows how).
EMULATION_SANITIZERS_ENV = "FUSED_OPTIM_EMULATION_SANITIZERS"


def emulation_flags() -> list[str]:
    """The emulated CUDA library's compile (and link) flags: -O2 and EMULATION_FLAGS, or with the
    sanitizers the environment asks for (EMULATION_SANITIZERS_ENV) -O0 (such a build compiles
    five times faster so, and its checks miss nothing)."""
    sanitizers = os.environ.get(EMULATION_SANITIZERS_ENV, "")
    if not sanitizers:
        return ["-O2", *EMULATION_FLAGS]
    return ["-O0", *EMULATION_FLAGS, f"-fsanitize={sanitizers}", "-fno-omit-frame-pointer"]


def cuda_sources() -> list[str]:
    return sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))


def cuda_compile_command(nvcc: str, source: str, output: str) -> list[str]:
    """The nvcc command that compiles one kernel file to an object (the compile check)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return [nvcc, *NVCC_FLAGS, *COMMON_NVCC_FLAGS, "-c", source, "-o", output]


# The folders under CSRC each build reads.
SOURCE_FOLDERS = {"cpu": ("cpu", "host", "shared"), "cuda": ("cuda", "host", "shared"),
                  "emulated_cuda": ("cuda", "emulation", "host", "shared")}


def source_files(kind: str) -> list[Path]:
    """The files a build of ``kind`` ("cpu", "cuda" or "emulated_cuda") reads, relative to ``CSRC``:
    those under its ``SOURCE_FOLDERS``."""
    return sorted(p.relative_to(CSRC) for folder in SOURCE_FOLDERS[kind] for p in (CSRC / folder).rglob("*")
                  if p.suffix in SOURCE_SUFFIXES)


def content_tag(kind: str, flags: list[str]) -> str:
    """A short hash of what determines a build's binary: the relative paths and bytes of
    :func:`source_files`, ``flags`` and :func:`toolchain`. Mtimes and install locations do not
    count, so two installations (e.g. two venvs) of the same torch and sources share one build."""
    digest = hashlib.sha256()
    for rel in source_files(kind):
        data = (CSRC / rel).read_bytes()
        digest.update(f"{rel.as_posix()}\0{len(data)}\0".encode() + data)
    digest.update("\0".join([*flags, "|", *toolchain(kind)]).encode())
    return digest.hexdigest()[:8]


def toolchain(kind: str) -> list[str]:
    """What a build of ``kind`` compiles with, besides the sources and flags: torch's full version
    and the commit it was built from (its headers are those of that build of torch), the Python
    ABI (cpp_extension puts Python's headers on the include path), and the compilers' identity
    (``--version``: the host compiler cpp_extension runs, ``$CXX`` or ``c++``, and nvcc for
    CUDA), so changing the compiler builds anew, beside the other compiler's build."""
    from torch.utils import cpp_extension

    parts = [torch.__version__, str(torch.version.git_version), sysconfig.get_config_var("SOABI") or sys.version,
             compiler_identity(cpp_extension.get_cxx_compiler())]
    if kind == "cuda":
        parts.append(compiler_identity(os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")))
    return parts


COMPILER_QUERY_SECONDS = 60  # `--version` answers in milliseconds; a compiler that hangs is not waited for


@lru_cache(maxsize=None)
def compiler_identity(compiler: str) -> str:
    """``compiler --version``'s output (its name, vendor and version), or why there is none."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=COMPILER_QUERY_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{compiler}: {type(exc).__name__}"
    return out.stdout.strip() if out.returncode == 0 else f"{compiler}: exit {out.returncode}"


def _torch_version() -> str:
    return torch.__version__.split("+")[0].replace(".", "_")


def extension_name() -> str:
    return f"fused_optim_cpu_{isa_tag()}_torch{_torch_version()}_{content_tag('cpu', [*CFLAGS, '|', *LDFLAGS])}"


def cuda_archs() -> str:
    """What cpp_extension chooses the CUDA build's GPU architectures from: TORCH_CUDA_ARCH_LIST, else
    the visible GPUs' compute capabilities ("" when there is neither: nothing to build for)."""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if listed and listed != "native":
        return listed
    return ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def cuda_extension_name() -> str:
    cuda = (torch.version.cuda or "none").replace(".", "_")
    tag = content_tag("cuda", [*CUDA_JIT_FLAGS, "|", cuda_archs()])
    return f"fused_optim_cuda_torch{_torch_version()}_cu{cuda}_{tag}"


def emulated_cuda_extension_name() -> str:
    tag = content_tag("emulated_cuda", emulation_flags())
    return f"fused_optim_emulated_cuda_{isa_tag()}_torch{_torch_version()}_{tag}"


def _write_if_changed(path: Path, data: bytes) -> None:
    """Write ``data`` unless ``path`` holds it already: an unchanged file keeps its mtime, so ninja
    does not recompile what includes it."""
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def stage_sources(kind: str, directory: Path) -> Path:
    """Copy :func:`source_files` of ``kind`` to ``directory/src`` (keeping their layout, so relative
    ``#include``s resolve) and return that folder. ninja compiles the copies."""
    root = directory / "src"
    for rel in source_files(kind):
        _write_if_changed(root / rel, (CSRC / rel).read_bytes())
    return root


# The CPU sources' compile times, less the headers every unit pays (~5 s: ATen, torch/library.h):
# seconds at -O3 on an AMD EPYC (g++ 12), two files compiling at a time as the build's two units
# do; sources not listed ~2 s (UNLISTED_COMPILE_SECONDS). Each file's registrations (boxed
# wrappers of its kernels and bucket twins) are part of its time.
# translation_units balances the units by them; a stale number costs build time, never correctness.
COMPILE_SECONDS = {"sgd.cpp": 51.0, "lamb.cpp": 36.0, "adam.cpp": 12.0, "adagrad.cpp": 8.5, "lion.cpp": 8.5,
                   "lars.cpp": 5.5, "grad_norms.cpp": 4.0, "sparsified_sgd.cpp": 3.5}
UNLISTED_COMPILE_SECONDS = 2.0


def translation_units(sources: list[str], directory: Path) -> list[str]:
    """The files to compile: one per core, each ``#include``-ing a share of ``sources``.

    Most of a small kernel file's compile time is the headers (~5 s), so on 2 cores two
    units build about twice as fast as one per file. The shares are balanced by
    :data:`COMPILE_SECONDS` (longest first, each to the unit with the least so far); a unit
    includes its files in name order. ninja's header dependencies still cover the included files,
    so editing any of them rebuilds. (Names in anonymous namespaces must therefore be unique across
    csrc/cpu.)
    """
    count = max(1, min(len(sources), os.cpu_count() or 1))
    seconds = {src: COMPILE_SECONDS.get(Path(src).name, UNLISTED_COMPILE_SECONDS) for src in sources}
    shares: list[list[str]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for src in sorted(sources, key=lambda s: (-seconds[s], s)):
        k = loads.index(min(loads))
        shares[k].append(src)
        loads[k] += seconds[src]
    units = []
    for k, share in enumerate(shares):
        path = directory / f"unit{k}.cpp"
        _write_if_changed(path, "".join(f'#include "{src}"\n' for src in sorted(share)).encode())
        units.append(str(path))
    return units


def _cpuinfo_field(*keys: str) -> str | None:
    """The value of the first line of ``CPUINFO`` whose key is one of ``keys`` (None: none, or no
    such file)."""
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def isa_tag() -> str:
    """ATen's CPU capability plus a short hash of the CPU's feature flags (what -march=native sees)."""
    flags = _cpuinfo_field("flags", "Features") or platform.processor() or platform.machine()
    digest = hashlib.sha1(flags.encode()).hexdigest()[:8]
    return f"{torch.backends.cpu.get_cpu_capability().lower()}_{digest}"


def cpu_description() -> str:
    """The machine a CPU measurement ran on: the CPU model (/proc/cpuinfo), ATen's CPU capability
    (the widest vector ISA its kernels use, e.g. AVX2, AVX512) and torch's thread count."""
    model = _cpuinfo_field("model name", "Model", "Hardware") or platform.processor() or platform.machine()
    return (f"{model}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")


def verbose() -> bool:
    return os.environ.get("FUSED_OPTIM_VERBOSE_BUILD", "") not in ("", "0")


def _say(message: str) -> None:
    """One line of build progress on stderr (see the module docstring for why stderr)."""
    print(f"fused_optim: {message}", file=sys.stderr, flush=True)


def _cpu_build_args(directory: Path) -> dict:
    """Stage the CPU sources in ``directory``; cpp_extension.load's arguments for them."""
    src = stage_sources("cpu", directory)
    units = translation_units(sorted(str(p) for p in (src / "cpu").glob("*.cpp")), directory / "units")
    # Copies of the flag lists: cpp_extension.load appends torch's libraries to extra_ldflags.
    return dict(sources=units, extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                extra_include_paths=[str(src / "cpu")], with_cuda=False)


def _cuda_build_args(directory: Path) -> dict:
    """Stage the CUDA sources in ``directory``; cpp_extension.load's arguments for them."""
    if torch.version.cuda is None:
        raise RuntimeError(f"error: torch {torch.__version__} is not a CUDA build (torch.version.cuda is None)")
    if not cuda_archs():
        raise RuntimeError("error: torch.cuda.is_available() is False and TORCH_CUDA_ARCH_LIST is unset: no GPU "
                           "architecture to build for")
    src = stage_sources("cuda", directory)
    sources = [*sorted(str(p) for p in (src / "cuda").glob("*.cu")), str(src / CUDA_BINDING.relative_to(CSRC))]
    return dict(sources=sources, extra_cflags=list(CUDA_JIT_FLAGS), extra_cuda_cflags=list(CUDA_JIT_FLAGS),
                with_cuda=True)


def _emulated_cuda_build_args(directory: Path) -> dict:
    """Stage the CUDA sources and the emulation headers in ``directory``; cpp_extension.load's
    arguments for them: each kernel file as a C++ unit of its own (as nvcc compiles them), the
    binding, the emulation headers first on the include path."""
    src = stage_sources("emulated_cuda", directory)
    units = []
    for kernel in sorted((src / "cuda").glob("*.cu")):
        unit = directory / "units" / f"{kernel.stem}.cpp"
        _write_if_changed(unit, f'#include "{kernel}"\n'.encode())
        units.append(str(unit))
    flags = emulation_flags()
    return dict(sources=[*units, str(src / CUDA_BINDING.relative_to(CSRC))], extra_cflags=flags,
                extra_ldflags=[f for f in flags if f.startswith("-fsanitize")],
                extra_include_paths=[str(src / "emulation")], with_cuda=False)


@dataclass
class _Library:
    """One native library: its label in messages, its name, how to stage it, and this process's
    record of it (``error``: the message of a failed build; ``seconds``: the build/load time)."""

    kind: str
    name: Callable[[], str]
    build_args: Callable[[Path], dict]
    loaded: bool = False
    error: str | None = None
    seconds: float | None = None


_CPU = _Library("CPU", extension_name, _cpu_build_args)
_CUDA = _Library("CUDA", cuda_extension_name, _cuda_build_args)
_EMULATED_CUDA = _Library("emulated CUDA", emulated_cuda_extension_name, _emulated_cuda_build_args)


def load(device_type: str = "cpu") -> None:
    """Build (or load from cache) the CPU kernels, and for ``"cuda"`` the CUDA kernels too; raise
    :class:`BuildError` saying how to debug."""
    _load_library(_CPU)
    if device_type == "cuda":
        _load_library(_CUDA)


def load_emulated_cuda() -> None:
    """Build (or load from cache) the emulated CUDA library, the implementations of the ops of
    ``torch.ops.fused_optim_emulated_cuda``; raise :class:`BuildError` saying how to debug."""
    _ops.define_emulated_cuda_ops()
    _load_library(_EMULATED_CUDA)


def _load_library(lib: _Library) -> None:
    if lib.loaded:  # the per-step fast path takes no lock (and stays traceable by dynamo)
        return
    with _lock:
        if lib.loaded:
            return
        if lib.error is not None:
            raise BuildError(lib.error)
        start = time.perf_counter()
        name = lib.name()
        directory = extension_directory(name)
        umask = os.umask(0o022)
        os.umask(umask | 0o022)  # what the build writes is writable by us only (see cache_problem)
        try:
            try:
                make_private_directory(directory)
                lock = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except OSError as exc:  # TORCH_EXTENSIONS_DIR read-only, under a file, ...
                raise BuildError(unusable_directory_message(exc)) from exc
            try:
                _build_and_load(lib, name, directory, lock)
            finally:
                os.close(lock)  # releases the flock
        except BuildError as exc:
            lib.error = str(exc)
            raise
        except Exception as exc:  # compiler missing, compile error, bad cache...
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = next((ln.strip() for ln in lines if "error" in ln.lower()), lines[-1])
            lib.error = (
                f"fused_optim could not build its {lib.kind} kernels ({type(exc).__name__}: {first}). "
                "Run `FUSED_OPTIM_VERBOSE_BUILD=1 fused-optim build` to see the full compiler log "
                f"(build directory: {directory}); pass fused=False to use the pure-PyTorch "
                "implementation instead."
            )
            raise BuildError(lib.error) from exc
        finally:
            os.umask(umask)
        lib.seconds = time.perf_counter() - start
        lib.loaded = True


def _build_and_load(lib: _Library, name: str, directory: Path, lock: int) -> None:
    """Under the flock on ``lock``: clear a stale cpp_extension lock, delete unverified outputs;
    load the library when the manifest vouches for it (no compiler, no ninja), else stage the
    sources and build (announced, with progress), load, record the manifest."""
    from torch.utils import cpp_extension

    try:
        _lock_exclusively(lock, f"{lib.kind} kernels in {directory}")
        _remove_stale_cpp_extension_lock(directory)
        damaged = remove_unverified_outputs(directory, name)
    except OSError as exc:
        raise BuildError(unusable_directory_message(exc)) from exc
    if manifest_vouches_for_library(directory, name):
        torch.ops.load_library(str(library_path(directory, name)))
        return
    if damaged:
        _say(f"rebuilding the {lib.kind} kernels in {directory}: the cached {', '.join(damaged)} failed its "
             "integrity check")
    else:
        _say(f"building the {lib.kind} kernels (a one-time step of a minute or more; later runs load the cached "
             f"build) in {directory}")
    try:
        args = lib.build_args(directory)
    except OSError as exc:
        raise BuildError(unusable_directory_message(exc)) from exc
    with _ninja_on_path(), _progress(directory, len(args["sources"])):
        cpp_extension.load(name=name, build_directory=str(directory), is_python_module=False, verbose=verbose(),
                           **args)
    write_manifest(directory, name)


PROGRESS_SECONDS = 30.0  # while no unit completes, a progress line this often


@contextmanager
def _progress(directory: Path, units: int):
    """While a build runs: a line each time a unit's object is written, and every
    ``PROGRESS_SECONDS`` without one, with the units compiled so far, their count and the time
    elapsed; at the end, the build's time."""
    start, start_ns = time.monotonic(), time.time_ns()
    done = threading.Event()

    def compiled() -> int:
        return sum(1 for p in directory.glob("*.o") if (st := _lstat(p)) is not None and st.st_mtime_ns >= start_ns)

    def watch() -> None:
        reported, last = 0, start
        while not done.wait(0.5):
            count, now = compiled(), time.monotonic()
            if count != reported or now - last >= PROGRESS_SECONDS:
                _say(f"compiled {count} of {units} units ({now - start:.0f} s)")
                reported, last = count, now

    watcher = threading.Thread(target=watch, name="fused_optim build progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
    _say(f"built in {time.monotonic() - start:.0f} s")


@contextmanager
def _ninja_on_path():
    """cpp_extension runs ``ninja`` from PATH; where there is none there, the one installed next to
    this Python (a venv's, used without activating the venv) is put first on PATH for the build."""
    beside = Path(sys.executable).parent
    if shutil.which("ninja") is not None or shutil.which("ninja", path=str(beside)) is None:
        yield
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (str(beside), path) if p)
    try:
        yield
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_exclusively(fd: int, what: str) -> None:
    """flock ``fd``, waiting for its holder; when that takes longer than a cached load does
    (``QUIET_WAIT_SECONDS``: concurrent DDP ranks loading one build wait silently), say whose
    build we wait for first. Record our pid and host for the next waiter."""
    deadline = time.monotonic() + QUIET_WAIT_SECONDS
    while not _try_flock(fd):
        if time.monotonic() > deadline:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            _say(f"waiting for {owner}, which is building or loading the {what}")
            fcntl.flock(fd, fcntl.LOCK_EX)
            break
        time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)


def cpp_extension_lock_blocks() -> bool:
    """Whether cpp_extension's lock file blocks by existing (a ``FileBaton``) rather than being
    flock'ed (torch >= 2.14; the file then stays after every build)."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def _remove_stale_cpp_extension_lock(directory: Path) -> None:
    """Remove cpp_extension's lock file where it blocks by existing: only a killed build leaves it
    while we hold the flock."""
    baton = directory / CPP_EXTENSION_LOCK
    if cpp_extension_lock_blocks() and baton.exists():
        _say(f"removing the stale lock {baton} left by a build that was killed")
        baton.unlink()


def library_path(directory: Path, name: str) -> Path:
    """The library cpp_extension links for the extension ``name`` in ``directory``."""
    from torch.utils.cpp_extension import LIB_EXT

    return directory / f"{name}{LIB_EXT}"


def _outputs(directory: Path, name: str) -> list[Path]:
    """The build outputs that exist: the library and the objects."""
    return [p for p in [library_path(directory, name), *sorted(directory.glob("*.o"))] if p.is_file()]


def _fingerprint(path: Path) -> list:
    data = path.read_bytes()
    return [len(data), hashlib.sha256(data).hexdigest()]


def _read_manifest(directory: Path) -> dict:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def write_manifest(directory: Path, name: str) -> None:
    """Record the fingerprints of the outputs of a build that just loaded (atomically; not at all
    when the manifest holds them already, as after a cached load)."""
    fingerprints = {p.name: _fingerprint(p) for p in _outputs(directory, name)}
    if _read_manifest(directory) != fingerprints:
        tmp = directory / f"{MANIFEST}.{os.getpid()}"
        tmp.write_text(json.dumps(fingerprints))
        os.replace(tmp, directory / MANIFEST)


def remove_unverified_outputs(directory: Path, name: str) -> list[str]:
    """Delete each build output whose size and SHA-256 the manifest does not record (all of them
    when there is no manifest), so ninja remakes it. Return the names of those the manifest did
    list: outputs damaged since they were built."""
    recorded = _read_manifest(directory)
    unverified = [p for p in _outputs(directory, name) if recorded.get(p.name) != _fingerprint(p)]
    for path in unverified:
        path.unlink()
    return [p.name for p in unverified if p.name in recorded]


def manifest_vouches_for_all(directory: Path) -> bool:
    """True when a manifest exists and every output it lists is present: loading needs no compile
    (after :func:`remove_unverified_outputs`, a present output is a verified one)."""
    recorded = _read_manifest(directory)
    return bool(recorded) and all((directory / name).is_file() for name in recorded)


def manifest_vouches_for_library(directory: Path, name: str) -> bool:
    """:func:`manifest_vouches_for_all`, and the manifest lists the library of ``name``: a build
    that loads without compiling or linking anything."""
    return manifest_vouches_for_all(directory) and library_path(directory, name).name in _read_manifest(directory)


def unusable_directory_message(exc: OSError) -> str:
    """The BuildError text for a build directory that cannot be created, locked or written."""
    return (f"fused_optim cannot use its build cache directory {extensions_root()} ({type(exc).__name__}: {exc}). "
            "Set TORCH_EXTENSIONS_DIR to a writable directory, or pass fused=False to use the pure-PyTorch "
            "implementation instead.")


def check_cuda_build() -> list[str]:
    """Build (or load from cache) the CUDA library as the first fused CUDA step does, and return the
    ops of :data:`CUDA_OPS` still without a kernel for the CUDA key (none: the build is complete).

    Where torch sees no GPU, the build is for TORCH_CUDA_ARCH_LIST, set to
    :data:`CHECK_CUDA_ARCH_LIST` when unset (in this process's environment, which cpp_extension
    reads). Loading resolves every symbol (dlopen with RTLD_NOW) and runs the registrations; no
    driver is needed for either. Raises :class:`BuildError` as :func:`load` does.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", CHECK_CUDA_ARCH_LIST)
    load("cuda")
    return [op for op in CUDA_OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_optim::{op}", "CUDA")]


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
    return _CPU.error or (_CUDA.error if device_type == "cuda" else None)


def build_seconds() -> float | None:
    """Wall time of the build/load in this process, or None before it happened."""
    return _CPU.seconds


def extensions_root() -> str:
    """The folder builds are cached under: TORCH_EXTENSIONS_DIR, or torch's default."""
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def extension_directory(name: str) -> Path:
    """Where the extension ``name`` is built and cached, as cpp_extension places it: in
    TORCH_EXTENSIONS_DIR, else in a folder per Python and accelerator of torch's default root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                       f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(extensions_root(), f"{python}_{accelerator}")
    return Path(os.path.abspath(root)) / name


def build_directory(name: str | None = None) -> str:
    """Where the extension ``name`` (default: the CPU one) is built and cached (created if missing)."""
    directory = extension_directory(name or extension_name())
    make_private_directory(directory)
    return str(directory)


def make_private_directory(directory: Path) -> None:
    """Create ``directory`` and its missing parents writable by us only (0o755), then check that
    nobody else can write in it or above it (:func:`cache_problem`); raise :class:`BuildError`
    naming the problem otherwise."""
    problem = cache_problem(directory)  # before creating anything in a folder others could write
    if problem is None:
        missing = [p for p in (directory, *directory.parents) if not os.path.lexists(p)]
        for folder in reversed(missing):
            os.mkdir(folder, 0o755)
        problem = cache_problem(directory)
    if problem is not None:
        raise BuildError(unsafe_directory_message(directory, problem))


def cache_problem(directory: Path) -> str | None:
    """Why others could put code in the build ``directory`` (None: they cannot), the checks of
    ssh's StrictModes: the folders above it pass :func:`parents_problem`; a symlink on the way
    must belong to us or root; the directory and everything in it must belong to us, be writable
    by us only, and hold no symlink. Only existing paths are checked."""
    uid = os.geteuid()
    for part in [*reversed(directory.parents), directory]:  # the path as given: its symlinks
        st = _lstat(part)
        if st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid not in (uid, 0):
            return f"{part} is a symlink owned by uid {st.st_uid}"
    real = Path(os.path.realpath(directory))
    problem = parents_problem(real)
    if problem is not None:
        return problem
    if not real.exists():
        return None
    for folder, subfolders, files in os.walk(real):
        for path in [Path(folder), *(Path(folder) / n for n in subfolders + files)]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                return f"{path} is a symlink"
            if st.st_uid != uid:
                return f"{path} is owned by uid {st.st_uid}"
            if st.st_mode & 0o022:
                return f"{path} is writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def parents_problem(path: Path) -> str | None:
    """Why others could replace what is in the folder ``path`` (a real path) through a folder
    above it (None: they cannot): each existing one must belong to us or root and, when group or
    others may write in it, carry the sticky bit (they cannot rename our entries then)."""
    uid = os.geteuid()
    for part in reversed(path.parents):
        st = _lstat(part)
        if st is None:
            continue
        if st.st_uid not in (uid, 0):
            return f"{part} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{part} is writable by group or others (mode {stat.filemode(st.st_mode)}) without the sticky bit"
    return None


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def unsafe_directory_message(directory: Path, problem: str) -> str:
    """The BuildError text for a build directory that others could write code into."""
    return (f"fused_optim refuses to build or load its kernels in {directory}: {problem}, so another user could "
            "put code there that this process would run. Make the folders yours and writable by you only "
            "(chown, chmod go-w), or set TORCH_EXTENSIONS_DIR to a folder only you can write; or pass fused=False "
            "to use the pure-PyTorch implementation instead.")


def cached_state(name: str | None = None) -> tuple[str, str | None]:
    """Without building or creating anything: ("loaded" | "built" | "not built yet" | "unusable",
    a problem's message or None) for the extension ``name`` (default: the CPU one)."""
    name = name or extension_name()
    lib = next((lib for lib in (_CPU, _CUDA, _EMULATED_CUDA) if lib.loaded and lib.name() == name), None)
    if lib is not None:
        return "loaded", None
    directory = extension_directory(name)
    existing = next(p for p in (directory, *directory.parents) if os.path.lexists(p))
    if not existing.is_dir():
        return "unusable", unusable_directory_message(NotADirectoryError(f"{existing} is not a directory"))
    problem = cache_problem(directory)
    if problem is not None:
        return "unusable", unsafe_directory_message(directory, problem)
    return ("built" if manifest_vouches_for_library(directory, name) else "not built yet"), None
