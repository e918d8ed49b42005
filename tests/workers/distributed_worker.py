"""Subprocess side of tests/distributed/test_distributed.py: one gloo rank.

    distributed_worker.py RANK WORLD OUT_DIR      (all ranks at once; they meet through OUT_DIR/store)
    distributed_worker.py RANK missing OUT_DIR    (2 ranks, rank 1 absent from the first collective)

Each rank replays the golden cases of its world size (tests/golden/mlbench_distributed.pt) with our
classes, runs the state-dict and bad-input checks, and saves a dict to OUT_DIR/rank<r>.pt:
``{"golden": {case id: [[param per param] per step]}, "checks": {name: value}, "errors": {name: message}}``.
A check that raises where it should not is saved as its error message, for the test to report.
"""

from __future__ import annotations

import io
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "mlbench_distributed.pt"
TIMEOUT = timedelta(seconds=60)  # a missing rank fails a collective after this, instead of hanging
MISSING_TIMEOUT = timedelta(seconds=3)  # the missing-rank check's: short, nothing else runs under it


def model_of(init) -> torch.nn.Module:
    model = torch.nn.Module()
    for i, t in enumerate(init):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))
    return model


def build(case: dict, model: torch.nn.Module, rank: int):
    from fused_optim import SGD
    from fused_optim import distributed as d

    cls, options, world = case["optimizer"], dict(case["options"]), case["world_size"]
    options.pop("denom", None)
    if cls == "CustomCentralizedOptimizer":
        inner = options.pop("inner")  # ours when a divisor is custom, torch's otherwise: both are accepted
        inner_cls = SGD if options.get("average_custom") else torch.optim.SGD
        return d.CustomCentralizedOptimizer(model, world, inner_cls(model.parameters(), **inner), **options)
    if cls == "CentralizedSparsifiedSGD":
        return d.CentralizedSparsifiedSGD(list(model.parameters()), **options)
    if cls == "DecentralizedSGD":
        return d.DecentralizedSGD(rank, d.ring(rank, world), model, **options)
    if cls == "PowerSGD":
        return d.PowerSGD(model, **options)
    return getattr(d, cls)(world, model, **options)


def replay(case: dict, rank: int, in_closure: bool = False, backward: int = 0) -> list[list[torch.Tensor]]:
    """Our optimizer on the case's grads, the reference's draws injected (PowerSGD's Q, the
    sparsified coordinates); the params after each step. ``in_closure``: the grads are set by the
    closure passed to step (which must run before any communication). ``backward`` > 0: they
    come from that many backwards of Σ (p·g / backward) (exactly g: 1 and 2 are powers of 2), so
    grad hooks fire."""
    data = case["ranks"][rank]
    model = model_of(data["init"])
    opt = build(case, model, rank)
    denom = case["options"].get("denom")
    out = []
    for t, grads in enumerate(data["grads"]):
        if "queries" in data:
            opt._draw_queries = lambda qs, t=t: [q.copy_(r) for q, r in zip(qs, data["queries"][t])]
        if "indices" in data:
            opt._draw = lambda params, group, t=t: [torch.tensor(i, dtype=torch.long) for i in data["indices"][t]]
        def closure(grads=grads):
            opt.zero_grad()
            for _ in range(backward):
                sum((p * (g / backward)).sum() for p, g in zip(model.parameters(), grads)).backward()
            for p, g in zip(model.parameters(), grads if not backward else ()):
                p.grad = g.clone()
            return 0.0

        if in_closure:
            assert opt.step(closure) == 0.0
        else:
            closure()
            opt.step(denom=denom) if denom is not None else opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def resumed(make, grads, stop: int) -> tuple[list, list, dict]:
    """Params after each step of an uninterrupted run, and of a run saved after ``stop`` steps and
    continued by a new optimizer from the saved state (loaded with weights_only=True)."""
    runs = []
    for cut in (None, stop):
        model, opt = make()
        params, saved = [], None
        for t, gs in enumerate(grads):
            if t == cut:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=True)
                model, opt = make()
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
            for p, g in zip(model.parameters(), gs):
                p.grad = g.clone()
            opt.step()
            params.append([p.detach().clone() for p in model.parameters()])
        runs.append(params)
    return runs[0], runs[1], saved["opt"]


