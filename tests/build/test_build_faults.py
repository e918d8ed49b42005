"""The JIT build's cache under faults: builds are announced with their progress, keyed on what
determines the binary (sources, flags, compiler; not mtimes or install locations), a damaged library
is rebuilt instead of loaded, a lock left by a killed build is recovered from (a live builder's is
waited for), an unusable TORCH_EXTENSIONS_DIR falls back, and a cache others can write is refused.

Every test that touches a cache uses its own TORCH_EXTENSIONS_DIR, and every real build or load runs
in a subprocess, so this process's loaded library is untouched. One cold build (the module's
``cache`` fixture) serves all the tests: each damages that cache and checks the repair, which
relinks the library only (its objects stay verified), leaving the cache intact for the next.
"""

import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fused_optim
from fused_optim import _build

# Subprocess limits only catch a hang, so they sit far above the slowest healthy run: a cold build
# takes 40-120 s on 2 idle cores and several times that when other jobs share them; a load of the
# cached build (or a relink) takes a few seconds idle.
BUILD_TIMEOUT = 1800
LOAD_TIMEOUT = 600

# Every build or load below starts with this: the cache these tests damage and repair is compiled at
# -O0 instead of the library's -O3, in about half the time. The flags are part of a build's name,
# so it is a build of its own, and what these tests check is the cache, not the code's speed.
UNOPTIMIZED = "from fused_optim import _build; _build.CFLAGS = ['-O0' if f == '-O3' else f for f in _build.CFLAGS]\n"

LOAD = UNOPTIMIZED + "_build.load(); print(_build.CSRC); print(_build.build_directory())"

# Two fused=None SGD steps (lr 0.5, grad 1, from 1.0: exactly 0.0 in fp32 either way), the warnings
# they raise, then fused=True's error and is_available().
STEP = UNOPTIMIZED + """
import warnings, torch, fused_optim
p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    opt = fused_optim.FusedSGD([p], lr=0.5); opt.step(); opt.step()
    print("AVAILABLE", fused_optim.is_available())
print("IMPL", opt.implementation, p.tolist(), len(w))
print("WARNING", w[0].message if w else "")
try:
    fused_optim.FusedSGD([p], lr=0.5, fused=True).step()
except _build.BuildError as exc:
    print("RAISED", exc)
"""


