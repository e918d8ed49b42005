"""The distributed optimizers' cost: bytes each rank hands to torch.distributed per step and the
step time, on W gloo ranks of this machine (loopback), for a model of the ResNet-50 shapes (25.6M
params) or the 1M list of :mod:`.optimizers`::

    python -m benchmarks.distributed --world 2 4 --list 25M --rounds 5

Variants, interleaved round by round: DDP (its all-reduce of the grads, 25 MB buckets) + fused
SGD; CentralizedSGD (flat buckets: synchronous, and ``overlap=True``; by layer); PowerSGD rank
1, 2, 4; DecentralizedSGD on a ring. A step is forward + backward + optimizer step; the model's
loss is Σ_p Σ(p·x) (its backward writes x into every grad), the same compute for every variant, so
differences are communication. A barrier after the backward also times ``opt.step()`` alone (the
aggregation and the update, what the optimizers differ by; DDP's all-reduce, and overlap=True's
launches, run in the backward). ``--batch B`` gives the model a real backward instead (every param
a linear layer on B input rows: :class:`_Model`) and times DDP and CentralizedSGD, synchronous and
``overlap=True``, to see the all-reduce hidden behind the backward. Bytes are the payload of each
collective (all_reduce: the tensor; all_gather / isend: this rank's part), counted by wrapping
torch.distributed's functions (DDP with torch's Python all-reduce comm hook, so they see its
buckets); what gloo puts on the wire is a multiple of it that depends on its algorithm.

mlbench-core's own implementations of the same (:mod:`.mlbench_peer`: CentralizedSGD flat and by
layer, PowerSGD, DecentralizedSGD over torch.optim.SGD) join the rounds when mlbench-core is found:
in this interpreter, or under ``--mlbench SITE_PACKAGES`` (another venv's site-packages: its
modules are loaded by path into this interpreter, whose torch runs them). Their rows carry
"mlbench ÷ ours", the ratio of the medians (> 1: ours is faster). Without it the table says the
peer is absent.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import fused_optim
from benchmarks import mlbench_peer
from benchmarks.common import PARAM_LISTS
from fused_optim import SGD
from fused_optim.distributed import CentralizedSGD, DecentralizedSGD, PowerSGD, ring
from fused_optim.process_group import end_process_group, init_process_group

SGD_KW = dict(lr=1e-3, momentum=0.9)


class _Model(torch.nn.Module):
    """The params of ``shapes``; loss Σ_p Σ(p·x) (``batch`` 0: a trivial backward), or with
    ``batch`` B > 0 each param W, viewed as n × m (a vector as 1 × n), is a linear layer on an
    input X of B × m fixed rows: loss x·Σ_W Σ(X·Wᵀ), whose backward computes every grad as an
    (n × B)·(B × m) matrix product (2·B·25.6M flops for the 25M list), the last layer's first."""

    def __init__(self, shapes, batch: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen) * 0.01) for s in shapes)
        self.inputs = [torch.randn(batch, math.prod(s[1:]) if len(s) > 1 else s[0], generator=gen)
                       for s in shapes] if batch else None

    def forward(self, x):
        if self.inputs is None:
            return sum((p * x).sum() for p in self.params)
        return x * sum((inp @ p.view(-1 if p.ndim > 1 else 1, inp.shape[1]).t()).sum()
                       for p, inp in zip(self.params, self.inputs))


class _Counter:
    """Bytes handed to torch.distributed's collectives while ``active``."""

    def __init__(self):
        self.bytes, self.active = 0, False
        for name, part in (("all_reduce", 0), ("all_gather", 1), ("isend", 0), ("broadcast", 0)):
            original = getattr(dist, name)
            setattr(dist, name, functools.partial(self._counted, original, part))

    def _counted(self, original, part, *args, **kwargs):
        if self.active:
            t = args[part] if len(args) > part else kwargs["tensor"]  # mlbench passes tensor=...
            self.bytes += t.numel() * t.element_size()
        return original(*args, **kwargs)


REAL_BACKWARD = ("DDP all-reduce + SGD", "CentralizedSGD (flat)", "CentralizedSGD (flat, overlap)")


