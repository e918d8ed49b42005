"""Subprocess side of tests/distributed/test_sharded_stats.py: one gloo rank measuring AdaScale's and
NoiseScale's statistics on DTensor params, and the same params whole.

    sharded_stats_worker.py RANK WORLD OUT_DIR      (all ranks at once; they meet through OUT_DIR/store)

Each rank trains the same float64 params twice: as DTensors on a mesh of all ranks (one model
replica held in shards, as tensor parallelism holds it: Shard(0) and Shard(1), some rows empty
on a rank; a Replicate param; a plain param beside them; two param groups) and as plain tensors,
with the same micro-batches. The loss is elementwise in each param (Σ w·(p·x − y)², divided by
the accumulation count), so both runs get bitwise equal gradients and differ only in the order
the sums of squares are added. After each step the whole run's params are set to the sharded
run's (each window starts from equal params). Saved to OUT_DIR/rank<r>.pt:
``{"runs": {name: {"sharded": [record per step], "whole": [...], "warnings", "implementation"}},
"refusals": {case: message}}``; a record holds the ended window's per-group sums, the gains or
noise scale read before ``step()``, and the params before and after it.

Then each rank trains the same params again, with its own micro-batches, twice: sharded by FSDP2
(``fully_shard``, one unit per param group and the root, the statistics given ``module=``) and
whole under DDP, N = WORLD ranks. The loss is elementwise again: each rank's micro-batch
gradients are bitwise equal in both runs, and so are the averaged ``.grad`` (each rank sums its
micro-batches, then the two sums are averaged once: see :func:`no_sync`). Saved under
``"fsdp2"`` as ``{name: {"sharded": [...], "ddp": [...], "world_size", "implementation"}}``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fused_optim
from fused_optim.process_group import end_process_group, init_process_group

TIMEOUT = timedelta(seconds=120)  # a rank that fails makes the others' collectives fail, not hang
STEPS, ACCUM, LR = 5, 3, 0.1
# (shape, placement, group): 7 rows and 5 columns do not split evenly over 2 ranks; 600 rows span
# more than one of the kernels' work items.
PARAMS = [((7, 4), Shard(0), 0), ((6,), Replicate(), 0), ((3, 5), Shard(1), 1), ((600,), Shard(0), 1),
          ((4, 2), None, 1)]


def data(step: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) per param of micro-batch ``micro`` of ``step``: y has a mean (the gradient signal)
    and noise (the variance between micro-batches)."""
    gen = torch.Generator().manual_seed(100 * step + micro)
    return [(torch.randn(shape, generator=gen, dtype=torch.float64),
             1.0 + 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)) for shape, _, _ in PARAMS]


def place(t: torch.Tensor, placement, mesh) -> torch.Tensor:
    return t if placement is None else distribute_tensor(t, mesh, [placement])


def loss(params: list[torch.Tensor], batch, mesh, sharded: bool) -> torch.Tensor:
    """Σ over params of Σ (p·x − y)² / ACCUM: elementwise, so every gradient element is the same
    whether the param is whole or a shard."""
    dtensor_terms, plain_terms = [], []
    for p, (x, y), (_, placement, _) in zip(params, batch, PARAMS):
        if sharded and placement is not None:
            x, y = place(x, placement, mesh), place(y, placement, mesh)
            dtensor_terms.append((p * x - y).square().sum())
        else:
            plain_terms.append((p * x - y).square().sum())
    total = sum(plain_terms)
    if dtensor_terms:
        total = total + sum(dtensor_terms).full_tensor()
    return total / ACCUM


def make(cls, params: list[torch.Tensor], **kwargs):
    groups = [{"params": [p for p, (_, _, g) in zip(params, PARAMS) if g == k]} for k in (0, 1)]
    return cls(fused_optim.FusedSGD(groups, lr=LR), world_size=1, num_gradients_to_accumulate=ACCUM, **kwargs)


