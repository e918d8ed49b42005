"""``python -m benchmarks.sharded_norms``: what whole-tensor norms cost a sharded layer-wise step.

ResNet-50's 161 tensors (25.6M params; ``--tensors N``: the first N) as DTensors sharded ``Shard(0)`` over a mesh of all ranks
(FSDP2's placement), on 2 and 4 gloo ranks of one thread each (spawned here). Each rank times,
interleaved (medians of rounds, :func:`benchmarks.common.interleaved_medians`):

* the FusedLAMB and LARS steps of its shards (two op calls around one all-reduce:
  ``fused_optim.sharding.run_layerwise``), and FusedAdam's (elementwise: one call, no collective);
* the all-reduce of the per-tensor sums alone (``sharding.all_reduce_rows``: 161 rows of 2 float64,
  2576 bytes).

Writes a markdown table (rank 0's medians; every rank steps the same sizes) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

from benchmarks.common import interleaved_medians, resnet50_shapes

REPO = Path(__file__).resolve().parents[1]


def _most_calls(inner: dict[str, int]) -> dict[str, int]:
    """The largest call count of each stepper over the ranks (one all-reduce)."""
    import torch.distributed as dist

    counts = torch.tensor(list(inner.values()))
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return dict(zip(inner, counts.tolist()))


def rank_main(rank: int, world: int, store: str, out: str, repeats: int, min_sample_s: float, tensors: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fused_optim
    from fused_optim import sharding
    from fused_optim.process_group import end_process_group, init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                       timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = resnet50_shapes()[:tensors]
    steppers, params_of = {}, {}
    for name, cls, kwargs in (("FusedAdam", fused_optim.FusedAdam, {}),
                              ("FusedLAMB", fused_optim.FusedLAMB, {}),
                              ("LARS", fused_optim.LARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-4))):
        params = []
        for s in shapes:
            p = torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)]))
            p.grad = distribute_tensor(torch.randn(s, generator=gen) * 1e-3, mesh, [Shard(0)])
            params.append(p)
        opt = cls(params, **kwargs)
        steppers[name] = opt.step
        params_of[name] = params
    sums = torch.zeros(len(shapes), 2, dtype=torch.float64)
    steppers["all-reduce of the sums"] = lambda: sharding.all_reduce_rows(sums, params_of["LARS"])
    # Every rank runs the same rounds in the same order and count: the collectives inside meet.
    medians = interleaved_medians(steppers, repeats, min_sample_s, agree=_most_calls)
    if rank == 0:
        torch.save({"medians": medians, "bytes": sums.numel() * sums.element_size(),
                    "local_numel": sum(p.to_local().numel() for p in params_of["LARS"])}, out)
    end_process_group()


def run(ranks: list[int], out: Path, repeats: int, min_sample_s: float, tensors: int = 161) -> str:
    from fused_optim import _build

    numel = sum(torch.Size(s).numel() for s in resnet50_shapes()[:tensors])
    lines = [f"Sharded layer-wise steps, ResNet-50's first {tensors} tensors ({numel / 1e6:.1f}M) as Shard(0) DTensors, gloo, "
             f"1 thread per rank; {_build.cpu_description()}", "",
             "| ranks | local params | step | ms/step (median) | all-reduce ms | all-reduce bytes | all-reduce / step |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for world in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.pt"
            # Run from the clone's root, first on the path: fairscale installs a package named benchmarks too.
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.sharded_norms", "--rank", str(r),
                                       "--world", str(world), "--store", f"{tmp}/store", "--result", str(result),
                                       "--repeats", str(repeats), "--min-sample-s", str(min_sample_s),
                                       "--tensors", str(tensors)], cwd=REPO, env=env)
                     for r in range(world)]
            if any(p.wait() != 0 for p in procs):
                raise RuntimeError(f"a rank of the {world}-rank run failed")
            res = torch.load(result, weights_only=True)
        reduce_ms = res["medians"]["all-reduce of the sums"] * 1e3
        for name in ("FusedAdam", "FusedLAMB", "LARS"):
            ms = res["medians"][name] * 1e3
            share = "n/a" if name == "FusedAdam" else f"{reduce_ms / ms:.2f}"
            collective = "none" if name == "FusedAdam" else f"{reduce_ms:.3f}"
            nbytes = "0" if name == "FusedAdam" else str(res["bytes"])
            lines.append(f"| {world} | {res['local_numel'] / 1e6:.1f}M | {name} | {ms:.2f} | {collective} | "
                         f"{nbytes} | {share} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded_norms.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded_norms", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--repeats", type=int, default=11, help="interleaved rounds (default 11)")
    parser.add_argument("--min-sample-s", type=float, default=0.2, help="seconds per timed sample (default 0.2)")
    parser.add_argument("--tensors", type=int, default=161, help="ResNet-50's first N tensors (default all 161)")
    parser.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a spawned rank's arguments
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.world, args.store, args.result, args.repeats, args.min_sample_s, args.tensors)
        return 0
    print(run(args.ranks, Path(args.out), args.repeats, args.min_sample_s, args.tensors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
