"""Optimizer state kept in memory-mapped files: ColossalAI's ``nvme_offload_fraction``.

ColossalAI moves a fraction of the optimizer state to NVMe with its own asynchronous reader and
writer (tensornvme) around each param's update. Here the state tensors of that fraction are
*mapped* from files (``torch.from_file(..., shared=True)``): the kernels update them in place,
and the kernel's page cache writes them back and evicts them under memory pressure, so they need
no RAM of their own. Nothing else changes: the same kernels, bit for bit the same results.

Which params: in the order of the optimizer's param groups at construction, each CPU param whose
state fits in the budget ``floor(fraction · Σ numel of all params)`` (ColossalAI's rule, which
counts in order of first steps instead; the group order gives the same choice after a resume). Their state tensors
named by ``keys`` live in ``<dir>/<group>_<index>_<key>.bin``, ``dir`` a fresh folder made inside
``nvme_offload_dir`` (or the system's temporary folder) and removed with the optimizer.

Saving copies the values into the checkpoint like any tensor (ColossalAI refuses to save
offloaded state); loading a state dict puts the loaded values back into the files, so a resumed
run offloads the same params.

Faults and other users. The folder is made by ``mkdtemp`` (0o700, ours), checked before use, and
refused (``ValueError`` naming ``nvme_offload_dir``) when a folder above it lets others rename it
(writable by group or others without the sticky bit, or another user's: ``parents_problem``).
Each file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never an existing file or a planted
symlink) and its blocks reserved (``posix_fallocate``) at construction, for the state's size then
known (the param's, or its fp32 master's under ``master_weights``), so a full disk is an
``OSError`` naming the file when the optimizer is made, not a SIGBUS when a page is first written. Before
each step, a file whose size or inode changed (truncated, replaced, deleted) is an ``OSError``
naming it, not a SIGBUS. Each folder holds a ``LOCK`` file flock'ed while its optimizer lives: a
folder whose lock nobody holds was left by a process that died (SIGKILL) and is removed by the
next ``StateFiles`` made in the same place. On SIGTERM, where the program installed no handler of
its own, the folders are removed, then the process ends as SIGTERM ends it; a program's own
handler is left alone (it decides whether the process goes on, and its exit removes the folders
as any ending of the interpreter does).
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import shutil
import signal
import stat
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from ._build import parents_problem
from .checks import is_real

PREFIX = "fused_optim_state_"  # the folders' names: PREFIX and mkdtemp's random suffix
LOCK = "LOCK"  # in each folder: flock'ed by the process whose optimizer uses it
_live: set[Path] = set()  # this process's folders (removed on SIGTERM)


class StateFiles:
    """The file-backed state tensors of one optimizer (see the module docstring)."""

    def __init__(self, owner: torch.optim.Optimizer, fraction: float, directory: str | None, keys: tuple[str, ...]):
        if not is_real(fraction) or not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"Invalid nvme_offload_fraction value: {fraction!r} (a fraction of the optimizer state "
                             "in [0, 1]; 0 keeps it all in memory)")
        if directory is not None and not isinstance(directory, (str, Path)):
            raise ValueError(f"Invalid nvme_offload_dir value: {directory!r} (a folder path, or None for the "
                             "system's temporary folder)")
        self.fraction = float(fraction)
        self.requested_directory = None if directory is None else str(directory)
        self.keys = keys
        self._owner = weakref.ref(owner)
        self._offloaded: dict[int, Path] = {}  # id(param) -> its files' prefix
        self.directory: Path | None = None
        self._files: dict[str, tuple[int, int]] = {}  # path -> (inode, size) of each file made
        if self.fraction > 0:
            self.directory, lock = _make_folder(directory)
            _live.add(self.directory)
            weakref.finalize(owner, _remove_folder, self.directory, lock)
            _remove_stale_folders(self.directory.parent)
            _remove_on_sigterm()
            self._offloaded = self._choose()
            self._reserve()
            owner.register_step_pre_hook(lambda optimizer, args, kwargs: self.check())

    def _reserve(self) -> None:
        """Make every offloaded param's files now, each of its state's size: the param's numel in
        its dtype, or in fp32 for an fp16/bf16 param of a group with ``master_weights``."""
        for group in self._owner().param_groups:
            for p in group["params"]:
                prefix = self._offloaded.get(id(p))
                if prefix is None:
                    continue
                fp32 = group.get("master_weights") and p.dtype in (torch.float16, torch.bfloat16)
                size = p.numel() * (4 if fp32 else p.element_size())
                for key in self.keys:
                    self._create(f"{prefix}_{key}.bin", size)

    def _choose(self) -> dict[int, Path]:
        """id(param) -> file prefix of the params whose state is offloaded (chosen once, see above)."""
        groups = self._owner().param_groups
        params = [(gi, i, p) for gi, group in enumerate(groups) for i, p in enumerate(group["params"])]
        budget = math.floor(self.fraction * sum(p.numel() for _, _, p in params))
        chosen, used = {}, 0
        for gi, i, p in params:
            if p.device.type == "cpu" and used + p.numel() <= budget:
                chosen[id(p)] = self.directory / f"{gi}_{i}"
                used += p.numel()
        return chosen

    def place(self, p: torch.Tensor, state: dict) -> None:
        """Make the ``keys`` tensors of ``p``'s state file-backed if ``p`` is offloaded (copying the
        values they hold); a no-op for a param that is not, or whose tensors already are."""
        if self.directory is None:
            return
        prefix = self._offloaded.get(id(p))
        if prefix is None:
            return
        for key in self.keys:
            value = state.get(key)
            path = f"{prefix}_{key}.bin"
            if value is None:
                continue
            if getattr(value.untyped_storage(), "filename", None) == path:
                continue
            size = value.numel() * value.element_size()
            if path in self._files:  # made at construction, or a loaded state's values going into our file
                self._check(path)
            if self._files.get(path, (None, size))[1] != size:  # another state dtype than reserved for
                os.unlink(path)
                del self._files[path]
            if path not in self._files:
                self._create(path, size)
            mapped = torch.from_file(path, shared=True, size=value.numel(), dtype=value.dtype).view_as(value)
            state[key] = mapped.copy_(value)

    def _create(self, path: str, size: int) -> None:
        """Make the file ``path`` of ``size`` bytes, its blocks reserved (see the module docstring)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"cannot create the offloaded optimizer state file {path} ({e.strerror})",
                          path) from None
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
            self._files[path] = (os.fstat(fd).st_ino, size)
        except OSError as e:
            os.unlink(path)
            raise OSError(e.errno, f"cannot reserve {size} bytes for the offloaded optimizer state file {path} "
                          f"({e.strerror}); free space there, give another nvme_offload_dir, or lower "
                          "nvme_offload_fraction", path) from None
        finally:
            os.close(fd)

    def check(self) -> None:
        """Raise OSError naming a file that was truncated, replaced or deleted since it was made:
        touching a mapped page past a file's end kills the process (SIGBUS). Runs before each step
        (a step pre-hook: one stat per file)."""
        for path in self._files:
            self._check(path)

    def _check(self, path: str) -> None:
        inode, size = self._files[path]
        try:
            st = os.stat(path)
            found = f"{st.st_size} bytes" if st.st_ino == inode else "another file"
            if st.st_ino == inode and st.st_size >= size:
                return
        except FileNotFoundError:
            found = "missing"
        raise OSError(errno.EIO, f"the offloaded optimizer state file {path} should hold {size} bytes and is {found} "
                      "(truncated, replaced or deleted by something else): its state is lost; resume from a "
                      "checkpoint", path)

    def files_of(self, p: torch.Tensor) -> list[Path]:
        """The files holding ``p``'s state (empty: it is in memory)."""
        prefix = self._offloaded.get(id(p))
        return [] if prefix is None else [Path(f"{prefix}_{key}.bin") for key in self.keys]


