"""Subprocess side of tests/distributed/test_sharded.py: one gloo rank stepping DTensor params.

    sharded_worker.py RANK WORLD OUT_DIR      (all ranks at once; they meet through OUT_DIR/store)

Every registered optimizer steps the same params twice in each rank: as plain tensors (the whole
tensors, the reference) and as DTensors sharded over a mesh of all ranks, with the same grads at
every step (the grads are made whole and distributed like their params, so both runs see the same
numbers). Saved to OUT_DIR/rank<r>.pt, for the test to judge:
``{"runs": {case: {"implementation", "warnings", "params": [(sharded, whole) per param],
"state": [(key, sharded, whole)]}}, "errors": {case: message}}`` (sharded tensors made whole
with ``full_tensor()``; a case that raises is saved as its message). 8-bit state, blocked per
shard, is compared with each rank's shards stepped as plain params (``run_per_shard``, local
tensors, ``"per_shard": True``), and, where every shard holds whole blocks, with the whole run.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fused_optim
from fused_optim import sharded_blocks
from fused_optim.process_group import end_process_group, init_process_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fsdp2_mlp

TIMEOUT = timedelta(seconds=120)  # a rank that fails makes the others' collectives fail, not hang
STEPS = 4
# First dims that 2 and 4 ranks do not divide evenly (a rank may hold no row), a vector, a
# matrix wide enough for Shard(1), and one larger than the kernels' one-thread work item.
SHAPES = [(5, 3), (7,), (4, 8), (1, 6), (600, 3)]
# Options that make each registered optimizer do all it does (momentum, the trust ratio).
OPTIONS = {
    "sgd": dict(momentum=0.9, weight_decay=1e-2), "fused_sgd": dict(momentum=0.9, nesterov=True),
    "sign_sgd": dict(momentum=0.9), "lars": dict(momentum=0.9, weight_decay=1e-2),
    "larc": dict(momentum=0.9, weight_decay=1e-2), "colossalai_lars": dict(momentum=0.9, weight_decay=1e-2),
    "adam": dict(weight_decay=1e-2), "adamw": dict(amsgrad=True), "lamb": dict(weight_decay=1e-2),
    # the same draws in both runs; k spans several ranks' rows of (600, 3), and more than (7,)
    "sparsified_sgd": dict(seed=3, sparse_grad_size=700, weight_decay=1e-2),
}


def whole_tensors(seed: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def run(name: str, kwargs: dict, place, shapes=SHAPES, dtype=torch.float32, make=None) -> dict:
    """``name`` stepped STEPS times on whole params and on ``place(tensor)`` (DTensors);
    ``make(whole, sharded)``, when given, makes the two optimizers instead."""
    init = [t.to(dtype) for t in whole_tensors(0, shapes)]
    grads = [[t.to(dtype) for t in whole_tensors(1 + k, shapes)] for k in range(STEPS)]
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    sharded = [torch.nn.Parameter(place(t.clone())) for t in init]
    if make is None:
        opt_whole = fused_optim.create_optimizer(name, whole, **kwargs)
        opt_sharded = fused_optim.create_optimizer(name, sharded, **kwargs)
    else:
        opt_whole, opt_sharded = make(whole, sharded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(STEPS):
            for p, q, g in zip(whole, sharded, grads[k]):
                p.grad = g.clone()
                q.grad = place(g.clone())
            opt_whole.step()
            opt_sharded.step()
    state = []
    for p, q in zip(whole, sharded):
        for key, value in opt_whole.state[p].items():
            other = opt_sharded.state[q][key]
            if isinstance(value, torch.Tensor):  # (8-bit absmax: [S, B], the whole tensor's blocks where aligned)
                state.append((key, other.full_tensor().reshape(value.shape) if isinstance(other, DTensor) else other,
                              value, isinstance(other, DTensor) and other.placements == q.placements))
    return {"implementation": opt_sharded.implementation, "warnings": [str(w.message) for w in caught],
            "params": [(q.full_tensor(), p.detach()) for p, q in zip(whole, sharded)], "state": state}


def run_per_shard(name: str, kwargs: dict, place, shapes=SHAPES, then: dict | None = None) -> dict:
    """``name`` stepped STEPS times on ``place(tensor)`` (DTensors) and on each rank's shards as
    plain params of their own: 8-bit state is blocked per shard, so a shard steps as its elements
    would as a whole tensor. Compared on this rank's local tensors (``per_shard``). ``then``:
    group options both optimizers take halfway (the moments converted at the next step)."""
    init = [place(t) for t in whole_tensors(0, shapes)]
    grads = [[place(t) for t in whole_tensors(1 + k, shapes)] for k in range(STEPS)]
    sharded = [torch.nn.Parameter(t.clone()) for t in init]
    pieces = [torch.nn.Parameter(t.to_local().clone()) for t in init]
    opt_sharded = fused_optim.create_optimizer(name, sharded, **kwargs)
    opt_pieces = fused_optim.create_optimizer(name, pieces, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(STEPS):
            if k == STEPS // 2 and then:
                for opt in (opt_pieces, opt_sharded):
                    opt.param_groups[0].update(then)
            for p, q, g in zip(pieces, sharded, grads[k]):
                p.grad = g.to_local().clone()
                q.grad = g.clone()
            opt_pieces.step()
            opt_sharded.step()
    state = []
    for p, q in zip(pieces, sharded):
        for key, value in opt_pieces.state[p].items():
            other = opt_sharded.state[q][key]
            if key.endswith("_absmax"):  # this shard's blocks of the [S, B] (see fused_optim/sharded_blocks.py)
                state.append((key, sharded_blocks.local_absmax(other, q), value, True))
            elif isinstance(value, torch.Tensor):
                state.append((key, other.to_local() if isinstance(other, DTensor) else other, value,
                              isinstance(other, DTensor) and other.placements == q.placements))
    return {"implementation": opt_sharded.implementation, "warnings": [str(w.message) for w in caught],
            "params": [(q.to_local().detach(), p.detach()) for p, q in zip(pieces, sharded)], "state": state,
            "per_shard": True, "keys": [(sorted(opt_sharded.state[q]), sorted(opt_pieces.state[p]))
                                        for p, q in zip(pieces, sharded)]}


def sparsified_added_unseeded(whole: list, sharded: list) -> tuple:
    """:func:`run`'s optimizers for SparsifiedSGD with ``seed=None`` (a random seed on each rank),
    made over a plain param and given the params in a group added later: adding the DTensors
    shares the first rank's generator, so every rank draws the same coordinates. The whole run
    draws from that generator's state."""
    kwargs = dict(lr=1e-2, sparse_grad_size=700, weight_decay=1e-2, random_sparse=True)  # (many draws to differ in)
    opts = [fused_optim.SparsifiedSGD([torch.nn.Parameter(torch.zeros(3))], **kwargs) for _ in range(2)]
    for opt, params in zip(opts, (whole, sharded)):
        opt.add_param_group({"params": params})
    opts[0].generator.set_state(opts[1].generator.get_state())
    return tuple(opts)


