"""Helpers for testing code that runs fused_optim: :func:`emulated_cuda`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import _build, _ops


@contextlib.contextmanager
def emulated_cuda() -> Iterator[None]:
    """Inside the block, every fused optimizer step and ``fused_optim.multi_tensor_l2norm`` /
    ``sum_squares_`` call sends its CPU tensors through the CUDA code instead of the CPU kernels:
    the CUDA binding (``csrc/cuda/binding.cpp``), the launcher and the kernels, compiled for the CPU
    with an emulation of the CUDA they use (``csrc/emulation``)::

        with fused_optim.testing.emulated_cuda():
            opt.step()

    Every launch runs its real blocks of 512 threads in 32-lane warps, with real barriers and warp
    shuffles (each thread a fiber; docs/design.md says how), fp16/bf16 converted as CUDA converts.
    What it proves on any machine: the CUDA code's indexing, chunking and launch splitting, its
    reductions, barriers and shuffles (misuse fails the launch with a message), its conversions
    and the binding's logic compute what the CPU kernels and the reference compute. What only a
    GPU shows: timing, streams and CUDA graphs, and the memory model (blocks run one after
    another here, so races between blocks or threads are not seen).

    The library is built on first use (a minute; later uses load the cached build) and raises
    ``fused_optim._build.BuildError`` when it cannot be built. Params and state are ordinary CPU
    tensors; an optimizer steps through the list ops, as it does on a GPU. The routing is
    process-wide: steps taken in other threads while the block runs are emulated too.
    """
    _build.load_emulated_cuda()
    with _ops.routed_to_emulated_cuda():
        yield