def observe(opt) -> dict:
    window = opt._pending  # the window the last backward ended, which step() takes
    record = {"local": window.local, "total": window.total, "passes": window.passes}
    if isinstance(opt, fused_optim.AdaScale):
        record.update(gain=opt.gain(), gains=[opt.gain(k) for k in range(len(opt.param_groups))])
    else:
        record.update(b_simple=opt.b_simple)
    return record


def whole_values(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in params]


def run(cls, mesh, **kwargs) -> dict:
    """``cls`` (AdaScale or NoiseScale over FusedSGD) stepped STEPS times on the DTensor params and
    on the same params whole."""
    init = [torch.randn(shape, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64)
            for i, (shape, _, _) in enumerate(PARAMS)]
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    sharded = [torch.nn.Parameter(place(t.clone(), placement, mesh)) for t, (_, placement, _) in zip(init, PARAMS)]
    runs = {"sharded": (sharded, make(cls, sharded, **kwargs)), "whole": (whole, make(cls, whole, **kwargs))}
    trace = {"sharded": [], "whole": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for name, (params, opt) in runs.items():
                for micro in range(ACCUM):
                    loss(params, data(step, micro), mesh, name == "sharded").backward()
                record = {**observe(opt), "before": whole_values(params)}
                opt.step()
                record["params"] = whole_values(params)
                trace[name].append(record)
                opt.zero_grad()
            with torch.no_grad():  # the next window from equal params
                for p, q in zip(whole, trace["sharded"][-1]["params"]):
                    p.copy_(q)
    return {**trace, "warnings": [str(w.message) for w in caught],
            "implementation": runs["sharded"][1].implementation}


class Terms(torch.nn.Module):
    """Params whose loss term is Σ (p·x − y)² / ACCUM for a micro-batch of (x, y) per param."""

    def __init__(self, init: list[torch.Tensor]):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in init])

    def forward(self, batch) -> torch.Tensor:
        return sum(((p * x - y).square().sum() for p, (x, y) in zip(self.params, batch))) / ACCUM


class Elementwise(torch.nn.Module):
    """The params of PARAMS: each param group's but the last param in a child :class:`Terms`
    (FSDP2 makes each child a unit), the last param on the root; ``forward(batch)`` is
    :func:`loss` of the whole params."""

    def __init__(self, init: list[torch.Tensor]):
        super().__init__()
        self.members = [[i for i, (_, _, g) in enumerate(PARAMS[:-1]) if g == k] for k in (0, 1)]
        self.groups = torch.nn.ModuleList(Terms([init[i] for i in m]) for m in self.members)
        self.last = Terms(init[-1:])

    def ordered(self) -> list[torch.Tensor]:
        """The params in PARAMS' order."""
        at = {i: p for m, child in zip(self.members, self.groups) for i, p in zip(m, child.params)}
        return [at[i] for i in range(len(PARAMS) - 1)] + [self.last.params[0]]

    def forward(self, batch) -> torch.Tensor:
        parts = [child([batch[i] for i in m]) for m, child in zip(self.members, self.groups)]
        return sum(parts) + self.last(batch[-1:])