def _make_folder(directory: str | Path | None) -> tuple[Path, int]:
    """A fresh private folder in ``directory`` (None: the system's temporary folder) and the fd of
    its flock'ed ``LOCK``; ValueError naming ``nvme_offload_dir`` when it cannot be made safely."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"Invalid nvme_offload_dir value: {str(directory)!r}: {why}")

    def unsafe(problem: str) -> ValueError:
        return refuse(f"{problem}, so another user could redirect the optimizer state's writes; give a folder "
                      "only you can write (or one with the sticky bit, such as /tmp)")

    try:
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        problem = parents_problem(Path(os.path.realpath(directory or tempfile.gettempdir())) / PREFIX)
        if problem is not None:
            raise unsafe(problem)
        folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=directory))
    except OSError as e:
        raise refuse(f"cannot create a folder there ({e.strerror}); give a writable folder") from None
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o777 != 0o700:
        raise unsafe(f"{folder} is not a folder of ours with mode 0700")
    lock = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.write(lock, f"pid {os.getpid()}\n".encode())
    return folder, lock


def _remove_folder(folder: Path, lock: int) -> None:
    _live.discard(folder)
    shutil.rmtree(folder, ignore_errors=True)
    os.close(lock)


def _remove_stale_folders(parent: Path) -> None:
    """Remove the folders of ours in ``parent`` whose ``LOCK`` nobody holds: their process died."""
    uid = os.geteuid()
    for folder in parent.glob(f"{PREFIX}*"):
        try:
            st = os.lstat(folder)
            if st.st_uid != uid or not os.path.isdir(folder) or os.path.islink(folder) or folder in _live:
                continue
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no lock file (being made, or not ours): left alone
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live process's
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


_sigterm_installed = False


def _remove_on_sigterm() -> None:
    """Where SIGTERM has its default action (the process ends), remove this process's folders first,
    then end as SIGTERM ends it. A program's own handler, or SIG_IGN, is left in place."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm_installed = True


def _on_sigterm(signum, frame) -> None:
    for folder in list(_live):
        shutil.rmtree(folder, ignore_errors=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
