"""Schemas and fake implementations of every fused_optim op: the single source of truth for op
signatures.

Importing this module needs no compiler. The C++ files under ``csrc/`` only register
implementations for these schemas (``TORCH_LIBRARY_IMPL(fused_optim, CPU, m)``), which are loaded
lazily by :mod:`fused_optim._build`; :mod:`fused_optim._reference` implements the update ops with
the same signatures in pure PyTorch.

Update ops (one per declaration in :data:`fused_optim.specs.SPECS`: ``sgd_``, ``adam_``, …) are
in-place (trailing underscore), take the params, the grads, the algorithm's state lists, its
per-step lists and keyword scalars, plus the optional
``grad_scale`` / ``found_inf`` of ``torch.amp.GradScaler``: grads are divided by ``grad_scale``
inside the op, which writes them back so divided (``g·(1/grad_scale)`` rounded to their dtype,
what ``GradScaler.unscale_`` makes of them) when the scale is not 1, and nothing at all changes
when ``found_inf`` is non-zero (step counters included). ``adam_`` also takes ColossalAI's
``div_scale``, which divides the grads in the update only.
``lr_tensor`` (one element), when given, is the learning rate and ``lr`` is ignored: on CUDA the
kernels read it, ``grad_scale`` and ``found_inf`` on the device, so a step does no host sync and a
CUDA graph replay sees the tensor's current value (torch.optim's Tensor lr).
The momentum ops' ``first_step`` has one flag per param (True: its momentum buffer is set to the grad,
torch.optim's first step), or is empty when no param is on its first step.

Each update op, and each compact twin (``<name>compact_``, below), has an eager-only twin
``<name>bucket`` taking ``int bucket`` in place of the params, grads and state lists:
``bucket_new(tensors, lengths)`` keeps those lists on the C++ side (one flat list cut into
consecutive lists of the given lengths) until ``bucket_free``, and the twin reads each param's
``.grad`` itself, so a step passes no tensor list at all (the dispatcher converts every Python
tensor list on every call, ~85 ns per tensor per list). A twin returns 0 when it stepped and 1,
changing nothing, when a registered param has no grad; ``bucket_grads_match(bucket)`` says whether
every registered param has a dense grad of its shape and dtype (a twin then cannot fail on its
grads). The twins mutate tensors their schema does not name and bump their version counters
themselves: they are for plain eager steps, never traced; ``torch.compile`` uses the list ops.
Both schemas come from the op's declaration in :mod:`.specs` (``OpSpec.schemas``,
``OpSpec.compact_schemas``), and the C++ side generates every twin from its list op's
implementation (``bucket_twin`` in ``csrc/cpu/bucket.h``): a new update op's file registers its
twin in one line (``impl_twin``).

``l2norm(tensors) -> (global, per_tensor)`` is the multi-tensor norm (see
``fused_optim.multi_tensor_l2norm``); the layer-wise ops (LARS, LAMB) compute their per-tensor
norms inside the kernel, without a host sync per tensor. ``lamb_`` clips with
``global_grad_norm`` (the norm over all groups' grads, a tensor), or when it is None with the norm
of the grads it was given (the optimizer passes None when one call holds every grad).
The layer-wise ops (``lars_``, ``colossal_lars_``, ``lamb_``, ``colossal_lamb_`` and their compact
twins) take ``norm_sums`` and ``sums_only`` for params sharded across processes, whose norms are
those of the whole tensors: ``norm_sums`` is a float64 [n, 2] tensor on the params' device, row t
(S_p, S_x) for param t, S_p = Σv² of the values updated (the masters, if any) and S_x = Σg² of
the grads as stored (LARS) or Σu² of LAMB's update direction. A ``sums_only=True`` call writes
the local rows and nothing else (no state, step counter or rounding key; nothing at all when
``found_inf`` is set); a call with ``norm_sums`` and ``sums_only=False`` updates with the rows it
is given in place of its own sums. Given the rows the first call wrote, the two calls are one
plain call, bit for bit.
``sum_squares_(sums, tensors, index)`` adds Σx² of ``tensors[i]`` to ``sums[index[i]]`` (float64):
AdaScale's per-group sums of squared gradient norms. ``grad_norm_hooks(params, index, sums, counts)``
registers C++ gradient hooks doing ``sum_squares_(sums, [g], [index[i]])`` for each micro-batch
grad g of ``params[i]`` and counting backward passes in ``counts`` (int64: [passes, graph task id
of the last, window length w, window handle]); at the end of the backward pass that brings the count
to w (w > 0) they run ``adascale_window_end(counts)``, an op implemented in Python by
:mod:`fused_optim.adascale`. It returns the hooks' positions for ``remove_grad_hooks(params, positions)``.
``grad_sum_squares_(sums, params, index)`` is ``sum_squares_`` of the ``.grad`` of those params that
have one (read on the C++ side).
``powersgd_accumulate_`` and ``powersgd_decompress_`` are PowerSGD's two passes over its error
memories, CPU only (their math and torch-op reference: ``fused_optim.distributed.powersgd``).

``torch.ops.fused_optim_emulated_cuda`` holds the list ops, ``l2norm`` and ``sum_squares_`` again,
implemented for CPU tensors by the CUDA binding and kernels compiled for the CPU (see
``fused_optim.testing.emulated_cuda``); its schemas are defined when that library is first loaded.
"""

from __future__ import annotations

import contextlib

import torch