def load_8bit_into(mesh, placement, drop: str | None = None) -> None:
    """The state dict of 8-bit FusedAdam over a (4, 256) param sharded ``Shard(0)`` (2 or 4 shards of
    whole blocks), less its entry ``drop``, loaded by one whose param is placed ``placement`` (None:
    whole) — refused where that is another sharding, even one with as many shards and blocks, or
    where the codes come without their layout."""
    t = whole_tensors(0, [(4, 256)])[0]
    saved = torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)]))
    opt = fused_optim.FusedAdam([saved], lr=1e-2, state_dtype="8bit")
    saved.grad = distribute_tensor(t.clone(), mesh, [Shard(0)])
    opt.step()
    other = torch.nn.Parameter(t.clone() if placement is None else distribute_tensor(t.clone(), mesh, [placement]))
    state = opt.state_dict()
    state["state"][0].pop(drop, None)
    fused_optim.FusedAdam([other], lr=1e-2, state_dtype="8bit").load_state_dict(state)


def train_side_by_side(name: str, kwargs: dict, whole: torch.nn.Module, wrapped: torch.nn.Module, steps: int):
    """``name`` made for each model and both trained ``steps`` steps on the same batch (the same on
    every rank: a wrapper that averages the ranks' grads gets them exact on 2 ranks); returns the
    wrapped model's optimizer and the messages of the warnings the training raised."""
    opt_whole = fused_optim.create_optimizer(name, whole.parameters(), **kwargs)
    opt_wrapped = fused_optim.create_optimizer(name, wrapped.parameters(), **kwargs)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            for model, opt in ((whole, opt_whole), (wrapped, opt_wrapped)):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
    return opt_wrapped, [str(w.message) for w in caught]


def fsdp2_run(name: str, kwargs: dict, mesh) -> dict:
    """A 2-layer MLP under ``fully_shard`` (FSDP2) against the same MLP whole."""
    from fsdp2_mlp import make_mlp

    whole, sharded = make_mlp(0, torch.float32), make_mlp(0, torch.float32, mesh)
    opt, caught = train_side_by_side(name, kwargs, whole, sharded, STEPS)
    return {"implementation": opt.implementation, "warnings": caught,
            "params": [(q.full_tensor(), p.detach()) for p, q in zip(whole.parameters(), sharded.parameters())],
            "state": []}


