"""Optimizer state kept in memory-mapped files: ColossalAI's ``nvme_offload_fraction``.

ColossalAI moves a fraction of the optimizer state to NVMe with its own asynchronous reader and
writer (tensornvme) around each param's update. Here the state tensors of that fraction are
*mapped* from files (``torch.from_file(..., shared=True)``): the kernels update them in place,
and the kernel's page cache writes them back and evicts them under memory pressure, so they need
no RAM of their own. Nothing else changes: the same kernels, bit for bit the same results.

Which params: in the order of the optimizer's param groups, each CPU param whose state fits in
the budget ``floor(fraction · Σ numel of all params)`` (ColossalAI's rule, which counts in order of
first steps instead; the group order gives the same choice after a resume). Their state tensors
named by ``keys`` live in ``<dir>/<group>_<index>_<key>.bin``, ``dir`` a fresh folder made inside
``nvme_offload_dir`` (or the system's temporary folder) and removed with the optimizer.

Saving copies the values into the checkpoint like any tensor (ColossalAI refuses to save
offloaded state); loading a state dict puts the loaded values back into the files, so a resumed
run offloads the same params.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from .optimizer import is_real


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
        self._offloaded: dict[int, Path] | None = None  # id(param) -> its files' prefix (when chosen)
        self.directory: Path | None = None
        if self.fraction > 0:
            try:
                if directory is not None:
                    Path(directory).mkdir(parents=True, exist_ok=True)
                self.directory = Path(tempfile.mkdtemp(prefix="fused_optim_state_", dir=directory))
            except OSError as e:
                raise ValueError(f"Invalid nvme_offload_dir value: {str(directory)!r}: cannot create a folder there "
                                 f"({e.strerror}); give a writable folder") from None
            weakref.finalize(owner, shutil.rmtree, self.directory, True)

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
        if self._offloaded is None:
            self._offloaded = self._choose()
        prefix = self._offloaded.get(id(p))
        if prefix is None:
            return
        for key in self.keys:
            value = state.get(key)
            path = f"{prefix}_{key}.bin"
            if value is None or getattr(value.untyped_storage(), "filename", None) == path:
                continue
            mapped = torch.from_file(path, shared=True, size=value.numel(), dtype=value.dtype).view_as(value)
            state[key] = mapped.copy_(value)

    def files_of(self, p: torch.Tensor) -> list[Path]:
        """The files holding ``p``'s state (empty: it is in memory)."""
        prefix = None if self._offloaded is None else self._offloaded.get(id(p))
        return [] if prefix is None else [Path(f"{prefix}_{key}.bin") for key in self.keys]