from .specs import SPECS

# What the update ops' kernels take: params (and grads) of these dtypes on these device types.
FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FUSED_DEVICE_TYPES = ("cpu", "cuda")

# The list op's and its bucket twin's schemas, from the op's declaration in specs.py.
UPDATE_OPS = {name: spec.schemas() for name, spec in SPECS.items()}
L2NORM_SCHEMA = "(Tensor[] tensors) -> (Tensor, Tensor)"
SUM_SQUARES_SCHEMA = "(Tensor(a!) sums, Tensor[] tensors, int[] index) -> ()"

_lib = torch.library.Library("fused_optim", "DEF")  # noqa: TOR901 - keeps the definitions alive


def _fake(*args, **kwargs) -> None:
    """In-place ops return nothing; shapes and dtypes of the outputs are those of the inputs."""
    return None


for _name, _variants in UPDATE_OPS.items():
    _lib.define(_name + _variants[""])
    torch.library.register_fake(f"fused_optim::{_name}", _fake, lib=_lib)
    _lib.define(_name + "bucket" + _variants["bucket"])
# The compact twins (bf16 / 8-bit state, stochastic rounding), each with its bucket twin too.
COMPACT_OPS = {spec.compact_name: spec.compact_schemas() for spec in SPECS.values() if spec.compact}
for _name, _variants in COMPACT_OPS.items():
    _lib.define(_name + _variants[""])
    torch.library.register_fake(f"fused_optim::{_name}", _fake, lib=_lib)
    _lib.define(_name + "bucket" + _variants["bucket"])
_lib.define("bucket_new(Tensor[] tensors, int[] lengths) -> int")
_lib.define("l2norm" + L2NORM_SCHEMA)


@torch.library.register_fake("fused_optim::l2norm", lib=_lib)
def _l2norm_fake(tensors):
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.empty((), dtype=dtype, device=device), torch.empty(len(tensors), dtype=dtype, device=device)


_lib.define("sum_squares_" + SUM_SQUARES_SCHEMA)
torch.library.register_fake("fused_optim::sum_squares_", _fake, lib=_lib)
_lib.define("bucket_free(int bucket) -> ()")
_lib.define("bucket_grads_match(int bucket) -> bool")
_lib.define("grad_norm_hooks(Tensor[] params, int[] index, Tensor(a!) sums, Tensor(b!) counts) -> int[]")
_lib.define("remove_grad_hooks(Tensor[] params, int[] positions) -> ()")
_lib.define("adascale_window_end(Tensor counts) -> ()")
_lib.define("grad_sum_squares_(Tensor(a!) sums, Tensor[] params, int[] index) -> ()")
# PowerSGD's fused passes (fused_optim.distributed.powersgd: accumulate_project_, decompress_)
_lib.define("powersgd_accumulate_(Tensor(a!)[] memories, Tensor[] grads, Tensor[] qts, Tensor(b!)[] pts) -> ()")
_lib.define("powersgd_decompress_(Tensor(a!)[] memories, Tensor(b!)[] grads, Tensor[] pts, Tensor[] qts) -> ()")
for _name in ("powersgd_accumulate_", "powersgd_decompress_"):
    torch.library.register_fake(f"fused_optim::{_name}", _fake, lib=_lib)


# The CUDA binding compiled for the CPU (csrc/emulation) registers its ops, the list ops and the
# norms, for CPU tensors in a namespace of its own: the real CPU ops are never touched.
EMULATED_CUDA = "fused_optim_emulated_cuda"
EMULATED_CUDA_OPS = {**{name: variants[""] for name, variants in (UPDATE_OPS | COMPACT_OPS).items()},
                     "l2norm": L2NORM_SCHEMA, "sum_squares_": SUM_SQUARES_SCHEMA}
_emulated_lib: torch.library.Library | None = None


class Routing:
    """Where :func:`op` sends the names the emulated CUDA library has: ``emulated_cuda``, the
    depth of :func:`routed_to_emulated_cuda` blocks (0: the CPU kernels). An attribute, not a
    function, so that a steady step reads it without a call."""

    emulated_cuda = 0


ROUTING = Routing()


def define_emulated_cuda_ops() -> None:
    """Defines the ops of ``torch.ops.fused_optim_emulated_cuda`` (once), before their library loads."""
    global _emulated_lib
    if _emulated_lib is None:
        lib = torch.library.Library(EMULATED_CUDA, "DEF")  # noqa: TOR901 - kept alive in _emulated_lib
        for name, schema in EMULATED_CUDA_OPS.items():
            lib.define(name + schema)
        _emulated_lib = lib


@contextlib.contextmanager
def routed_to_emulated_cuda():
    """Inside the block :func:`op` gives the emulated CUDA library's op for the names it has (see
    ``fused_optim.testing.emulated_cuda``, which loads that library first)."""
    ROUTING.emulated_cuda += 1
    try:
        yield
    finally:
        ROUTING.emulated_cuda -= 1


def op(name: str):
    """The registered op ``torch.ops.fused_optim.<name>`` (its CPU kernel needs the JIT build), or
    inside :func:`routed_to_emulated_cuda` ``torch.ops.fused_optim_emulated_cuda.<name>`` where
    that library has it."""
    if ROUTING.emulated_cuda and name in EMULATED_CUDA_OPS:
        return getattr(getattr(torch.ops, EMULATED_CUDA), name)
    return getattr(torch.ops.fused_optim, name)
