"""The wheel carries the kernel sources (the checkout's top-level ``csrc/``, installed as
``fused_optim/csrc``): a non-editable install JIT-builds them from there, a checkout from its own."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A subprocess limit only catches a hang: a cold build of the CPU kernels takes 40-120 s on 2 idle
# cores, several times that on a busy machine (a cached load: seconds).
TIMEOUT = 1800


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, timeout=TIMEOUT, cwd=out)
    return next(out.glob("fused_optim-*.whl"))


@pytest.mark.slow
def test_wheel_contains_csrc_and_entry_point(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"fused_optim/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "csrc").rglob("*")
               if p.suffix in (".h", ".cpp", ".cu", ".cuh")}
    assert sources and sources <= names, sources - names
    modules = {p.relative_to(ROOT).as_posix() for package in ("fused_optim", "lightning_optim", "mmengine_optim")
               for p in (ROOT / package).rglob("*.py")}
    assert modules <= names, modules - names  # subpackages too (setuptools lists packages one by one)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fused-optim = fused_optim.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.slow
def test_a_non_editable_install_builds_from_its_own_sources(wheel, tmp_path):
    """The wheel installed into a folder of its own, imported from there (no checkout on the path):
    the build reads the installed sources and loads (the cache key is the sources' content, so an
    earlier build of identical sources is loaded, else it builds)."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    str(wheel)], check=True, timeout=TIMEOUT)
    code = "import fused_optim; from fused_optim import _build; _build.load(); print(fused_optim.__file__, _build.CSRC)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    package, csrc = out.stdout.split()[-2:]
    assert Path(package).parent == site / "fused_optim" and Path(csrc) == site / "fused_optim" / "csrc"


def test_an_installed_package_reads_its_own_csrc_a_checkout_the_top_level_one(tmp_path):
    from fused_optim import _build

    installed, checkout = tmp_path / "site" / "fused_optim", tmp_path / "checkout" / "fused_optim"
    (installed / "csrc").mkdir(parents=True)
    checkout.mkdir(parents=True)
    assert _build.sources_root(installed) == installed / "csrc"
    assert _build.sources_root(checkout) == tmp_path / "checkout" / "csrc"


def test_this_package_finds_its_kernel_sources():
    import fused_optim
    from fused_optim import _build

    assert _build.CSRC == _build.sources_root(Path(fused_optim.__file__).parent)
    assert all(Path(s).is_file() for s in _build.cpu_sources()) and len(_build.cpu_sources()) >= 2


def test_sources_of_other_content_build_in_another_directory(monkeypatch, tmp_path):
    """Two source trees that differ (here: an empty one) never share, and keep rebuilding, one
    build; identical trees share it (tests/build/test_build_faults.py)."""
    from fused_optim import _build

    kinds = (_build.extension_name, _build.cuda_extension_name, _build.emulated_cuda_extension_name)
    names = {name() for name in kinds}
    monkeypatch.setattr(_build, "CSRC", tmp_path / "csrc")
    assert names.isdisjoint({name() for name in kinds})
