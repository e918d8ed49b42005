"""``OverlappedGradSum``: the grads' flat all-reduce launched during the backward, bucket by bucket
as the grads become ready (as DDP's reducer does), and finished in the optimizer's step."""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import comm


class OverlappedGradSum:
    r"""g ← (Σ_ranks g) / D for the grads of ``params``, communicated while the backward runs.

    The buckets are :func:`comm.buckets` of the params in *reverse* order (the backward produces
    the last layers' grads first), the same buckets as the synchronous path of
    :class:`GenericCentralizedOptimizer`, so every bucket's buffer and sum are the same, bit for bit. A
    post-accumulate-grad hook per param counts its bucket's grads; when a bucket has all of them
    and every bucket before it is launched, it is packed and its all-reduce launched
    (``async_op``): buckets are launched in the same order on every rank, whatever order the grads
    come in, so the collectives always match. :meth:`finish_` (in ``step``) launches the buckets
    left (a param without a grad contributes zeros), waits, divides by D and unpacks.

    A grad accumulated again after its bucket was launched (two backwards per step: gradient
    accumulation) makes that bucket's sum stale. Every rank tells the others whether it has a
    stale bucket in one 1-element all-reduce per step; if any has, every rank discards the
    launched sums and the optimizer runs the synchronous path on the final grads: still exact, but accumulation
    pays for two all-reduces (use the synchronous mode there). Grads changed in place between the
    backward and ``step`` (clipping by hand) or assigned after the hooks fired are not seen: the
    sum is of the grads the backward produced (clip with ``grad_clip``, which acts on the average).
    """

    def __init__(self, params: Sequence[Tensor], *, by_layer: bool, cap_mb: float, divide_before: bool,
                 launch_divisor: float | None):
        self.params = list(params)
        self.by_layer, self.cap_mb, self.divide_before = by_layer, cap_mb, divide_before
        self.launch_divisor = launch_divisor  # divide_before's divisor, known before step
        last = len(self.params) - 1
        self.buckets = [[last - i for i in idx] for idx in comm.buckets(self.params[::-1], by_layer, cap_mb)]
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._buffers: list = []  # the packed buckets, kept from step to step (comm.reusable)
        self._reset()
        self._hook()

    def _hook(self) -> None:
        me = weakref.ref(self)  # the hooks do not keep a dropped optimizer communicating
        self._handles = [p.register_post_accumulate_grad_hook(lambda _, i=i: (me() or _Gone).ready(i))
                         for i, p in enumerate(self.params)]

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickle) hooks its own params: the hooks are not copied (a
        copy's handles would remove the original's hooks when the copy is dropped)."""
        if self._launched:
            raise RuntimeError("OverlappedGradSum: cannot copy an optimizer between a backward and its step (its "
                               "all-reduces are in flight): copy it after step()")
        return {k: v for k, v in self.__dict__.items() if k != "_handles"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._hook()

    def _reset(self) -> None:
        self._fired = [False] * len(self.params)
        self._left = [len(idx) for idx in self.buckets]
        self._launched: list[tuple[Tensor, object]] = []
        self._stale = False

    def __del__(self) -> None:
        for handle in getattr(self, "_handles", ()):
            handle.remove()

    @torch.no_grad()
    def ready(self, i: int) -> None:
        """Param ``i``'s grad is accumulated: launch every bucket that is now complete, in order."""
        b = self.bucket_of[i]
        if self._fired[i]:
            self._stale |= b < len(self._launched)
            return
        self._fired[i] = True
        self._left[b] -= 1
        while len(self._launched) < len(self.buckets) and not self._left[len(self._launched)]:
            self._launch()

    def _launch(self) -> None:
        b = len(self._launched)
        part = [self.params[i].grad for i in self.buckets[b]]
        self._launched.append(comm.start_sum(part, self.launch_divisor, self.divide_before,
                                             out=comm.reusable(self._buffers, b, part)))

    @torch.no_grad()
    def finish_(self, divisor: float | Tensor) -> bool:
        """Launch the buckets left (every param must have a grad), agree on staleness, wait,
        divide, unpack; ready for the next step. False (nothing unpacked) when some rank had a
        stale bucket: the caller then runs the synchronous path."""
        try:
            while len(self._launched) < len(self.buckets):
                self._launch()
            stale = torch.tensor([float(self._stale)], device=self.params[0].device)
            dist.all_reduce(stale)
            if bool(stale):
                for _, work in self._launched:
                    work.wait()
                return False
            for (flat, work), idx in zip(self._launched, self.buckets):
                comm.finish_mean_(flat, work, [self.params[i].grad for i in idx], divisor, self.divide_before)
            return True
        finally:
            self._reset()


class _Gone:
    """The hooks' target once the optimizer is gone: nothing to do."""

    @staticmethod
    def ready(i: int) -> None:
        pass
