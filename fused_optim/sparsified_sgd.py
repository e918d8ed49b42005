"""SparsifiedSGD: error-feedback SGD applying k coordinates per tensor per step (mlbench_core)."""

from __future__ import annotations

import numbers

import torch

from . import sharding
from .checks import check_lr, check_nonnegative, check_range
from .optimizer import FusedOptimizer
from .param_state import state_like


class SparsifiedSGD(FusedOptimizer):
    r"""Sparsified SGD with memory (Stich et al., "Sparsified SGD with Memory", 2018), fused.

    Update rule, per parameter p (D elements) with gradient g (η lr, λ weight_decay,
    k sparse_grad_size)::

        memory ← memory + η·g
        k ← min(k, D)
        S ← k coordinates: a random subset (random_sparse) or a random block [b·k, b·k + k)
            with b uniform in [0, ⌈D/k⌉) (the last block may be shorter); none if D = 0
        s ← memory restricted to S ;  memory[S] ← 0
        p ← p − λ·p                 (λ is not multiplied by η, as in the reference)
        p ← p − s

    Estimated weights (the paper's weighted average of iterates), with τ = D/k::

        ρ_t = 6(t + τ)² / ((1 + t)(6τ² + t + 6τt + 2t²))   (ρ_0 = 1)
        estimated_w ← (1 − ρ_t)·estimated_w + ρ_t·p        (update_estimated_weights(t))

    Deviations from mlbench_core's ``SparsifiedSGD`` (the numerical reference of the averaging):
    the constructor does not re-initialise the params, the step uses lr and applies the sparse
    update itself (mlbench leaves that to its distributed wrapper), any param shape works (the
    reference needs (1, D)), the block choice covers every coordinate (the reference never sends
    the last D mod k), and the coordinates come from the optimizer's own ``torch.Generator``
    (``generator``, seeded with ``seed``), saved in the state dict so a reloaded run draws the
    same coordinates. DTensor params (FSDP2's, tensor parallelism's, both) step as their whole
    tensors: every rank draws the whole tensor's coordinates (the generator's state is broadcast
    from the first rank of their mesh when the optimizer is made, and when a group of them is
    added) and each shard applies those in its box. Where the reference fails: a k larger than a
    param sends all of its coordinates (the reference's draws raise), as k is one budget for
    every tensor of a model, whose biases may be smaller than k next to weights far larger, so an
    error would force a param group per tensor size; and an empty param sends nothing and draws
    nothing from the generator (the reference divides by zero). The averaging keeps the
    reference's τ = D/k also for k > D.
    State: ``memory`` per param, and ``estimated_w`` from the first call of
    ``update_estimated_weights`` / ``get_estimated_weights`` (starting as the param then).

    Args:
        params: iterable of params or param-group dicts.
        lr: η (>= 0; None: each param group gives its own). weight_decay: λ (>= 0). sparse_grad_size: k (>= 1).
        random_sparse: random coordinates instead of a random block.
        seed: seed of the private generator (None: a random seed).
        set_grad_none: default of ``zero_grad(set_to_none=None)``.
        fused: None (kernels when possible), True (kernels or error), False (reference).
    """

    op_name = "sparsified_sgd_"
    whole_tensor_rule = ("sends sparse_grad_size coordinates (a random subset or block) of each whole tensor per step",
                         "train with replicated params (DDP), or step FSDP1's params with an elementwise optimizer")
    extra_flags = ("random_sparse",)

    def __init__(self, params, lr: float | None = None, weight_decay: float = 0.0, sparse_grad_size: int = 10,
                 random_sparse: bool = False, *, seed: int | None = None, set_grad_none: bool = True,
                 master_weights: bool = False, fused: bool | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        defaults = dict(lr=lr, weight_decay=weight_decay, sparse_grad_size=sparse_grad_size,
                        random_sparse=random_sparse)
        self._made = False  # (the groups of the constructor share the generator once, at its end)
        super().__init__(params, defaults, fused=fused, set_grad_none=set_grad_none, master_weights=master_weights)
        self._made = True
        self._share_generator([p for g in self.param_groups for p in g["params"]])

    def add_param_group(self, param_group: dict) -> None:
        """torch's; a group of DTensor params added later shares the generator (:meth:`_share_generator`)."""
        super().add_param_group(param_group)
        if getattr(self, "_made", True):
            self._share_generator(self.param_groups[-1]["params"])

    def _share_generator(self, params: list) -> None:
        """Where ``params`` hold DTensors, every rank of their meshes must draw the same coordinates
        from now on: the generator's state is broadcast over each mesh dimension from its first rank
        (so every rank of a mesh gets its first rank's state). A collective: every rank makes the
        optimizer and adds the group, as with FSDP2."""
        meshes = list(dict.fromkeys(p.device_mesh for p in params if sharding.is_dtensor(p)))
        if not meshes:
            return
        import torch.distributed as dist

        for mesh in meshes:
            state = self.generator.get_state().to(sharding.mesh_device(mesh))
            for d in range(mesh.ndim):
                dist.broadcast(state, group=mesh.get_group(d), group_src=0)
            self.generator.set_state(state.cpu())

    def _validate(self, group: dict) -> None:
        check_lr(group["lr"])
        check_nonnegative("weight_decay", group["weight_decay"])
        k = group["sparse_grad_size"]
        check_range("sparse_grad_size", k, isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1,
                    "need an int >= 1")

    def _check_unfused(self, p: torch.Tensor, state: dict, where: str) -> None:
        super()._check_unfused(p, state, where)
        if sharding.is_dtensor(p):
            raise RuntimeError(f"SparsifiedSGD: {where} is a DTensor, whose shards the fused kernels step only (the "
                               "reference draws per tensor it is given); use a device and dtype the kernels serve")

    def _sharded_kwargs(self, bucket) -> dict:
        """Each shard's whole tensor's shape and its box's offsets, concatenated: the kernels draw
        the whole tensor's coordinates and apply those in the box (csrc/host/sparse_indices.h)."""
        return dict(whole_shapes=[n for p in bucket.params for n in p.shape],
                    box_offsets=[o for p in bucket.params for o in sharding.box_offsets(p)])

    def _init_state(self, p, state, group) -> None:
        if "memory" not in state:
            state["memory"] = torch.zeros_like(state_like(p, state), memory_format=torch.contiguous_format)

    @torch.no_grad()
    def update_estimated_weights(self, iteration: int, sparse_vector_size: int | None = None) -> None:
        """Fold the current params into the estimated weights with weight ρ_iteration (above);
        ``sparse_vector_size`` defaults to each group's ``sparse_grad_size``."""
        t = iteration
        for group in self.param_groups:
            k = sparse_vector_size or group["sparse_grad_size"]
            for p in group["params"]:
                if p.numel() == 0:  # nothing to average (and τ = 0 makes ρ_0 = 0/0)
                    self._estimate(p)
                    continue
                tau = p.numel() / k
                rho = 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau**2 + t + 6 * tau * t + 2 * t**2))
                est = self._estimate(p)
                est.mul_(1 - rho).add_(p, alpha=rho)

    def get_estimated_weights(self) -> list[torch.Tensor]:
        return [self._estimate(p) for group in self.param_groups for p in group["params"]]

    def _estimate(self, p: torch.Tensor) -> torch.Tensor:
        """The param's estimate, starting as the param itself (ρ_0 = 1 makes the start irrelevant)."""
        state = self.state[p]
        if "estimated_w" not in state:
            state["estimated_w"] = p.detach().clone(memory_format=torch.contiguous_format)
        return state["estimated_w"]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "generator": self.generator.get_state()}

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "generator": self.generator.get_state()}

    def __setstate__(self, state: dict) -> None:
        generator = state.pop("generator", None)
        super().__setstate__(state)
        if "generator" not in self.__dict__:  # a copy (deepcopy, pickle): its own generator, in the saved state
            self.generator = torch.Generator()
            self.generator.set_state(generator)

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        generator = state_dict.pop("generator", None)
        super().load_state_dict(state_dict)
        if generator is not None:
            self.generator.set_state(generator)