def _variants(shapes, rank: int, world: int, mlbench: str | None, batch: int = 0) -> dict:
    """name -> a maker of (model, optimizer). Variants that hook the backward (DDP) get a model of
    their own; the others share one (each optimizer keeps its own state; a step's cost does not
    depend on the values): a model per variant would not fit 4 ranks of the 25M list in memory.
    ``batch`` > 0 (a real backward, :class:`_Model`): the variants of ``REAL_BACKWARD`` only."""

    shared = _Model(shapes, batch)

    def ddp():
        model = torch.nn.parallel.DistributedDataParallel(_Model(shapes, batch))
        model.register_comm_hook(None, allreduce_hook)  # its dist.all_reduce is counted
        return model, SGD(model.parameters(), **SGD_KW)

    def overlapped():
        model = _Model(shapes, batch)
        return model, CentralizedSGD(world, model, overlap=True, **SGD_KW)

    ours = {
        "CentralizedSGD (flat)": lambda m: CentralizedSGD(world, m, **SGD_KW),
        "CentralizedSGD (by layer)": lambda m: CentralizedSGD(world, m, by_layer=True, **SGD_KW),
        **{f"PowerSGD rank {r}": functools.partial(lambda m, r: PowerSGD(model=m, rank=r, world_size=world, **SGD_KW),
                                                   r=r) for r in (1, 2, 4)},
        "DecentralizedSGD (ring)": lambda m: DecentralizedSGD(rank, ring(rank, world), m, **SGD_KW),
    }
    peers = {} if mlbench is None else mlbench_peer.variants(mlbench, rank, world, ring(rank, world), SGD_KW)
    on_shared = {**ours, **{PEER + name: make for name, make in peers.items()}}
    made = {"DDP all-reduce + SGD": ddp, "CentralizedSGD (flat, overlap)": overlapped,
            **{name: functools.partial(lambda make: (shared, make(shared)), make) for name, make in on_shared.items()}}
    return {name: made[name] for name in REAL_BACKWARD} if batch else made


PEER = "mlbench: "  # the prefix of mlbench's rows


def _worker(rank: int, world: int, store: str, list_id: str, rounds: int, out: str, mlbench: str | None,
            batch: int) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        counter = _Counter()
        shapes = PARAM_LISTS[list_id][1]()
        built = {name: make() for name, make in _variants(shapes, rank, world, mlbench, batch).items()}
        x = torch.tensor(1.0 + rank)
        times = {name: [] for name in built}
        step_times = {name: [] for name in built}
        sent = {}
        for r in range(rounds + 1):  # round 0: warm-up (state, buckets), not timed
            for name, (model, opt) in built.items():
                dist.barrier()
                counter.bytes, counter.active = 0, True
                start = time.perf_counter()
                opt.zero_grad()
                model(x).backward()
                dist.barrier()
                stepping = time.perf_counter()
                opt.step()
                dist.barrier()
                end = time.perf_counter()
                counter.active = False
                if r:
                    times[name].append(end - start)
                    step_times[name].append(end - stepping)
                    sent[name] = counter.bytes
        if rank == 0:
            torch.save({name: dict(ms=statistics.median(t) * 1e3, step_ms=statistics.median(step_times[name]) * 1e3,
                                   bytes=sent[name]) for name, t in times.items()}, out)
    finally:
        end_process_group()


def run(world: int, list_id: str, rounds: int, mlbench: str | None = None, batch: int = 0) -> dict:
    """{variant: {"ms": median step, "step_ms": median time in ``opt.step``, "bytes": per rank per
    step}}; ``mlbench``: the ``mlbench_core`` directory, whose optimizers then run too (rows named
    PEER + our row's name); ``batch`` > 0: a real backward (:class:`_Model`), DDP and
    CentralizedSGD only."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, (world, os.path.join(tmp, "store"), list_id, rounds, out, mlbench, batch), nprocs=world)
        return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--list", default="25M", choices=list(PARAM_LISTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mlbench", metavar="SITE_PACKAGES", default=None,
                        help="a site-packages directory holding mlbench-core 3.0.0 (default: this interpreter's)")
    parser.add_argument("--batch", type=int, default=0,
                        help="> 0: a real backward, every param a linear layer on this many input rows (DDP and "
                             "CentralizedSGD only, to measure overlap=True); 0: the trivial Σ p·x")
    args = parser.parse_args()
    root, why = mlbench_peer.find(args.mlbench)
    print(f"benchmarks.distributed on {fused_optim.cpu_description()}, list {args.list}, 1 thread per rank, "
          + (f"real backward (batch {args.batch})" if args.batch else "trivial backward"))
    print(f"peer: mlbench-core at {root}" if root else f"peer absent, no mlbench rows: {why}")
    print("| ranks | variant | ms/step | mlbench ÷ ours | ms in opt.step | mlbench ÷ ours (opt.step) "
          "| bytes sent per rank per step | × DDP's bytes |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for world in args.world:
        result = run(world, args.list, args.rounds, None if root is None or args.batch else str(root), args.batch)
        ddp = result["DDP all-reduce + SGD"]["bytes"]
        for name, r in result.items():
            ours = result.get(name.removeprefix(PEER)) if name.startswith(PEER) else None
            ratio, step_ratio = (f"{r[k] / ours[k]:.2f}" if ours else "" for k in ("ms", "step_ms"))
            print(f"| {world} | {name} | {r['ms']:.1f} | {ratio} | {r['step_ms']:.1f} | {step_ratio} | {r['bytes']:,} "
                  f"| {r['bytes'] / ddp:.4f} |", flush=True)


if __name__ == "__main__":
    main()