def mlp_over_tensor_parallel(mesh) -> torch.nn.Module:
    """The MLP split by tensor parallelism (column- then row-wise) on ``mesh["tp"]`` and sharded
    by FSDP2 on ``mesh["dp"]``: its params' placements include ``_StridedShard``."""
    from fsdp2_mlp import make_mlp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = make_mlp(0, torch.float32)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def rows_over_tensor_parallel(mesh) -> torch.nn.Module:
    """Params of SHAPES split by tensor parallelism on their rows (``Shard(0)`` on ``mesh["tp"]``,
    a vector ``Replicate``) and sharded by FSDP2 on ``mesh["dp"]``: each rank holds a range of rows
    of each whole tensor (``_StridedShard`` on the rows)."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.ParameterList(
        torch.nn.Parameter(distribute_tensor(t, mesh["tp"], [Shard(0) if t.dim() > 1 else Replicate()]))
        for t in whole_tensors(0))
    fully_shard(model, mesh=mesh["dp"])
    return model


def over_tensor_parallel(name: str, kwargs: dict, make) -> dict:
    """``name`` over the params of ``make(mesh)`` (:func:`mlp_over_tensor_parallel` or
    :func:`rows_over_tensor_parallel`, on a 2 × 2 mesh: ``_StridedShard`` placements) against the
    same params whole, with the grads 2·p + 1 of the params (elementwise, so both runs get the
    same numbers; a model's own grads would differ by the tensor-parallel sums' order)."""
    sharded = make(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    whole = [torch.nn.Parameter(q.full_tensor().detach().clone()) for q in sharded.parameters()]
    opts = [fused_optim.create_optimizer(name, params, **kwargs) for params in (whole, list(sharded.parameters()))]
    pairs = list(zip(whole, sharded.parameters()))
    placements = [str(q.placements) for _, q in pairs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            for p, q in pairs:
                p.grad, q.grad = p.detach() * 2.0 + 1.0, q.detach() * 2.0 + 1.0
            for opt in opts:
                opt.step()
    assert any("_StridedShard" in pl for pl in placements), placements  # (the case this run is for)
    return {"implementation": opts[1].implementation, "warnings": [str(w.message) for w in caught],
            "params": [(q.full_tensor(), p.detach()) for p, q in pairs],
            "state": [(key, value.full_tensor(), opts[0].state[p][key], value.placements == q.placements)
                      for p, q in pairs for key, value in opts[1].state[q].items() if isinstance(value, DTensor)]}


def fsdp2_over_tensor_parallel_norms() -> dict:
    """:func:`mlp_over_tensor_parallel` on a 2 × 2 (data × tensor parallel) mesh: its params'
    ``_StridedShard`` placements (not ``is_shard()`` ones in torch 2.13) shard a mesh dimension
    that the norms of the whole tensors (LAMB's, LARS's, multi_tensor_l2norm's:
    :func:`fused_optim.sharding.all_reduce_rows`) must sum too. Returns (the per-tensor norms,
    those of the whole tensors), float64, and the placements."""
    params = list(mlp_over_tensor_parallel(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))).parameters())
    _, norms = fused_optim.multi_tensor_l2norm(params, per_tensor=True)
    whole = torch.stack([p.full_tensor().double().square().sum().sqrt() for p in params])
    return {"norms": norms, "whole": whole, "placements": [str(p.placements) for p in params]}


def cases(world: int):
    """(case id, thunk) of every run of this world size."""
    mesh = init_device_mesh("cpu", (world,))
    shard0 = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731 (FSDP2's placement)
    for name in fused_optim.list_optimizers():
        yield f"{name}/Shard(0)", lambda name=name: run(name, dict(lr=1e-2, **OPTIONS.get(name, {})), shard0)
    shard1 = lambda t: distribute_tensor(t, mesh, [Shard(t.dim() - 1)])  # noqa: E731 (tensor parallel)
    replicate = lambda t: distribute_tensor(t, mesh, [Replicate()])  # noqa: E731
    for name in ("adam", "lars", "fused_lamb", "colossalai_lamb"):
        kwargs = dict(lr=1e-2, **OPTIONS.get(name, {}))
        yield f"{name}/Shard(-1)", lambda name=name, kwargs=kwargs: run(name, kwargs, shard1)
        yield f"{name}/Replicate", lambda name=name, kwargs=kwargs: run(name, kwargs, replicate)
    yield "fused_adam/master_weights", lambda: run("fused_adam", dict(lr=1e-2, master_weights=True), shard0,
                                                   dtype=torch.bfloat16)
    yield "fused_adam/state_bf16", lambda: run("fused_adam", dict(lr=1e-2, state_dtype=torch.bfloat16), shard0)
    yield "lars/state_bf16", lambda: run("lars", dict(lr=1e-2, momentum=0.9, weight_decay=1e-2,
                                                      state_dtype=torch.bfloat16), shard0)
    eight_bit = dict(lr=1e-2, state_dtype="8bit")
    yield "fused_adam/state_8bit", lambda: run_per_shard("fused_adam", eight_bit, shard0)
    yield "fused_adam/state_8bit/Shard(-1)", lambda: run_per_shard("fused_adam", eight_bit, shard1)
    yield "fused_adam/state_8bit_then_bf16", lambda: run_per_shard("fused_adam", eight_bit, shard0,
                                                                   then=dict(state_dtype=torch.bfloat16))
    yield "fused_adam/state_bf16_then_8bit", lambda: run_per_shard("fused_adam", dict(lr=1e-2, state_dtype="bfloat16"),
                                                                   shard0, then=dict(state_dtype="8bit"))
    yield "fused_sgd/state_8bit", lambda: run_per_shard("fused_sgd", dict(eight_bit, momentum=0.9), shard0)
    # shards of whole blocks (each a multiple of 256 elements): the blocks of the whole tensors
    yield "fused_adam/state_8bit/aligned", lambda: run("fused_adam", eight_bit, shard0, shapes=[(8, 256), (1024,)])
    yield "fused_adam/state_8bit/load_as_Shard(1)", lambda: load_8bit_into(mesh, Shard(1))
    yield "fused_adam/state_8bit/load_whole", lambda: load_8bit_into(mesh, None)
    yield "fused_adam/state_8bit/load_without_layout", lambda: load_8bit_into(mesh, Shard(0), drop="block_layout")
    yield "fused_adam/state_8bit/fused=False", lambda: run_per_shard("fused_adam", dict(eight_bit, fused=False),
                                                                     shard0)
    sparse_block = dict(lr=1e-2, **OPTIONS["sparsified_sgd"], random_sparse=False)
    yield "sparsified_sgd/random_block", lambda: run("sparsified_sgd", sparse_block, shard0)
    sparse = dict(lr=1e-2, **OPTIONS["sparsified_sgd"])
    yield "sparsified_sgd/Shard(-1)", lambda: run("sparsified_sgd", sparse, shard1)
    yield "sparsified_sgd/Replicate", lambda: run("sparsified_sgd", sparse, replicate)
    yield "sparsified_sgd/seed=None/add_param_group", lambda: run("sparsified_sgd", {}, shard0,
                                                                  make=sparsified_added_unseeded)
    if world == 4:  # a 2-D mesh: HSDP's (replicate, shard) and 2-D sharding
        mesh2 = init_device_mesh("cpu", (2, 2))
        hsdp = lambda t: distribute_tensor(t, mesh2, [Replicate(), Shard(0)])  # noqa: E731
        both = lambda t: distribute_tensor(t, mesh2, [Shard(0), Shard(t.dim() - 1)])  # noqa: E731
        yield "fused_adam/state_8bit/2d-Replicate-Shard(0)", lambda: run_per_shard("fused_adam", eight_bit, hsdp)
        yield "sparsified_sgd/2d-Shard(0)-Shard(-1)", lambda: run("sparsified_sgd", sparse, both)
        yield "sparsified_sgd/fully_shard_over_tensor_parallel", lambda: over_tensor_parallel(
            "sparsified_sgd", sparse, mlp_over_tensor_parallel)
        # stochastic rounding by each element's index in the whole tensor: a shard of rows starts at its offset
        yield "fused_adam/state_bf16_stochastic/fully_shard_over_tensor_parallel", lambda: over_tensor_parallel(
            "fused_adam", dict(lr=1e-2, state_dtype=torch.bfloat16, state_rounding="stochastic"),
            rows_over_tensor_parallel)
        for name in ("adam", "lars", "fused_lamb"):
            kwargs = dict(lr=1e-2, **OPTIONS.get(name, {}))
            yield f"{name}/2d-Replicate-Shard(0)", lambda name=name, kwargs=kwargs: run(name, kwargs, hsdp)
            yield f"{name}/2d-Shard(0)-Shard(-1)", lambda name=name, kwargs=kwargs: run(name, kwargs, both)
    if world == 2:
        for name in ("fused_adam", "fused_sgd", "lars", "fused_lamb"):
            kwargs = dict(lr=1e-2, **OPTIONS.get(name, {}))
            yield f"{name}/fully_shard", lambda name=name, kwargs=kwargs: fsdp2_run(name, kwargs, mesh)


def main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world, timeout=TIMEOUT)
    result = {"runs": {}, "errors": {}}
    if world == 4:
        result["strided_norms"] = fsdp2_over_tensor_parallel_norms()
    for case, thunk in cases(world):
        try:
            result["runs"][case] = thunk()
        except Exception as exc:  # noqa: BLE001 (saved for the test, which says what was expected)
            result["errors"][case] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
