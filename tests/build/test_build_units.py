"""The CPU sources' translation units: every source in exactly one unit, one unit per core, and the
units' compile times balanced (the cold build takes as long as the slowest unit)."""

import re
from pathlib import Path

import pytest

from fused_optim import _build

SOURCES = _build.cpu_sources()


def _units(monkeypatch, tmp_path: Path, cores: int) -> list[list[str]]:
    monkeypatch.setattr(_build.os, "cpu_count", lambda: cores)
    units = _build.translation_units(SOURCES, tmp_path)
    return [re.findall(r'#include "(.*)"', Path(unit).read_text()) for unit in units]


@pytest.mark.parametrize("cores", [1, 2, 3, 64])
def test_every_source_is_in_one_unit_and_there_is_a_unit_per_core(monkeypatch, tmp_path, cores):
    units = _units(monkeypatch, tmp_path, cores)
    assert len(units) == min(cores, len(SOURCES))
    assert sorted(src for unit in units for src in unit) == SOURCES
    assert all(unit == sorted(unit) for unit in units)  # name order inside a unit


def test_two_units_take_about_the_same_compile_time(monkeypatch, tmp_path):
    """On 2 cores the heaviest sources (sgd.cpp, lamb.cpp) go to different units and the rest
    fills them up: their listed compile times end within one unlisted (small) source of each
    other. Taking the sources in name order by turns instead leaves them 14 s apart (74.5
    against 60.5), the cold build that much longer."""
    seconds = lambda unit: sum(_build.COMPILE_SECONDS.get(Path(src).name, _build.UNLISTED_COMPILE_SECONDS)  # noqa: E731
                               for src in unit)
    assert set(_build.COMPILE_SECONDS) <= {Path(src).name for src in SOURCES}  # no stale name
    first, second = _units(monkeypatch, tmp_path, 2)
    assert abs(seconds(first) - seconds(second)) <= _build.UNLISTED_COMPILE_SECONDS
    assert {Path(src).name for src in first} & {"sgd.cpp", "lamb.cpp"} != {"sgd.cpp", "lamb.cpp"}