def channels_last_run(memory_format, rank: int) -> list[torch.Tensor]:
    """A conv's params after 3 PowerSGD steps, its weight and grads in ``memory_format``."""
    from fused_optim import distributed as d

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).double().to(memory_format=memory_format)
    opt = d.PowerSGD(conv, lr=0.1, momentum=0.9, rank=1, seed=3)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for p in conv.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype).contiguous(
                memory_format=memory_format if p.ndim == 4 else torch.contiguous_format)
        opt.step()
    return [p.detach().contiguous() for p in conv.parameters()]


def mixed_dtype_runs(rank: int) -> dict[str, list]:
    """PowerSGD (momentum 0.9, 4 steps) on a float64 matrix, a float32 matrix and a float64 vector,
    rank-dependent grads: {"rank1": its trajectory at rank 1 (warm start), "float64_only": that
    without the float32 matrix, "full_rank": rank 5, "exact": CentralizedSGD, "resume": resumed()
    of the warm start, saved after 2 steps}."""
    from fused_optim import distributed as d

    torch.manual_seed(0)
    init = [torch.randn(4, 6, dtype=torch.float64), torch.randn(3, 5), torch.randn(4, dtype=torch.float64)]
    gen = torch.Generator().manual_seed(rank)
    grads = [[torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in init] for _ in range(4)]

    def trajectory(make, keep=(0, 1, 2)):
        model = model_of([init[i] for i in keep])
        opt = make(model)
        steps = []
        for gs in grads:
            for p, i in zip(model.parameters(), keep):
                p.grad = gs[i].clone()
            opt.step()
            steps.append([p.detach().clone() for p in model.parameters()])
        return steps

    def powersgd(rank_, **kw):
        return lambda m: d.PowerSGD(m, lr=0.1, momentum=0.9, rank=rank_, seed=3, **kw)

    def warm():
        model = model_of(init)
        return model, powersgd(1, reuse_query=True)(model)

    return {"rank1": trajectory(powersgd(1, reuse_query=True)),
            "float64_only": trajectory(powersgd(1, reuse_query=True), keep=(0, 2)),
            "full_rank": trajectory(powersgd(5)), "exact": trajectory(lambda m: d.CentralizedSGD(2, m, lr=0.1,
                                                                                                 momentum=0.9)),
            "resume": resumed(warm, grads, stop=2)}


