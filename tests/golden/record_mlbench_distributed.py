"""Record mlbench-core's distributed optimizers, per rank, for tests/distributed/test_distributed.py to replay.

    /work/venv-mlbench/bin/python tests/golden/record_mlbench_distributed.py

(a venv with torch==2.13.0, numpy and ``mlbench-core==3.0.0 --no-deps``; see make_golden.py). It
spawns 2 and then 4 gloo ranks on loopback; each runs every case of its world size on a tiny
float64 model with grads of its own, and ``mlbench_distributed.pt`` (next to this script) gets::

    {"reference": str, "cases": [{"id", "world_size", "optimizer": our class name, "options": our
      kwargs, "shapes", "steps", "ranks": [{"init": [tensor per param] (after the constructor),
        "grads": [[tensor per param] per step], "expected": [[tensor per param] per step],
        "queries": [[Q per matrix param] per step]   (PowerSGD: the Q mlbench drew)
        "indices": [[flat indices per param, ints] per step]  (CentralizedSparsifiedSGD)} per rank]}]}

mlbench-core master differs from 3.0.0 in these classes only by constructor fixes (3.0.0's
``CentralizedSGD`` / ``CentralizedAdam`` call ``super`` wrongly and raise; master adds
``world_size`` to ``PowerSGD`` and ``CentralizedSparsifiedSGD``, skipping communication for 1):
the algorithms are the same. Adjustments, each only to let 3.0.0 run the case:

* ``CentralizedSGD`` / ``CentralizedAdam`` are built as master's constructors do
  (``GenericCentralizedOptimizer.__init__`` then the torch optimizer);
* ``DecentralizedSGD`` rejects rank 0 (``if not rank``): rank 0 builds with rank 1's argument and
  its aggregation's rank is set to 0 afterwards;
* PowerSGD's ``orthogonalize`` gets its eps as a float64 tensor: the default float32 eps tensor
  promotes the float64 column norm to float32 (a rounding, not the algorithm).

The golden test models are tiny: params of the shapes below, grads N(0, 1) seeded by (case, rank, step).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_golden import SITE, load, one_storage  # noqa: E402

OUT = HERE / "mlbench_distributed.pt"
STEPS = 5
SHAPES = [(4, 6), (4,), (3, 2, 2), (3,)]  # matrices (a 3-d one, viewed (3, 4)) and vectors
ROW_SHAPES = [(1, 12), (1, 8)]  # CentralizedSparsifiedSGD needs (1, D) params in mlbench
SGD_OPTIONS = dict(lr=0.1, momentum=0.9, weight_decay=0.01)

# id -> (world size, our class, our options, shapes, per-rank init?)
CASES = {
    "centralized_sgd": (2, "CentralizedSGD", dict(SGD_OPTIONS), SHAPES, False),
    "centralized_sgd_by_layer": (2, "CentralizedSGD", dict(SGD_OPTIONS, by_layer=True), SHAPES, False),
    "centralized_sgd_model_averaging": (2, "CentralizedSGD", dict(SGD_OPTIONS, agg_grad=False), SHAPES, True),
    "centralized_adam": (2, "CentralizedAdam", dict(lr=0.01, weight_decay=0.01), SHAPES, False),
    "custom_clip": (2, "CustomCentralizedOptimizer", dict(grad_clip=0.5, average_world=True), SHAPES, False),
    "custom_denom_divide_before": (2, "CustomCentralizedOptimizer",
                                   dict(average_world=False, average_custom=True, divide_before=True), SHAPES, False),
    "powersgd_rank1": (2, "PowerSGD", dict(SGD_OPTIONS, rank=1), SHAPES, False),
    "powersgd_rank2_warm_start": (2, "PowerSGD", dict(SGD_OPTIONS, rank=2, reuse_query=True), SHAPES, False),
    "powersgd_full_rank": (2, "PowerSGD", dict(SGD_OPTIONS, rank=4), SHAPES, False),
    "sparsified_block": (2, "CentralizedSparsifiedSGD", dict(lr=0.1, weight_decay=0.01, sparse_grad_size=4),
                         ROW_SHAPES, True),
    "sparsified_random": (2, "CentralizedSparsifiedSGD",
                          dict(lr=0.1, weight_decay=0.01, sparse_grad_size=3, random_sparse=True), ROW_SHAPES, True),
    "centralized_sgd_4": (4, "CentralizedSGD", dict(SGD_OPTIONS), SHAPES, False),
    "decentralized_ring_4": (4, "DecentralizedSGD", dict(SGD_OPTIONS), SHAPES, True),
}
DENOM = 3.0  # step(denom=...) of custom_denom_divide_before
INNER = dict(lr=0.1, momentum=0.9)  # the torch.optim.SGD inside CustomCentralizedOptimizer


def tensors(seed: int, shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def case_seed(case_id: str) -> int:
    return sum(map(ord, case_id)) * 1000


def model_of(init) -> torch.nn.Module:
    model = torch.nn.Module()
    for i, t in enumerate(init):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))
    return model


def build(mods, cls, options, model, rank, world):
    central, decentral, agg = mods
    if cls in ("CentralizedSGD", "CentralizedAdam"):  # master's constructor
        opt = object.__new__(getattr(central, cls))
        kw = {k: options[k] for k in ("by_layer", "agg_grad") if k in options}
        central.GenericCentralizedOptimizer.__init__(opt, world_size=world, model=model, **kw)
        inner = {k: v for k, v in options.items() if k not in kw}
        opt.optimizer = (torch.optim.SGD if cls == "CentralizedSGD" else torch.optim.Adam)(model.parameters(), **inner)
        return opt
    if cls == "CustomCentralizedOptimizer":
        return central.CustomCentralizedOptimizer(model, world, torch.optim.SGD(model.parameters(), **INNER), **options)
    if cls == "PowerSGD":
        return central.PowerSGD(model=model, **options)
    if cls == "CentralizedSparsifiedSGD":
        return central.CentralizedSparsifiedSGD(list(model.parameters()), **options)
    neighbors = [(rank - 1) % world, (rank + 1) % world]
    stand_in = rank or next(r for r in range(1, world) if r not in neighbors)  # 3.0.0 rejects rank 0
    opt = decentral.DecentralizedSGD(rank=stand_in, neighbors=neighbors, model=model, **options)
    opt.agg.__self__.rank = rank
    return opt


def worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_default_dtype(torch.float64)  # mlbench allocates PowerSGD's P, Q and sparse buffers in it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    prefix = "mlbench_core."
    load(SITE, prefix + "utils.pytorch.utils")
    load(SITE, prefix + "aggregation.pytorch.aggregation")
    agg = load(SITE, prefix + "aggregation.pytorch.centralized")
    load(SITE, prefix + "aggregation.pytorch.decentralized")
    load(SITE, prefix + "optim.pytorch.optim")
    central = load(SITE, prefix + "optim.pytorch.centralized")
    decentral = load(SITE, prefix + "optim.pytorch.decentralized")
    ortho = agg.orthogonalize
    agg.orthogonalize = lambda m: ortho(m, torch.tensor([1e-16], dtype=torch.float64))
    results = {}
    for case_id, (size, cls, options, shapes, per_rank) in CASES.items():
        if size != world:
            continue
        seed = case_seed(case_id)
        torch.manual_seed(seed + rank)  # CentralizedSparsifiedSGD's constructor re-draws the params
        np.random.seed(seed + rank)  # ... and draws its coordinates from numpy's global generator
        init = tensors(seed + (1 + rank if per_rank else 0), shapes)
        model = model_of(init)
        opt = build((central, decentral, agg), cls, options, model, rank, world)
        record = {"init": [p.detach().clone() for p in model.parameters()], "grads": [], "expected": []}
        queries, indices = [], []
        if cls == "PowerSGD":
            aggregation = opt.agg.__self__
            draw = aggregation.set_random
            aggregation.set_random = lambda q: (draw(q), queries[-1].append(q.detach().clone()))
        if cls == "CentralizedSparsifiedSGD":
            sparsify = opt.sparsify_gradients

            def recorded(param, lr):
                sent = sparsify(param, lr)
                begin = int(sent[0, 0])  # block: [begin, values...]; random: [indices; values]
                idx = sent[0].long() if opt.random_sparse else torch.arange(begin, begin + sent.shape[1] - 1)
                indices[-1].append(idx.tolist())  # ints: one_storage would make tensors float
                return sent

            opt.sparsify_gradients = recorded
        for t in range(STEPS):
            queries.append([])
            indices.append([])
            grads = tensors(seed + 100 * (rank + 1) + t, shapes)
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            if cls == "CustomCentralizedOptimizer" and options.get("average_custom"):
                opt.step(denom=DENOM)
            else:
                opt.step()
            record["grads"].append(grads)
            record["expected"].append([p.detach().clone() for p in model.parameters()])
        if cls == "PowerSGD":
            record["queries"] = queries
        if cls == "CentralizedSparsifiedSGD":
            record["indices"] = indices
        results[case_id] = record
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    per_world = {}
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, f"{tmp}/store", tmp), nprocs=world)
            per_world[world] = [torch.load(f"{tmp}/rank{r}.pt") for r in range(world)]
    cases = []
    for case_id, (world, cls, options, shapes, _) in CASES.items():
        ours = dict(options)
        if cls == "CustomCentralizedOptimizer":
            ours["inner"] = dict(INNER)
            if ours.get("average_custom"):
                ours["denom"] = DENOM
        cases.append({"id": case_id, "world_size": world, "optimizer": cls, "options": ours,
                      "shapes": [list(s) for s in shapes], "steps": STEPS,
                      "ranks": [per_world[world][r][case_id] for r in range(world)]})
    record = {"reference": "mlbench-core 3.0.0 mlbench_core/optim/pytorch/{centralized,decentralized}.py "
                           "(master's constructors; see tests/golden/record_mlbench_distributed.py)",
              "cases": cases}
    torch.save(one_storage(record), OUT)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
