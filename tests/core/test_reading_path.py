"""docs/design.md's reading path lists the files one steady-state fp32 ``FusedAdam`` step on the
CPU runs through. Its Python files are those a traced step calls into, no more and no fewer; its
C++ files are adam.cpp and the headers it includes, but for those a plain step runs nothing of
(named here, so that a new include asks for a decision); its count says how many files the table
lists."""

import gc
import re
import sys
from pathlib import Path

import torch

import fused_optim

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
# Included by adam.cpp, not run by a plain fp32 step: the compact twin's state and arguments, the
# declarations of the kernels.
NOT_RUN = {"csrc/cpu/compact_state.h", "csrc/cpu/state_code_lanes.h", "csrc/host/compact_args.h",
           "csrc/shared/state_codes.h", "csrc/cpu/ops.h", "csrc/host/update_ops.h"}


def reading_path_section() -> str:
    text = DESIGN.read_text()
    section = text[text.index("## Reading path"):]
    return section[:section.index("\n## ", 1)]


def reading_path() -> list[str]:
    """The files of the reading path's table, in its order (a row may name two)."""
    files = []
    for row in re.findall(r"^\| \d+ \| (.+?) \|", reading_path_section(), flags=re.M):
        names = re.findall(r"`([^`]+)`", row)
        folder = str(Path(names[0]).parent)  # "`csrc/shared/adam_math.h`, `primitives.h`"
        files += [name if "/" in name else f"{folder}/{name}" for name in names]
    return files


def stepped_twice() -> fused_optim.FusedAdam:
    """An fp32 FusedAdam after two steps: the first made the state and the plan, the second ran
    the cached plan."""
    params = [torch.nn.Parameter(torch.randn(257)) for _ in range(3)]
    opt = fused_optim.FusedAdam(params, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    return opt


def python_files_of_a_steady_step() -> set[str]:
    """The modules of fused_optim (as ``fused_optim/<module>.py``) a third step calls functions of."""
    opt = stepped_twice()
    package = Path(fused_optim.__file__).parent  # the installed copy under `make test`
    called = set()

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(package):
                called.add((Path("fused_optim") / path.relative_to(package)).as_posix())

    gc.collect()  # no finalizer of an earlier test's objects runs inside the traced step
    gc.disable()
    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
        gc.enable()
    assert opt.implementation == "fused"
    return called


def included(path: Path, seen: set[Path]) -> set[Path]:
    """The files of the repository ``path`` includes with quoted includes, directly or not."""
    for name in re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M):
        target = (path.parent / name).resolve()
        if target not in seen and target.is_file():
            seen.add(target)
            included(target, seen)
    return seen


def test_the_python_files_of_the_reading_path_are_those_a_step_runs():
    listed = {f for f in reading_path() if f.endswith(".py")}
    assert python_files_of_a_steady_step() == listed


def test_a_steady_step_dispatches_the_bucket_twin_only():
    """No other op (bucket.cpp's bucket_new / bucket_grads_match, an ATen op) runs in the step:
    the C++ files of the path are the twin's and the kernel's."""
    opt = stepped_twice()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    ops = {e.name for e in prof.events() if "::" in e.name}
    assert ops == {"fused_optim::adam_bucket"}


def test_the_cpp_files_of_the_reading_path_are_the_kernel_and_what_it_includes():
    listed = {f for f in reading_path() if not f.endswith(".py")}
    kernel = ROOT / "csrc" / "cpu" / "adam.cpp"
    headers = {p.relative_to(ROOT).as_posix() for p in included(kernel, set())}
    assert listed == {"csrc/cpu/adam.cpp"} | (headers - NOT_RUN)
    assert NOT_RUN <= headers  # each still included (else it leaves this list)


def test_the_reading_path_counts_its_files():
    files = reading_path()
    assert len(files) == len(set(files)) and all((ROOT / f).is_file() for f in files), files
    python = sum(f.endswith(".py") for f in files)
    assert f"{len(files)} files: {python} Python, {len(files) - python} C++" in reading_path_section()