def run_python(code: str, extensions: Path, timeout: float = LOAD_TIMEOUT, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def line(out: str, prefix: str) -> str:
    return next((ln for ln in out.splitlines() if ln.startswith(prefix)), f"(no {prefix} line in: {out})")


def announcements(stderr: str) -> list[str]:
    """The build's messages, less its progress lines (see :func:`progress`)."""
    return [ln for ln in stderr.splitlines() if ln.startswith("fused_optim:") and ln not in progress(stderr)]


def progress(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines()
            if ln.startswith(("fused_optim: compiled ", "fused_optim: built in "))]


# A compiler that answers ``--version`` as the machine's ``c++`` does (so the cache key, which
# holds the compiler's identity, is unchanged) and then does what the test needs.
def same_identity_compiler(folder: Path, then: str) -> Path:
    path = folder / "c++"
    real = shutil.which("c++")
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then exec {real} --version; fi\n{then}\n')
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """(TORCH_EXTENSIONS_DIR, the CPU build directory, the cold build's stderr), built once."""
    root = tmp_path_factory.mktemp("extensions")
    out = run_python(LOAD, root, timeout=BUILD_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return root, Path(out.stdout.split()[-1]), out.stderr


def library(directory: Path) -> Path:
    return _build.library_path(directory, directory.name)


def verified(directory: Path) -> bool:
    """The manifest records the library as it is on disk."""
    manifest = json.loads((directory / _build.MANIFEST).read_text())
    return manifest[library(directory).name] == _build._fingerprint(library(directory))


def test_a_cold_build_says_once_what_it_builds_where_and_that_it_is_one_time(cache):
    root, directory, stderr = cache
    (message,) = announcements(stderr)
    assert "building the CPU kernels" in message and "one-time" in message and str(directory) in message
    assert directory.parent == root and verified(directory)
    assert (directory / _build.LOCK).stat().st_mode & 0o777 == 0o600  # nobody else writes the lock


def test_a_cold_build_shows_its_progress(cache):
    """Units compiled of all, with the time elapsed, then the build's time: never a minute of silence."""
    _, directory, stderr = cache
    lines = progress(stderr)
    units = len(list(directory.glob("unit*.o")))
    counts = [re.fullmatch(rf"fused_optim: compiled (\d+) of {units} units \((\d+) s\)", ln) for ln in lines[:-1]]
    assert counts and all(counts), lines
    assert [int(m[1]) for m in counts] == sorted(int(m[1]) for m in counts) and int(counts[-1][1]) == units
    assert re.fullmatch(r"fused_optim: built in \d+ s", lines[-1]), lines


def test_a_reinstall_of_identical_sources_loads_the_cached_build_silently(cache, tmp_path):
    """A copy of the package whose sources were all rewritten with the same bytes (new mtimes, as
    ``pip install .`` leaves them) loads the build made from the original: same name, no compile."""
    root, directory, _ = cache
    package = tmp_path / "site" / "fused_optim"
    shutil.copytree(Path(fused_optim.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    shutil.copytree(_build.CSRC, package / "csrc")  # where a wheel installs them
    time.sleep(0.01)  # the rewritten sources' mtimes are newer than the cached objects'
    for source in (package / "csrc").rglob("*"):
        if source.is_file():
            source.write_bytes(source.read_bytes())
    before = library(directory).stat().st_mtime_ns
    out = run_python(LOAD, root, PYTHONPATH=str(tmp_path / "site"))
    assert out.returncode == 0, out.stderr[-3000:]
    csrc, used = out.stdout.split()[-2:]
    assert Path(csrc) == package / "csrc"  # the copy's sources were the ones read
    assert Path(used) == directory and announcements(out.stderr) == []
    assert library(directory).stat().st_mtime_ns == before  # not relinked


def test_editing_a_source_or_a_flag_changes_the_extension_name_and_another_installation_does_not(monkeypatch, tmp_path):
    """A new name is a new, empty build directory: an edit always builds."""
    names = lambda: (_build.extension_name(), _build.cuda_extension_name())  # noqa: E731
    original = names()
    shutil.copytree(_build.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(_build, "CSRC", tmp_path / "csrc")
    assert names() == original  # keyed on content: the location does not count
    for header in ("shared/primitives.h", "host/checks.h"):  # both builds include csrc/shared and csrc/host
        before = names()
        (_build.CSRC / header).write_text((_build.CSRC / header).read_text() + "// edited\n")
        cpu_edit, cuda_edit = names()
        assert cpu_edit != before[0] and cuda_edit != before[1], header
    (_build.CSRC / "cpu" / "adam.cpp").write_text((_build.CSRC / "cpu" / "adam.cpp").read_text() + "// edited\n")
    assert names()[0] != cpu_edit and names()[1] == cuda_edit
    edited = names()
    monkeypatch.setattr(_build, "CFLAGS", [*_build.CFLAGS, "-DEXTRA"])
    assert names()[0] != edited[0]
    flagged = names()
    monkeypatch.setattr(_build.sysconfig, "get_path", lambda *args, **kwargs: "/another/venv/include/python3")
    monkeypatch.setattr(_build.torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert names() == flagged  # where torch and Python are installed does not count


def test_another_compiler_keys_a_build_of_its_own(monkeypatch, tmp_path):
    """CXX naming another compiler (another ``--version``) is another build, beside the first one's;
    the same compiler under another path shares it."""
    original = _build.extension_name()
    monkeypatch.setenv("CXX", str(same_identity_compiler(tmp_path, "exit 1")))
    assert _build.extension_name() == original
    other = tmp_path / "other" / "c++"
    other.parent.mkdir()
    other.write_text('#!/bin/sh\necho "c++ (Another) 99.1"\n')
    other.chmod(0o755)
    monkeypatch.setenv("CXX", str(other))
    assert _build.extension_name() != original


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_the_manifest_check_deletes_a_damaged_output_only(tmp_path, damage):
    name = "ext"
    lib, obj = _build.library_path(tmp_path, name), tmp_path / "unit0.o"
    lib.write_bytes(os.urandom(4096))
    obj.write_bytes(os.urandom(4096))
    _build.write_manifest(tmp_path, name)
    assert _build.remove_unverified_outputs(tmp_path, name) == [] and _build.manifest_vouches_for_all(tmp_path)
    lib.write_bytes(lib.read_bytes()[:1000] if damage == "truncated" else bytes(4096))
    assert _build.remove_unverified_outputs(tmp_path, name) == [lib.name]
    assert not lib.exists() and obj.exists() and not _build.manifest_vouches_for_all(tmp_path)


def test_outputs_without_a_manifest_are_not_trusted(tmp_path):
    """What a killed first build leaves (objects, maybe a library, no manifest) is deleted."""
    lib, obj = _build.library_path(tmp_path, "ext"), tmp_path / "unit0.o"
    lib.write_bytes(b"partial")
    obj.write_bytes(b"partial")
    assert _build.remove_unverified_outputs(tmp_path, "ext") == []  # none was ever verified: not "damaged"
    assert not lib.exists() and not obj.exists() and not _build.manifest_vouches_for_all(tmp_path)


def damage(path: Path, how: str) -> None:
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 3] if how == "truncated" else bytes(size))


@pytest.mark.parametrize("how", ["truncated", "zeroed"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(cache, how):
    """Loading it would kill the process (SIGBUS), fused=None included; ninja alone would not rebuild it."""
    root, directory, _ = cache
    damage(library(directory), how)
    out = run_python(STEP, root, timeout=BUILD_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert line(out.stdout, "IMPL") == "IMPL fused [0.0, 0.0, 0.0] 0"
    assert progress(out.stderr)[-1].startswith("fused_optim: built in ")
    (message,) = announcements(out.stderr)
    assert "rebuilding the CPU kernels" in message
    assert f"{library(directory).name} failed its integrity check" in message
    assert verified(directory)


def test_a_failed_rebuild_of_a_damaged_library_falls_back_with_one_warning(cache, tmp_path):
    root, directory, _ = cache
    damage(library(directory), "zeroed")
    broken = same_identity_compiler(tmp_path, "exit 1")  # the relink fails
    out = run_python(STEP, root, timeout=BUILD_TIMEOUT, CXX=str(broken))
    assert out.returncode == 0, out.stderr[-3000:]
    assert line(out.stdout, "IMPL") == "IMPL reference [0.0, 0.0, 0.0] 1"
    assert "could not build its CPU kernels" in line(out.stdout, "WARNING")
    assert "Falling back to the reference implementation" in line(out.stdout, "WARNING")
    assert "could not build its CPU kernels" in line(out.stdout, "RAISED")
    assert line(out.stdout, "AVAILABLE") == "AVAILABLE False"
    assert not library(directory).exists()  # never loaded: deleted before the attempt
    repaired = run_python(LOAD, root, timeout=BUILD_TIMEOUT)  # with a compiler again: relinked
    assert repaired.returncode == 0 and verified(directory), repaired.stderr[-3000:]


def held(path: Path) -> bool:
    """Whether another process holds the flock on ``path``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        return not _build._try_flock(fd)
    finally:
        os.close(fd)


def test_a_build_killed_mid_way_leaves_a_lock_the_next_load_recovers_from(cache, tmp_path):
    """A build SIGKILLed (as a scheduler does, with its process group) while it holds cpp_extension's
    lock file leaves that file; where the file blocks by existing (torch <= 2.13), waiting for it
    would never end. Here the build is a relink (the library was damaged) whose compiler never
    returns, so the kill lands inside the locks."""
    root, directory, _ = cache
    baton = directory / _build.CPP_EXTENSION_LOCK
    hanging = same_identity_compiler(tmp_path, "exec sleep 3600")
    damage(library(directory), "zeroed")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "CXX": str(hanging)}
    build = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT
        while not (held(directory / _build.LOCK) and baton.exists()) and build.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held(directory / _build.LOCK) and baton.exists(), "the build never took the locks"
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    assert baton.exists()  # what the killed build leaves
    out = run_python(LOAD, root)  # a relink; before: it waited on the lock file forever
    assert out.returncode == 0, out.stderr[-3000:]
    if _build.cpp_extension_lock_blocks():
        stale, building = announcements(out.stderr)
        assert stale == f"fused_optim: removing the stale lock {baton} left by a build that was killed"
        assert not baton.exists()
    else:  # a flock'ed file, released by the kernel with the killed build: left, and not called stale
        (building,) = announcements(out.stderr)
    assert "building the CPU kernels" in building and verified(directory)


def read_announcement(stream, timeout: float) -> str:
    """The first ``fused_optim:`` line of ``stream`` within ``timeout`` s ("" at EOF or timeout)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and select.select([stream], [], [], left)[0]:
        text = stream.readline()
        if not text or text.startswith("fused_optim:"):
            return text
    return ""


def test_a_live_builders_lock_is_waited_for(cache):
    """While another process holds the build lock (here: this test, as a builder would), a load says
    whom it waits for and waits; it proceeds once the lock is released, without calling it stale."""
    root, directory, _ = cache
    baton = directory / _build.CPP_EXTENSION_LOCK
    fd = os.open(directory / _build.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.pwrite(fd, b"pid 4242 on a-builder", 0)
    baton.touch()  # the builder's cpp_extension lock
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    proc = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        message = read_announcement(proc.stderr, LOAD_TIMEOUT)
        assert message.startswith("fused_optim: waiting for pid 4242 on a-builder, which is building or loading "
                                  f"the CPU kernels in {directory}"), message
        assert proc.poll() is None  # it cannot get past the flock this test holds
        baton.unlink()  # the builder finishes
        os.close(fd)
        fd = None
        stdout, stderr = proc.communicate(timeout=LOAD_TIMEOUT)
    finally:
        if fd is not None:
            os.close(fd)
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert announcements(stderr) == [] and Path(stdout.split()[-1]) == directory


def test_a_short_wait_for_the_lock_is_silent(monkeypatch, tmp_path, capsys):
    """DDP ranks loading one cached build take turns without a word."""
    monkeypatch.setattr(_build, "QUIET_WAIT_SECONDS", LOAD_TIMEOUT)
    holder = os.open(tmp_path / _build.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    release = threading.Timer(0.5, os.close, [holder])
    release.start()
    waiter = os.open(tmp_path / _build.LOCK, os.O_RDWR | os.O_CREAT)
    try:
        _build._lock_exclusively(waiter, "CPU kernels")
        assert os.pread(waiter, 256, 0).decode().startswith(f"pid {os.getpid()} on ")
    finally:
        os.close(waiter)
        release.join()
    assert capsys.readouterr().err == ""


def test_an_unusable_extensions_dir_falls_back_with_one_warning_naming_it(tmp_path):
    """A directory under a regular file cannot be created, by root either."""
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "afile" / "sub"
    out = run_python(STEP, bad)
    assert out.returncode == 0, out.stderr[-3000:]
    assert line(out.stdout, "IMPL") == "IMPL reference [0.0, 0.0, 0.0] 1"
    assert line(out.stdout, "AVAILABLE") == "AVAILABLE False"
    for prefix in ("WARNING", "RAISED"):
        message = line(out.stdout, prefix)
        assert f"cannot use its build cache directory {bad}" in message, message
        assert "Set TORCH_EXTENSIONS_DIR to a writable directory" in message and "fused=False" in message
    info = run_python("from fused_optim.cli import main; raise SystemExit(main(['info']))", bad)
    assert info.returncode == 1 and "Traceback" not in info.stderr, info.stderr[-3000:]
    assert f"cannot use its build cache directory {bad}" in info.stdout


def test_a_second_venv_with_the_same_torch_loads_the_cached_build_silently(cache, tmp_path):
    """Another installation of the same torch (here: torch reached through a symlink in another
    site folder, so its files, headers included, sit at another path, as in a second venv) loads the
    build made from the first: same name, no compile, no relink."""
    import torch

    root, directory, _ = cache
    site = tmp_path / "venv2" / "site-packages"
    site.mkdir(parents=True)
    (site / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    before = library(directory).stat().st_mtime_ns
    code = LOAD + "\nimport torch; print(torch.__file__)"
    out = run_python(code, root, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    assert out.returncode == 0, out.stderr[-3000:]
    used, torch_file = out.stdout.split()[-2:]
    assert Path(torch_file).parent == site / "torch"  # the other installation's torch was the one imported
    assert Path(used) == directory and announcements(out.stderr) == [] and progress(out.stderr) == []
    assert library(directory).stat().st_mtime_ns == before


def test_a_cached_load_needs_no_ninja_and_a_build_finds_the_one_beside_python(cache, tmp_path, monkeypatch):
    """A venv's python run without activating the venv: its ninja is not on PATH. The cached build
    loads without ninja; a build puts the ninja next to ``sys.executable`` on PATH."""
    from torch.utils import cpp_extension

    root, directory, _ = cache
    bare = tmp_path / "bin"  # PATH: the compiler only (its --version is part of the cache key)
    bare.mkdir()
    (bare / "c++").symlink_to(shutil.which("c++"))
    out = run_python(LOAD, root, PATH=str(bare))
    assert out.returncode == 0, out.stderr[-3000:]
    assert Path(out.stdout.split()[-1]) == directory and announcements(out.stderr) == []
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "ninja").symlink_to(shutil.which("ninja"))
    monkeypatch.setenv("PATH", str(bare))
    monkeypatch.setattr(_build.sys, "executable", str(venv_bin / "python"))
    assert not cpp_extension.is_ninja_available()
    with _build._ninja_on_path():
        assert cpp_extension.is_ninja_available()
    assert os.environ["PATH"] == str(bare)


@pytest.fixture
def restore_modes(cache):
    """Undo the chmods a test makes in the cache (the other tests use it)."""
    root, directory, _ = cache
    paths = [root, directory, library(directory), directory / _build.MANIFEST]
    modes = {p: p.stat().st_mode & 0o7777 for p in paths}
    yield
    for path, mode in modes.items():
        path.chmod(mode)


def refused(out: subprocess.CompletedProcess, problem: str) -> None:
    """A fused=None step fell back to the reference with one warning saying why the cache is refused."""
    assert out.returncode == 0, out.stderr[-3000:]
    assert line(out.stdout, "IMPL") == "IMPL reference [0.0, 0.0, 0.0] 1"
    message = line(out.stdout, "WARNING")
    assert "refuses to build or load its kernels in" in message and problem in message, message
    assert "TORCH_EXTENSIONS_DIR to a folder only you can write" in message


@pytest.mark.parametrize("what", ["root", "directory", "library", "manifest"])
def test_a_cache_others_can_write_is_refused(cache, restore_modes, what):
    """A 0777 TORCH_EXTENSIONS_DIR, or a build directory or file that group or others may write:
    whoever can write there could swap the library and its manifest, so nothing is built or loaded."""
    root, directory, _ = cache
    path = {"root": root, "directory": directory, "library": library(directory),
            "manifest": directory / _build.MANIFEST}[what]
    path.chmod(0o777 if path.is_dir() else 0o666)
    problem = f"{path} is writable by group or others" if what != "root" else \
        f"{root} is writable by group or others (mode drwxrwxrwx) without the sticky bit"
    refused(run_python(STEP, root), problem)
    if what == "root":  # `info` looks at the default (-O3) build's directory, in the same root
        info = run_python("from fused_optim.cli import main; raise SystemExit(main(['info']))", root)
        assert info.returncode == 1 and problem in info.stdout, info.stdout


def test_a_symlinked_extensions_dir_to_an_open_folder_is_refused(cache, tmp_path):
    """TORCH_EXTENSIONS_DIR a symlink to a folder anyone can write (0777, no sticky bit)."""
    open_folder = tmp_path / "shared"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    link = tmp_path / "extensions"
    link.symlink_to(open_folder, target_is_directory=True)
    refused(run_python(STEP, link), f"{open_folder} is writable by group or others")
    assert not any(open_folder.iterdir())  # nothing built there


def test_a_symlink_planted_in_the_build_directory_is_refused(cache, tmp_path):
    root, directory, _ = cache
    planted = directory / "planted.so"
    planted.symlink_to(tmp_path / "elsewhere.so")
    try:
        refused(run_python(STEP, root), f"{planted} is a symlink")
    finally:
        planted.unlink()


def test_folders_and_symlinks_of_other_users_are_refused(tmp_path, monkeypatch):
    """As another user sees our cache (the check compares owners with the effective uid): the build
    directory and a symlink on the way are ours, not theirs; folders above may be root's."""
    directory = tmp_path / "extensions" / "ext"
    directory.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "extensions", target_is_directory=True)
    assert _build.cache_problem(directory) is None and _build.cache_problem(link / "ext") is None
    mine = os.geteuid()
    monkeypatch.setattr(_build.os, "geteuid", lambda: mine + 4242)
    for path in (directory, link / "ext"):  # (the link: its own owner, unless root's; then the folder's)
        problem = _build.cache_problem(path)
        assert problem is not None and problem.endswith(f"owned by uid {mine}"), problem


def test_info_reads_the_cache_and_builds_nothing(tmp_path):
    """On a cold cache `fused-optim info` says "not built yet" and creates no folder; after a build
    it says "built"."""
    root = tmp_path / "extensions"
    info = "from fused_optim.cli import main; raise SystemExit(main(['info']))"
    out = run_python(info, root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CPU kernels      not built yet" in out.stdout and "fused-optim build" in out.stdout
    assert not root.exists() and announcements(out.stderr) == []