def no_sync(model, last: bool):
    """The gradients of a window's backward passes but the last accumulate on the rank (DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``), so that both runs average the
    same sums over the ranks once: their ``.grad`` are bitwise equal."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def fsdp2_vs_ddp(cls, mesh, rank: int, **kwargs) -> dict:
    """``cls`` over FusedSGD stepped STEPS times on an :class:`Elementwise` sharded by FSDP2 and on
    one under DDP, each rank with its own micro-batches; the DDP params are set to the FSDP2 ones
    after each step (each window starts from equal params)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    init = [torch.randn(shape, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64)
            for i, (shape, _, _) in enumerate(PARAMS)]
    sharded, whole = Elementwise(init), Elementwise(init)
    for child in sharded.groups:
        fully_shard(child, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    models = {"sharded": sharded, "ddp": DistributedDataParallel(whole)}

    def build(model: Elementwise, **extra):
        groups = [{"params": [p for p, (_, _, g) in zip(model.ordered(), PARAMS) if g == k]} for k in (0, 1)]
        return cls(fused_optim.FusedSGD(groups, lr=LR), num_gradients_to_accumulate=ACCUM, **kwargs, **extra)

    opts = {"sharded": build(sharded, module=sharded), "ddp": build(whole)}
    trace = {"sharded": [], "ddp": [], "world_size": opts["sharded"].world_size}
    for step in range(STEPS):
        for name, opt in opts.items():
            params = sharded.ordered() if name == "sharded" else whole.ordered()
            for micro in range(ACCUM):
                with no_sync(models[name], last=micro == ACCUM - 1):
                    models[name](data(step, 1000 * (rank + 1) + micro)).backward()
            record = {**observe(opt), "before": whole_values(params), "grads": whole_values([p.grad for p in params])}
            opt.step()
            record["params"] = whole_values(params)
            trace[name].append(record)
            opt.zero_grad()
        with torch.no_grad():  # the next window from equal params
            for p, q in zip(whole.ordered(), trace["sharded"][-1]["params"]):
                p.copy_(q)
    return {**trace, "implementation": opts["sharded"].implementation}


def fsdp2_step(mesh) -> None:
    """AdaScale over an MLP under ``fully_shard`` without ``module=``, accumulating 2 backward
    passes, then step()."""
    model = mlp_under_fsdp2(mesh)
    opt = fused_optim.AdaScale(fused_optim.FusedSGD(model.parameters(), lr=LR), num_gradients_to_accumulate=2)
    for _ in range(2):
        model(torch.randn(8, 6)).square().mean().backward()
    opt.step()


def mlp_under_fsdp2(mesh, ignore_last_bias: bool = False, **kwargs) -> torch.nn.Module:
    """An MLP whose root FSDP2 unit (``fully_shard(model, mesh=mesh, **kwargs)``) manages its params
    (but the last bias, a plain param FSDP2 ignores, with ``ignore_last_bias``)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    fully_shard(model, mesh=mesh, ignored_params={model[2].bias} if ignore_last_bias else None, **kwargs)
    return model


def fsdp2_unsharded_when_made(mesh) -> None:
    """AdaScale made while the FSDP2 unit holds its unsharded params (between a forward and its
    backward, the root kept unsharded): its DTensor params are not found in the unit, and the
    plain (ignored) param's hooks count the backward passes; the step must refuse, not measure
    the plain param alone."""
    model = mlp_under_fsdp2(mesh, ignore_last_bias=True, reshard_after_forward=False)
    inner = fused_optim.FusedSGD(model.parameters(), lr=LR)
    pending = model(torch.randn(8, 6)).square().mean()
    opt = fused_optim.AdaScale(inner, num_gradients_to_accumulate=2, module=model)
    pending.backward()
    model(torch.randn(8, 6)).square().mean().backward()
    opt.step()


def fsdp2_one_replica_claimed(mesh) -> None:
    """AdaScale given an FSDP2 model on every rank but told world_size=1 (the window's all-reduce
    pools every rank's micro-batches): refused at the first forward."""
    model = mlp_under_fsdp2(mesh)
    fused_optim.AdaScale(fused_optim.FusedSGD(model.parameters(), lr=LR), world_size=1, num_gradients_to_accumulate=2,
                         module=model)
    model(torch.randn(4, 6)).sum().backward()


def copy_watching_fsdp2(mesh) -> None:
    """A deepcopy of AdaScale given an FSDP2 model (refused: the copy's params would be copies)."""
    model = mlp_under_fsdp2(mesh)
    copy.deepcopy(fused_optim.AdaScale(fused_optim.FusedSGD(model.parameters(), lr=LR), module=model))


def fsdp2_over_tensor_parallel(world: int) -> None:
    """AdaScale given a model that FSDP2 shards over a tensor-parallel one, a mesh of 1 × WORLD, and
    the default world size (all ranks): the first forward refuses it (one data-parallel replica)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    fused_optim.AdaScale(fused_optim.FusedSGD(model.parameters(), lr=LR), num_gradients_to_accumulate=2, module=model)
    model(torch.randn(4, 6)).sum().backward()


# FSDP2 over tensor parallelism (tests/distributed/test_sharded_stats.py, 4 ranks): placements on
# the tensor-parallel dimension, one per param of PARAMS.
TP_PLACEMENTS = [Shard(1), Replicate(), Shard(1), Shard(0), Replicate()]


class TensorParallelTerms(torch.nn.Module):
    """:class:`Terms` of DTensor params on the tensor-parallel mesh; the micro-batch is placed as
    each param (the tensor-parallel ranks see the same one)."""

    def __init__(self, init: list[torch.Tensor], placements: list, mesh):
        super().__init__()
        self.mesh, self.placements = mesh, placements
        self.params = torch.nn.ParameterList([torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [pl]))
                                              for t, pl in zip(init, placements)])

    def forward(self, batch) -> torch.Tensor:
        terms = [(p * distribute_tensor(x, self.mesh, [pl]) - distribute_tensor(y, self.mesh, [pl])).square().sum()
                 for p, (x, y), pl in zip(self.params, batch, self.placements)]
        return sum(terms).full_tensor() / ACCUM


class TensorParallelModel(torch.nn.Module):
    """The params of PARAMS in a :class:`TensorParallelTerms` per param group; ``forward(batch)``
    is :func:`loss` of the whole params."""

    def __init__(self, init: list[torch.Tensor], mesh):
        super().__init__()
        self.members = [[i for i, (_, _, g) in enumerate(PARAMS) if g == k] for k in (0, 1)]
        self.groups = torch.nn.ModuleList(TensorParallelTerms([init[i] for i in m], [TP_PLACEMENTS[i] for i in m],
                                                              mesh) for m in self.members)

    def ordered(self) -> list[torch.Tensor]:
        at = {i: p for m, child in zip(self.members, self.groups) for i, p in zip(m, child.params)}
        return [at[i] for i in range(len(PARAMS))]

    def forward(self, batch) -> torch.Tensor:
        return sum(child([batch[i] for i in m]) for m, child in zip(self.members, self.groups))


def fsdp2_tensor_parallel(cls, world: int, **kwargs) -> dict:
    """``cls`` over FusedSGD stepped STEPS times on the params of PARAMS placed TP_PLACEMENTS over
    a tensor-parallel mesh dimension and sharded by FSDP2 over a data-parallel one (a WORLD/2 × 2
    mesh; the ranks of a data-parallel index see its micro-batches), the statistics given ``module=``.
    Each step also records the reference: every data-parallel index's micro-batch gradients of
    the whole params (the same elementwise arithmetic), their sums, and the averaged ``.grad``
    (each index's micro-batches summed on its ranks, then averaged over the indices once, as the
    run does: see :func:`no_sync`)."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    init = [torch.randn(shape, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64)
            for i, (shape, _, _) in enumerate(PARAMS)]
    model = TensorParallelModel(init, mesh["tp"])
    for child in model.groups:
        fully_shard(child, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    params = model.ordered()
    opt = cls(fused_optim.FusedSGD([{"params": [params[i] for i in m]} for m in model.members], lr=LR),
              num_gradients_to_accumulate=ACCUM, world_size=world // 2, module=model, **kwargs)
    trace = []
    for step in range(STEPS):
        reference = tensor_parallel_reference(whole_values(params), step, world // 2)
        for micro in range(ACCUM):
            model.set_requires_gradient_sync(micro == ACCUM - 1)  # (and its children's)
            model(data(step, 1000 * (dp + 1) + micro)).backward()
        trace.append({**observe(opt), "grads": whole_values([p.grad for p in params]), "reference": reference})
        opt.step()
        opt.zero_grad()
    return {"records": trace, "world_size": opt.world_size, "implementation": opt.implementation}


def tensor_parallel_reference(whole: list[torch.Tensor], step: int, replicas: int) -> dict:
    """The window of :func:`fsdp2_tensor_parallel` from the whole params: per group, the sums of
    squares of every micro-batch gradient of every data-parallel index ("local") and of the
    averaged ``.grad`` ("total"), and that ``.grad`` ("grads")."""
    local, sums = [0.0, 0.0], [None] * len(PARAMS)
    for dp in range(replicas):
        accumulated = [None] * len(PARAMS)
        for micro in range(ACCUM):
            ps = [torch.nn.Parameter(t.clone()) for t in whole]
            loss(ps, data(step, 1000 * (dp + 1) + micro), None, False).backward()
            for k, p in enumerate(ps):
                local[PARAMS[k][2]] += float(p.grad.square().sum())
                accumulated[k] = p.grad if accumulated[k] is None else accumulated[k] + p.grad
        sums = [a if s is None else s + a for s, a in zip(sums, accumulated)]
    grads = [s / replicas for s in sums]
    total = [0.0, 0.0]
    for k, g in enumerate(grads):
        total[PARAMS[k][2]] += float(g.square().sum())
    return {"local": local, "total": total, "grads": grads}


def resume_unsharded(mesh, mid_window: bool) -> dict:
    """AdaScale's state saved by the sharded params (inside a window, or at its end) loaded by an
    AdaScale over the same params whole: the averages carry over; a window's partial sums do not."""
    sharded = [torch.nn.Parameter(place(torch.ones(shape, dtype=torch.float64), placement, mesh))
               for shape, placement, _ in PARAMS]
    opt = make(fused_optim.AdaScale, sharded)
    for step in range(2):
        for micro in range(ACCUM if step == 0 or not mid_window else 1):
            loss(sharded, data(step, micro), mesh, True).backward()
        if step == 0 or not mid_window:
            opt.step()
            opt.zero_grad()
    state = opt.state_dict()
    whole = [torch.nn.Parameter(torch.ones(shape, dtype=torch.float64)) for shape, _, _ in PARAMS]
    other = make(fused_optim.AdaScale, whole)
    other.load_state_dict(state)
    return {"gain": other.gain(), "saved_gain": opt.gain()}


def unseen_grads_passing(mesh) -> dict:
    """Steps that DTensor grads no hook saw must not stop (each the error message, or None): params
    no pass of the window used (all but the first), their grads zeroed by
    ``zero_grad(set_to_none=False)``; and a window saved after its last backward pass, loaded into
    another AdaScale over the same params (their grads still set), then stepped. A grad set by hand
    in a window (param 3's) is refused."""
    out = {}
    params = [torch.nn.Parameter(place(torch.ones(shape, dtype=torch.float64), placement, mesh))
              for shape, placement, _ in PARAMS]
    opt = make(fused_optim.AdaScale, params)
    for step, used in enumerate((len(PARAMS), 1)):  # the second window uses the first param only
        for micro in range(ACCUM):
            loss(params[:used], data(step, micro)[:used], mesh, True).backward()
        out[f"window {step}"] = _error_of(opt.step)
        opt.zero_grad(set_to_none=False)
    for micro in range(ACCUM):
        loss(params, data(2, micro), mesh, True).backward()
    other = make(fused_optim.AdaScale, params)
    other.load_state_dict(opt.state_dict())
    out["loaded ended window"] = _error_of(other.step)
    other.zero_grad(set_to_none=False)
    params[3].grad = place(torch.ones(PARAMS[3][0], dtype=torch.float64), PARAMS[3][1], mesh)
    for micro in range(ACCUM):
        loss(params[:1], data(3, micro)[:1], mesh, True).backward()
    out["set by hand"] = _error_of(other.step)
    return out


class TwoLayers(torch.nn.Module):
    """Two Linear layers in one FSDP2 unit; the second used only where ``use_second``."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_second: bool):
        y = self.first(x)
        return self.second(y) if use_second else y


def used_on_one_rank(mesh, rank: int) -> dict:
    """AdaScale given an FSDP2 model whose second layer only rank 0's forwards use (FSDP2
    reduce-scatters the other rank's zeros for it: ``set_reduce_scatter_unused_params``): rank 1's
    hooks never see those params, rank 0's do, so every rank steps (no refusal, no collective on
    one rank only) with the same statistics. Returns the gains after each step, or the error."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TwoLayers()
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    opt = fused_optim.AdaScale(fused_optim.FusedSGD(model.parameters(), lr=LR), num_gradients_to_accumulate=2,
                               module=model)
    gains = []
    try:
        for step in range(2):
            for micro in range(2):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + micro + 100 * rank))
                model(x, use_second=rank == 0).sum().backward()
            opt.step()
            opt.zero_grad()
            gains.append(opt.gain())
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"gains": gains}


