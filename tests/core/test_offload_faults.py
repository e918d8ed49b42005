"""CPUAdam's offloaded state files (``nvme_offload_fraction``) under faults and other users: a full
filesystem, a file truncated mid-training, a planted symlink, an offload folder others can write,
folders left by a killed process, and SIGTERM. Every fault that could end in SIGBUS runs in a
subprocess, so a regression fails the test instead of killing pytest."""

import copy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_optim

# The child's setup: one param of 64 Ki elements offloaded whole (two 256 KiB state files),
# stepped once; then what the case does. It prints the folder of the files.
CHILD = """
import os, signal, sys, resource, torch, fused_optim
p = torch.nn.Parameter(torch.ones(65536)); p.grad = torch.ones(65536)
opt = fused_optim.CPUAdam([p], lr=0.1, nvme_offload_fraction=1.0, nvme_offload_dir=sys.argv[1], fused=False)
print(opt.state_files.directory, flush=True)
"""
TIMEOUT = 300  # a hang's limit: each child runs for a second or two


def child(code: str, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD + code, *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, **kwargs)


def offloaded(tmp_path, **kw):
    p = torch.nn.Parameter(torch.ones(1000))
    p.grad = torch.ones(1000)
    return p, fused_optim.CPUAdam([p], lr=0.1, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), **kw)


@pytest.mark.slow
def test_a_full_filesystem_is_an_oserror_naming_the_file_at_construction(tmp_path):
    """The files' blocks are reserved when the optimizer is made: a file-size limit (EFBIG, as a
    full disk gives ENOSPC) fails the construction with an error naming the file, where a sparse
    file killed the process at a later step; nothing is left behind."""
    code = """
import resource, signal, sys, torch, fused_optim
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: an error, not the signal
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
p = torch.nn.Parameter(torch.ones(65536))
try:
    fused_optim.CPUAdam([p], lr=0.1, nvme_offload_fraction=1.0, nvme_offload_dir=sys.argv[1], fused=False)
except OSError as e:
    print("RAISED", e)
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"RAISED [Errno {27}] cannot reserve 262144 bytes for the offloaded optimizer state file {tmp_path}/" \
        in out.stdout, out.stdout
    assert "lower nvme_offload_fraction" in out.stdout
    assert not list(tmp_path.glob("*/*.bin"))


@pytest.mark.slow
def test_a_file_truncated_mid_training_is_an_oserror_naming_it(tmp_path):
    out = child("""
opt.step()
path = opt.state_files.files_of(p)[1]
os.truncate(path, 0)
try:
    opt.step()
except OSError as e:
    print("RAISED", e)
""", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]  # before: SIGBUS (returncode -7)
    folder = out.stdout.split()[0]
    assert f"the offloaded optimizer state file {folder}/0_0_exp_avg_sq.bin should hold 262144 bytes and is 0 bytes" \
        in out.stdout, out.stdout


def test_a_planted_symlink_is_never_followed(tmp_path):
    """A state file replaced by a symlink (here by us, as a user with write access to the folder
    would) is refused before the step writes through it; its target is untouched. (Files are
    made at construction with O_EXCL | O_NOFOLLOW: a symlink planted earlier fails that.)"""
    p, opt = offloaded(tmp_path / "offload")
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    planted = opt.state_files.directory / "0_0_exp_avg.bin"
    planted.unlink()
    planted.symlink_to(target)
    with pytest.raises(OSError, match=r"offloaded optimizer state file .*0_0_exp_avg.bin"):
        opt.step()
    assert target.read_bytes() == b"precious"
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(OSError, match=r"cannot create the offloaded optimizer state file .*exp_avg.bin"):
        with pytest.MonkeyPatch.context() as patch:  # a symlink already where the file is made
            real = fused_optim.state_files.StateFiles._create

            def plant_then_create(self, path, size):
                Path(path).symlink_to(target)
                return real(self, path, size)

            patch.setattr(fused_optim.state_files.StateFiles, "_create", plant_then_create)
            offloaded(again)
    assert target.read_bytes() == b"precious"


def test_an_offload_folder_others_can_write_is_refused(tmp_path):
    """Writable by others without the sticky bit: they could rename our folder and redirect our
    writes. With the sticky bit (as /tmp) it is accepted."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=rf"Invalid nvme_offload_dir value: '{shared}': {shared} is writable by "
                                         r"group or others \(mode drwxrwxrwx\) without the sticky bit"):
        offloaded(shared)
    assert list(shared.iterdir()) == []
    shared.chmod(0o1777)
    p, opt = offloaded(shared)
    opt.step()
    folder = opt.state_files.directory
    assert folder.parent == shared and folder.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in folder.iterdir())


