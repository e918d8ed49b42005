"""The CPU kernels compile on every x86-64 SIMD path, whichever one this machine's -march=native
build takes. The kernels choose their code at compile time (csrc/cpu/multi_tensor.h,
state_code_lanes.h, fixed_order_sums.h): AVX-512 with and without AVX512-BF16, AVX2 (with FMA), and
neither (at::vec's default vectors). The build compiles only this CPU's path; here the compiler
checks the others, targeting each with an -march a user's CPU would set (gcc needs no such CPU to
compile for it).

Each check is ``-fsyntax-only`` of one translation unit that includes every kernel source whose
code depends on the path (those that include multi_tensor.h), with the build's flags, warnings as
errors in our code, and an ``#error`` unless the path compiled is the one expected. That catches
a path that does not compile (an identifier, type or overload that exists only on another path, a
template that does not instantiate at another vector width) or that the -march no longer selects.
It does not generate code, so it does not catch an intrinsic used on a path whose -march lacks
its instruction set (gcc reports that when inlining); the builds of a sweep do.
"""

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fused_optim import _build

# name: (the -march flags of a CPU with that path, the preprocessor condition of that path)
PATHS = {
    "avx512_bf16": (["-march=x86-64-v4", "-mavx512bf16"], "defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)"),
    "avx512": (["-march=x86-64-v4"], "defined(CPU_CAPABILITY_AVX512) && !defined(__AVX512BF16__)"),
    "avx2": (["-march=x86-64-v3"], "defined(CPU_CAPABILITY_AVX2)"),
    "default": (["-march=x86-64-v2"], "!defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)"),
}
SIMD_HEADER = "multi_tensor.h"
TIMEOUT = 900  # catches a hang only: the four checks take ~18 s together on 2 idle cores, ~60 s loaded


def _includes(path: Path, name: str, seen: set[Path]) -> bool:
    """Whether ``path`` includes the file called ``name``, directly or through the quoted includes
    of csrc."""
    for include in re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M):
        target = (path.parent / include).resolve()
        if target.name == name:
            return True
        if target not in seen and target.is_file():
            seen.add(target)
            if _includes(target, name, seen):
                return True
    return False


def simd_sources() -> list[str]:
    return [s for s in _build.cpu_sources() if _includes(Path(s), SIMD_HEADER, set())]


def test_the_checked_sources_are_the_vectorized_kernels():
    names = {Path(s).name for s in simd_sources()}
    assert {"adam.cpp", "lamb.cpp", "lars.cpp", "sgd.cpp", "norm.cpp"} <= names
    assert "bucket.cpp" not in names


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
                    reason="the SIMD paths checked are x86-64's, compiled with the host's c++")
def test_the_kernels_compile_on_every_x86_simd_path(tmp_path):
    from torch.utils import cpp_extension

    # The build's flags (cpp_extension adds -std=c++20 and the torch headers) with each path's
    # -march. -Wno-psabi: without AVX, gcc notes that the 32-byte lane vectors (state_code_lanes.h)
    # would be passed differently between objects built for other ISAs; they are always inlined
    # within one library.
    flags = ["-std=c++20", *(f for f in _build.CFLAGS if not f.startswith("-march")), "-fsyntax-only",
             "-Wall", "-Wextra", "-Werror", "-Wno-psabi",
             *(flag for p in cpp_extension.include_paths() for flag in ("-isystem", p))]
    includes = "".join(f'#include "{s}"\n' for s in simd_sources())
    checks = {}
    for name, (march, condition) in PATHS.items():
        unit = tmp_path / f"{name}.cpp"
        unit.write_text(f"{includes}#if !({condition})\n#error {' '.join(march)} did not compile the {name} path\n#endif\n")
        checks[name] = subprocess.Popen(["c++", *flags, *march, str(unit)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
    failed = {}
    for name, process in checks.items():
        _, err = process.communicate(timeout=TIMEOUT)
        if process.returncode != 0:
            failed[name] = err[-3000:]
    assert not failed, "\n\n".join(f"{name} path:\n{err}" for name, err in failed.items())
