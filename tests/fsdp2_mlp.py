"""The small FSDP2 model the checkpoint and CPU-offload workers train (tests/workers/dcp_worker.py,
offload_worker.py): a 2-layer MLP, each Linear and the whole model under ``fully_shard``, fed the
same batches on every rank (FSDP2 averages equal grads to themselves exactly)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fused_optim import sharding


def make_mlp(seed: int, dtype: torch.dtype, mesh=None, **shard_options) -> torch.nn.Module:
    """The MLP (values from ``seed``, in ``dtype``), under ``fully_shard(..., mesh=mesh,
    **shard_options)`` when a mesh is given, else plain."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3)).to(dtype)
    if mesh is not None:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, **shard_options)
        fully_shard(model, mesh=mesh, **shard_options)
    return model


def batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    """Step ``step``'s batch, the same on every rank."""
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + step)).to(dtype)


def train(model: torch.nn.Module, opt, steps: range, dtype: torch.dtype) -> None:
    """One forward, backward and optimizer step per step in ``steps``."""
    for k in steps:
        opt.zero_grad()
        model(batch(k, dtype)).float().square().mean().backward()
        opt.step()


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (``full_tensor()``, a collective, on the mesh's device: an offloaded
    shard's CPU tensor would not pass NCCL), else a copy; on the CPU."""
    if isinstance(t, DTensor):
        return t.to(sharding.mesh_device(t.device_mesh)).full_tensor().cpu()
    return t.detach().cpu().clone()


def record(model, opt) -> dict:
    """Params and optimizer state, whole tensors by FQN."""
    named = dict(model.named_parameters())
    return {"params": {n: whole(p) for n, p in named.items()},
            "state": {n: {k: whole(v) for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
                      for n, p in named.items()},
            "implementation": opt.implementation}
