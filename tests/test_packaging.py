"""The wheel carries the kernel sources: a non-editable install must be able to JIT-build them."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_csrc_and_entry_point(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=1800, cwd=tmp_path)
    wheel = next(tmp_path.glob("fused_optim-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fused_optim" / "csrc").rglob("*")
               if p.suffix in (".h", ".cpp", ".cu", ".cuh")}
    assert sources and sources <= names, sources - names
    modules = {p.relative_to(ROOT).as_posix() for package in ("fused_optim", "lightning_optim", "mmengine_optim")
               for p in (ROOT / package).rglob("*.py")}
    assert modules <= names, modules - names  # subpackages too (setuptools lists packages one by one)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fused-optim = fused_optim.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_package_builds_from_its_own_sources():
    import fused_optim
    from fused_optim import _build

    assert _build.CSRC == Path(fused_optim.__file__).parent / "csrc"
    assert all(Path(s).is_file() for s in _build.cpu_sources()) and len(_build.cpu_sources()) >= 2


def test_sources_of_other_content_build_in_another_directory(monkeypatch, tmp_path):
    """Two source trees that differ (here: an empty one) never share, and keep rebuilding, one
    build; identical trees share it (tests/test_build_faults.py)."""
    from fused_optim import _build

    names = {_build.extension_name(), _build.cuda_extension_name()}
    monkeypatch.setattr(_build, "CSRC", tmp_path / "csrc")
    assert names.isdisjoint({_build.extension_name(), _build.cuda_extension_name()})