def _error_of(thunk) -> str | None:
    try:
        thunk()
    except RuntimeError as exc:
        return str(exc)
    return None


def refusals(mesh):
    """(case, thunk) of each use the statistics refuse; the thunk should raise."""
    yield "fsdp2", lambda: fsdp2_step(mesh)
    yield "fsdp2_unsharded_when_made", lambda: fsdp2_unsharded_when_made(mesh)
    yield "copy_watching_fsdp2", lambda: copy_watching_fsdp2(mesh)
    yield "fsdp2_one_replica_claimed", lambda: fsdp2_one_replica_claimed(mesh)
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    yield "world_size", lambda: fused_optim.NoiseScale(fused_optim.FusedSGD([p], lr=LR), world_size=2)
    yield "no_accumulation", lambda: fused_optim.AdaScale(fused_optim.FusedSGD([p], lr=LR))


def main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world, timeout=TIMEOUT)
    if world == 4:  # data × tensor parallel only
        result = {"fsdp2_tensor_parallel": {
            "adascale": fsdp2_tensor_parallel(fused_optim.AdaScale, world),
            "noise_scale": fsdp2_tensor_parallel(fused_optim.NoiseScale, world, micro_batch_size=4)}}
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        end_process_group()
        return
    mesh = init_device_mesh("cpu", (world,))
    result = {"runs": {"adascale": run(fused_optim.AdaScale, mesh),
                       "noise_scale": run(fused_optim.NoiseScale, mesh, micro_batch_size=4)},
              "refusals": {},
              "fsdp2": {"adascale": fsdp2_vs_ddp(fused_optim.AdaScale, mesh, rank),
                        "noise_scale": fsdp2_vs_ddp(fused_optim.NoiseScale, mesh, rank, micro_batch_size=4)},
              # FSDP2 over tensor parallelism with one data-parallel replica (a 1 × 2 mesh, world_size=1)
              "fsdp2_tensor_parallel": {"adascale": fsdp2_tensor_parallel(fused_optim.AdaScale, world)}}
    result["resumed"] = resume_unsharded(mesh, mid_window=False)
    result["unseen_grads"] = unseen_grads_passing(mesh)
    result["used_on_one_rank"] = used_on_one_rank(mesh, rank)
    try:
        resume_unsharded(mesh, mid_window=True)
        result["resumed_mid_window"] = None
    except ValueError as exc:
        result["resumed_mid_window"] = str(exc)
    try:
        fsdp2_over_tensor_parallel(world)
        result["fsdp2_over_tensor_parallel"] = None
    except RuntimeError as exc:
        result["fsdp2_over_tensor_parallel"] = str(exc)
    for case, thunk in refusals(mesh):
        try:
            thunk()
            result["refusals"][case] = None
        except Exception as exc:  # noqa: BLE001 (saved for the test, which says what was expected)
            result["refusals"][case] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
