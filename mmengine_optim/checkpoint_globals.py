"""The globals mmengine writes into a checkpoint, allowed for ``torch.load(weights_only=True)``
(torch ≥ 2.6's default), so a run with mmengine's own ``CheckpointHook`` resumes.

mmengine 0.10.7 saves its message hub: ``HistoryBuffer`` objects (numpy arrays, and their
statistics methods, pickled as ``getattr(HistoryBuffer, 'mean')``) and numpy scalars (the ETA),
and resumes with ``torch.load`` and torch's default ``weights_only=True``, which refuses them
(mmengine#1655). Importing ``mmengine_optim`` allows exactly these (:data:`CHECKPOINT_GLOBALS`),
with one narrowing: the checkpoint's ``builtins.getattr`` resolves to :func:`history_buffer_method`,
which returns only a ``HistoryBuffer`` statistics method and refuses everything else (the real
``getattr`` would let a checkpoint reach any attribute of any allowed object).
"""

from __future__ import annotations

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

GETATTR = "builtins.getattr"


def history_buffer_method(owner, name: str):
    """``getattr(HistoryBuffer, name)`` for a statistics method of ``HistoryBuffer`` (what mmengine
    pickles in a buffer's state); anything else raises."""
    method = getattr(HistoryBuffer, name, None) if owner is HistoryBuffer and isinstance(name, str) else None
    if not callable(method) or name.startswith("_"):
        raise ValueError(f"mmengine_optim allows {GETATTR} in a checkpoint only for a HistoryBuffer statistics "
                         f"method (getattr(HistoryBuffer, 'mean')), not getattr({owner!r}, {name!r})")
    return method


# How numpy pickles: an array as _reconstruct(ndarray, ...) plus a dtype, a scalar as scalar(dtype, bytes);
# the dtype is built as np.dtype('f8') and then its class's state (Float64DType on numpy 2). The
# buffers hold float64 values and int64 counts. The names (numpy.core in 1.x, numpy._core in 2.x)
# are the installed numpy's, as in the checkpoint.
_RECONSTRUCT_ARRAY = np.ndarray(0).__reduce__()[0]
_RECONSTRUCT_SCALAR = np.float64(0).__reduce__()[0]
_DTYPE_CLASSES = (type(np.dtype(np.float64)), type(np.dtype(np.int64)))

# (object, the name the checkpoint gives it)
CHECKPOINT_GLOBALS: tuple[tuple[object, str], ...] = (
    *((obj, f"{obj.__module__}.{obj.__qualname__}")
      for obj in (HistoryBuffer, np.ndarray, np.dtype, _RECONSTRUCT_ARRAY, _RECONSTRUCT_SCALAR,
                  *_DTYPE_CLASSES)),
    (history_buffer_method, GETATTR),
)


def register_checkpoint_globals() -> None:
    """Allow :data:`CHECKPOINT_GLOBALS` in ``torch.load(weights_only=True)`` (process-wide)."""
    torch.serialization.add_safe_globals(list(CHECKPOINT_GLOBALS))