@pytest.mark.slow
def test_folders_of_killed_processes_are_removed_by_the_next_start(tmp_path):
    killed = child("opt.step(); os.kill(os.getpid(), signal.SIGKILL)", tmp_path)
    assert killed.returncode == -signal.SIGKILL
    left = Path(killed.stdout.split()[0])
    assert len(list(left.glob("*.bin"))) == 2  # what SIGKILL leaves
    p, live = offloaded(tmp_path)  # a live optimizer's folder in the same place: kept
    live.step()
    p, opt = offloaded(tmp_path)
    assert not left.exists() and live.state_files.directory.exists()
    assert {f.name for f in tmp_path.iterdir()} == {live.state_files.directory.name, opt.state_files.directory.name}


@pytest.mark.slow
def test_sigterm_removes_the_folder_and_ends_the_process_as_sigterm_does(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD + "opt.step(); print('READY', flush=True); "
                             "import time; time.sleep(600)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        folder = Path(proc.stdout.readline().strip())
        assert proc.stdout.readline().strip() == "READY" and len(list(folder.glob("*.bin"))) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == -signal.SIGTERM
    finally:
        proc.kill()
    assert not folder.exists()


@pytest.mark.slow
def test_a_programs_own_sigterm_handler_is_left_in_place(tmp_path):
    """A program that handles SIGTERM itself (to save a checkpoint and go on, say) keeps its handler
    and its files: removing them under a run that continues would lose its state."""
    code = """
import os, signal, sys, torch, fused_optim
seen = []
signal.signal(signal.SIGTERM, lambda *a: seen.append(1))
p = torch.nn.Parameter(torch.ones(100)); p.grad = torch.ones(100)
opt = fused_optim.CPUAdam([p], nvme_offload_fraction=1.0, nvme_offload_dir=sys.argv[1], fused=False)
opt.step()
os.kill(os.getpid(), signal.SIGTERM)
opt.step()
print("SEEN", len(seen), os.path.isdir(opt.state_files.directory))
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SEEN 1 True" in out.stdout


def test_a_state_loaded_into_a_running_optimizer_goes_into_its_files_again(tmp_path):
    """The loaded values replace the mapped tensors; at the next step they go back into the same
    files, and the steps go on as they do in memory."""
    p, opt = offloaded(tmp_path)
    opt.step()
    saved = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = torch.ones(1000)
    twin = fused_optim.CPUAdam([q], lr=0.1)
    reloaded = fused_optim.CPUAdam([p], lr=0.1, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    for o in (reloaded, twin):
        o.load_state_dict(copy.deepcopy(saved))  # (load_state_dict keeps the tensors it is given)
    reloaded.step()
    files = reloaded.state_files.files_of(p)
    reloaded.load_state_dict(copy.deepcopy(reloaded.state_dict()))  # into the optimizer whose files hold it
    reloaded.step()
    twin.step()
    twin.step()
    assert torch.equal(p, q)
    for key, path in zip(("exp_avg", "exp_avg_sq"), files):
        assert torch.equal(reloaded.state[p][key], twin.state[q][key])
        assert reloaded.state[p][key].untyped_storage().filename == str(path)
