"""docs/design.md's reading path lists the files one steady-state fp32 ``FusedAdam`` step on the
CPU runs through. Its Python files are those a traced step calls into, no more and no fewer, and
its count says how many files the table lists."""

import re
import sys
from pathlib import Path

import torch

import fused_optim

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"


def reading_path() -> list[str]:
    """The files of the reading path's table, in its order (a row may name two)."""
    text = DESIGN.read_text()
    section = text[text.index("## Reading path"):]
    section = section[:section.index("\n## ", 1)]
    files = []
    for row in re.findall(r"^\| \d+ \| (.+?) \|", section, flags=re.M):
        names = re.findall(r"`([^`]+)`", row)
        folder = str(Path(names[0]).parent)  # "`csrc/cpu/update_args.h`, `csrc/host/checks.h`"
        files += [name if "/" in name else f"{folder}/{name}" for name in names]
    return files


def python_files_of_a_steady_step() -> set[str]:
    """The modules of fused_optim a third fp32 FusedAdam step calls functions of (the first made
    the state and the plan, the second ran the cached plan once)."""
    params = [torch.nn.Parameter(torch.randn(257)) for _ in range(3)]
    opt = fused_optim.FusedAdam(params, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    package = Path(fused_optim.__file__).parent
    called = set()

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(package):
                called.add(str(path.relative_to(ROOT)))

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    assert opt.implementation == "fused"
    return called


def test_the_python_files_of_the_reading_path_are_those_a_step_runs():
    listed = {f for f in reading_path() if f.endswith(".py")}
    assert python_files_of_a_steady_step() == listed


def test_the_reading_path_counts_its_files():
    files = reading_path()
    assert len(files) == len(set(files)) and all((ROOT / f).is_file() for f in files), files
    python = sum(f.endswith(".py") for f in files)
    assert f"{len(files)} files: {python} Python, {len(files) - python} C++" in DESIGN.read_text()
