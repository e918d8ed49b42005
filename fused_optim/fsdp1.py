"""FSDP1's params (``torch.distributed.fsdp.FullyShardedDataParallel``): the one place that reads
FSDP1's private marks on them.

FSDP1 flattens the params of each wrapped module into one 1-D ``FlatParameter`` and shards that
across the ranks (padded to a multiple of the world size). With ``use_orig_params=False`` the
optimizer gets the FlatParameters: on each rank, its slice of the concatenated params. With
``use_orig_params=True`` it gets the original params, each a 1-D view of the part of it that lies
in this rank's slice (empty, and without a grad, when none does). Either way a param holds
elements of tensors, not whole tensors. An elementwise update of those elements is the update of
the whole model's, so elementwise optimizers step them through the kernels exactly (a
FlatParameter is a plain ``nn.Parameter`` to them). An optimizer whose rule reads each whole
tensor (a layer-wise trust ratio from its norms, SparsifiedSGD's coordinates per tensor) would
read a slice and silently be another algorithm: it refuses FSDP1's params when it is made
(:func:`check_whole_tensors`).

The marks, checked on torch 2.13 (tests/distributed/test_fsdp1.py fails if torch drops them):
``FlatParameter(...)`` returns an ``nn.Parameter`` with ``_is_flat_param = True``
(torch/distributed/fsdp/_flat_param.py), and FSDP1 sets ``_fsdp_flattened = True`` on each
original param it flattens and on each FlatParameter (``_set_fsdp_flattened`` in
torch/distributed/fsdp/_common_utils.py). FSDP2's ``fully_shard`` sets neither: its params are
DTensors (:mod:`.sharding`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

_FLAT_PARAM = "_is_flat_param"  # on a FlatParameter (use_orig_params=False)
_FLATTENED = "_fsdp_flattened"  # on every param FSDP1 flattened, and on its FlatParameters

INSTEAD = ("shard the model with FSDP2 (torch.distributed.fsdp.fully_shard), whose DTensor params it steps with "
           "the norms of the whole tensors, or step FSDP1's params with an elementwise optimizer (FusedAdam, FusedSGD)")


def is_fsdp1_param(p: Tensor) -> bool:
    """Whether ``p`` is a FlatParameter, or an original param that FSDP1 flattened into one."""
    return bool(getattr(p, _FLAT_PARAM, False) or getattr(p, _FLATTENED, False))


def check_whole_tensors(params: Iterable[Tensor], gi: int, optimizer: str, rule: str, instead: str) -> None:
    """Raises ``ValueError`` for the first FSDP1 param of group ``gi``'s ``params``, saying what
    ``optimizer`` does with each whole tensor (``rule``, a verb phrase) and what to use ``instead``."""
    for i, p in enumerate(params):
        if is_fsdp1_param(p):
            kind = "a FlatParameter made" if getattr(p, _FLAT_PARAM, False) else "a param flattened"
            raise ValueError(
                f"{optimizer}: param {i} of group {gi} is {kind} by FSDP1 (FullyShardedDataParallel), which "
                f"shards flattened params: this rank holds a slice of their elements, not whole tensors, and "
                f"{optimizer} {rule}, which on a slice would be another algorithm; {instead}"
            )