def overlap_copies(rank: int) -> dict[str, list]:
    """CentralizedSGD(overlap=True) deep-copied after its first step; the original and the copy
    step on (grads from backwards) side by side, then the copy is dropped and the original steps
    once more. {"original": its params (4 steps), "copy": the copy's (3 steps), "sync": the
    synchronous path's after each step, "launched": whether each backward launched its bucket
    (original, copy, original, copy, original after the copy was dropped)}."""
    import copy
    import gc

    from fused_optim import distributed as d

    torch.manual_seed(0)
    init = [torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    gen = torch.Generator().manual_seed(rank)
    grads = [[torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in init] for _ in range(4)]

    def step(opt, gs) -> bool:
        params = [p for group in opt.param_groups for p in group["params"]]
        opt.zero_grad()
        sum((p * g).sum() for p, g in zip(params, gs)).backward()  # grads exactly gs
        launched = bool(opt._overlap and opt._overlap._launched)
        opt.step()
        return launched

    sync = d.CentralizedSGD(2, model_of(init), lr=0.1, momentum=0.9)
    sync_params = []
    for gs in grads:
        step(sync, gs)
        sync_params.append([p.detach().clone() for p in sync.params])
    model = model_of(init)
    opt = d.CentralizedSGD(2, model, lr=0.1, momentum=0.9, overlap=True)
    launched = [step(opt, grads[0])]
    twin = copy.deepcopy(opt)
    for gs in grads[1:3]:
        launched += [step(opt, gs), step(twin, gs)]
    twin_params = [p.detach().clone() for p in twin.params]
    del twin
    gc.collect()
    launched.append(step(opt, grads[3]))
    return {"original": [p.detach().clone() for p in model.parameters()], "copy": twin_params, "sync": sync_params,
            "launched": launched[1:]}


def collectives(make, backward: bool = False) -> dict[str, int] | dict[str, dict[str, int]]:
    """The torch.distributed calls of one step (after construction) of ``make(model)``, by name
    (and the backend of the group, when not the default one), on a model of 4 tensors. ``backward``: the grads come from a backward, and the calls during
    it and during the step are counted apart ({"backward": .., "step": ..})."""
    import torch.distributed as dist

    model = model_of([torch.ones(4, 6), torch.ones(4), torch.ones(3, 2, 2), torch.ones(3)])
    opt = make(model)
    if not backward:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    counts: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "isend", "irecv")}

    def counting(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            key = name if group is None else f"{name} ({dist.get_backend(group)})"
            counts[key] = counts.get(key, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    try:
        for name in originals:
            setattr(dist, name, counting(name))
        if backward:
            sum(p.sum() for p in model.parameters()).backward()
            during, counts = counts, {}
        opt.step()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"backward": during, "step": counts} if backward else counts


def overlap_runs(by_id: dict, rank: int) -> dict[str, list]:
    """CentralizedSGD / CustomCentralizedOptimizer (clip, divide_before) with and without
    overlap=True, grads from backwards (see replay), 2 buckets: {"case/mode": trajectory}, modes
    sync, overlap (backward before step), overlap_closure (backward in step's closure),
    overlap_accumulate and sync_accumulate (two backwards per step)."""
    runs = {}
    for case_id in ("centralized_sgd", "custom_clip", "centralized_sgd_4"):
        if case_id not in by_id:
            continue
        case = by_id[case_id]
        for mode, overlap, kw in (("sync", False, {}), ("overlap", True, {}), ("overlap_closure", True,
                                                                               dict(in_closure=True)),
                                  ("sync_accumulate", False, dict(backward=2)),
                                  ("overlap_accumulate", True, dict(backward=2))):
            # float64, reversed: [p3, p2, p1] (24 + 96 + 32 ≤ 210 bytes), [p0]: 2 buckets
            options = dict(case["options"], overlap=overlap, bucket_cap_mb=210 / 2**20)
            if case_id == "custom_clip":
                options["divide_before"] = True
            runs[f"{case_id}/{mode}"] = replay(dict(case, options=options), rank, **{"backward": 1, **kw})
    return runs


def expect_error(errors: dict, name: str, fn) -> None:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        errors[name] = f"{type(e).__name__}: {e}"
    else:
        errors[name] = "no error"


def main(rank: int, world: int, out_dir: str) -> None:
    from fused_optim import distributed as d
    from fused_optim.process_group import end_process_group, init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world, timeout=TIMEOUT)
    cases = [c for c in torch.load(GOLDEN, weights_only=True)["cases"] if c["world_size"] == world]
    result = {"golden": {}, "checks": {}, "errors": {}}
    for case in cases:
        try:
            result["golden"][case["id"]] = replay(case, rank)
        except Exception as e:  # reported by the test, with the case's id
            result["golden"][case["id"]] = f"{type(e).__name__}: {e}"
    by_id = {c["id"]: c for c in cases}
    checks, errors = result["checks"], result["errors"]
    if world == 2:
        # rank >= min(n, m): the exact average, i.e. CentralizedSGD's trajectory on the same grads
        full = dict(by_id["powersgd_full_rank"], optimizer="CentralizedSGD",
                    options={k: v for k, v in by_id["powersgd_full_rank"]["options"].items() if k != "rank"})
        checks["exact_average"] = replay(full, rank)
        # torch's options: nothing compressed (rate 2 > n·m / ((n + m)·r) for every matrix), or not yet
        # (start_iter): the exact average; the generator draws the queries (none recorded for these)
        own = {**full, "optimizer": "PowerSGD", "ranks": [{k: v for k, v in r.items() if k != "queries"}
                                                          for r in full["ranks"]]}
        for name, extra in {"min_compression_rate": dict(rank=2, min_compression_rate=2.0),
                            "start_iter": dict(rank=1, start_iter=2)}.items():
            checks[f"powersgd_{name}"] = replay(dict(own, options={**full["options"], **extra}), rank)
        for name in ("centralized_sgd", "powersgd_rank1"):
            checks[f"closure_{name}"] = replay(by_id[name], rank, in_closure=True)
        warm = by_id["powersgd_rank2_warm_start"]  # P, Q and the exact grads one collective per tensor
        checks["powersgd_by_layer"] = replay(dict(warm, options={**warm["options"], "by_layer": True}), rank)
        grads = by_id["powersgd_rank2_warm_start"]["ranks"][rank]["grads"]
        init = by_id["powersgd_rank2_warm_start"]["ranks"][rank]["init"]

        def powersgd():
            model = model_of(init)
            return model, d.PowerSGD(model, lr=0.1, momentum=0.9, rank=2, reuse_query=True, seed=7)

        checks["powersgd_resume"] = resumed(powersgd, grads, stop=2)
        rows = by_id["sparsified_random"]["ranks"][rank]

        def sparsified():
            model = model_of(rows["init"])
            return model, d.CentralizedSparsifiedSGD(list(model.parameters()), lr=0.1, sparse_grad_size=3,
                                                     random_sparse=True, seed=rank)

        checks["sparsified_resume"] = resumed(sparsified, rows["grads"], stop=2)
        checks["collectives"] = {name: collectives(make) for name, make in {
            "bucketed": lambda m: d.CentralizedSGD(2, m, lr=0.1),
            "by_layer": lambda m: d.CentralizedSGD(2, m, lr=0.1, by_layer=True),
            "powersgd": lambda m: d.PowerSGD(m, lr=0.1),
            "decentralized": lambda m: d.DecentralizedSGD(rank, [1 - rank], m, lr=0.1),
        }.items()}
        # 2 buckets of collectives()'s float32 tensors in reverse order: [p3, p2, p1], [p0] (12 + 48 + 16 ≤ 100 bytes)
        small = dict(bucket_cap_mb=100 / 2**20)
        checks["overlap_collectives"] = {name: collectives(make, backward=True) for name, make in {
            "overlap": lambda m: d.CentralizedSGD(2, m, lr=0.1, overlap=True, **small),
            "sync": lambda m: d.CentralizedSGD(2, m, lr=0.1, **small),
            "dropped": lambda m: (d.CentralizedSGD(2, m, lr=0.1, overlap=True, **small),
                                  d.CentralizedSGD(2, m, lr=0.1, **small))[1],
        }.items()}
        checks["channels_last"] = [channels_last_run(fmt, rank) for fmt in (torch.contiguous_format,
                                                                             torch.channels_last)]
        try:
            checks["overlap_copies"] = overlap_copies(rank)
        except Exception as e:  # reported by the test
            checks["overlap_copies"] = f"{type(e).__name__}: {e}"
        try:
            checks["powersgd_mixed_dtypes"] = mixed_dtype_runs(rank)
        except Exception as e:  # reported by the test
            checks["powersgd_mixed_dtypes"] = f"{type(e).__name__}: {e}"
        shapes = [(4, 6), (4,)] if rank == 0 else [(4, 6), (4,), (2,)]
        expect_error(errors, "unequal_params",
                     lambda: d.CentralizedSGD(2, model_of([torch.zeros(s) for s in shapes]), lr=0.1))
        expect_error(errors, "world_size_mismatch", lambda: d.CentralizedSGD(3, model_of([torch.zeros(2)]), lr=0.1))
    checks["overlap"] = overlap_runs(by_id, rank)
    if world == 4:
        model = model_of([torch.zeros(3)])
        one_way = {0: [1], 1: [], 2: [3], 3: [2]}[rank]  # rank 0 lists 1, rank 1 does not list 0
        expect_error(errors, "asymmetric", lambda: d.DecentralizedSGD(rank, one_way, model, lr=0.1))
        outside = [5] if rank == 2 else d.ring(rank, 4)  # rank 5 is not in the group of 4
        expect_error(errors, "outside", lambda: d.DecentralizedSGD(rank, outside, model, lr=0.1))
        checks["torus"] = d.torus(rank, 2, 2)
        # several buckets in flight at once: one per tensor (each sent in place), or float64 [p0], [p1, p2], [p3]
        # (192, 32 + 96 ≤ 130, 24 bytes)
        ring = by_id["decentralized_ring_4"]
        checks["ring_buckets"] = {name: replay(dict(ring, options={**ring["options"], **extra}), rank)
                                  for name, extra in {"by_layer": dict(by_layer=True),
                                                      "small": dict(bucket_cap_mb=130 / 2**20)}.items()}
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    end_process_group()


def missing_rank(rank: int, out_dir: str) -> None:
    """2 ranks, rank 1 never constructs the optimizer: rank 0 must raise after the group's timeout
    (MISSING_TIMEOUT), not wait forever. Rank 1 outlives that wait, then both leave without the
    group's teardown (its collectives no longer match)."""
    from fused_optim import distributed as d
    from fused_optim.process_group import init_process_group

    init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2,
                       timeout=MISSING_TIMEOUT)
    errors = {}
    if rank == 0:
        expect_error(errors, "missing", lambda: d.CentralizedSGD(2, model_of([torch.zeros(3)]), lr=0.1))
    else:
        time.sleep(2 * MISSING_TIMEOUT.total_seconds())
    torch.save({"golden": {}, "checks": {}, "errors": errors}, f"{out_dir}/rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # no end_process_group: its barrier would meet the other rank's failed collective


if __name__ == "__main__":
    if sys.argv[2] == "missing":
        missing_rank(int(sys.argv[1]), sys.argv[3])
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
