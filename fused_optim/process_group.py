"""A DDP rank's process group, created and ended so that none of its threads outlives the
rank's Python; used by the adapters' training entry points, the demo and the DDP tests.

Why. A gloo process group runs worker threads that may drop the last reference to a tensor Python
created (``dist.all_reduce(t)`` returns when the work completes, the worker lets go of it just
after). Dropping it releases the tensor's Python object, which needs the GIL; once the interpreter
is finalizing, a thread that asks for the GIL is ended by ``pthread_exit``, whose unwinding through
the C++ destructor calls ``std::terminate``: the rank aborts after its work is done ("terminate
called without an active exception", pytorch/pytorch#190489). So the group must be destroyed,
which joins those threads, while Python is fully alive.

``torch.distributed.destroy_process_group()`` alone does not destroy it while something else holds
it: a DDP wrapper does, a training loop keeps its wrapper in reference cycles (mmengine's Runner)
until the interpreter's final collection, and ``torch._dynamo``, when first imported (by the first
DDP wrapper) while the group exists, keeps references to it for good. Hence
:func:`init_process_group` (``torch._dynamo`` imported first; Lightning imports it on its own
import) and :func:`end_process_group` (the garbage collected before the group is destroyed).
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def init_process_group(backend: str = "gloo", **kwargs) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, ``torch._dynamo`` imported
    first so that it holds no reference to the group (see above)."""
    import torch._dynamo  # noqa: F401

    dist.init_process_group(backend, **kwargs)


def end_process_group() -> None:
    """Once this rank's training is over and the objects holding the default process group (its
    DDP wrapper) are no longer referenced: wait for every rank (a rank that tears its group down
    while another still talks to it can make that one fail), collect the garbage that still
    holds the group, and destroy it, which ends its worker threads now. Nothing without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
