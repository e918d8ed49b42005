"""The CPU Adam step inside FSDP2's CPU offload: the params of :mod:`benchmarks.offload`'s lists
held by a module under ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))`` on a
one-process gloo group, so that params, grads and state are FSDP2's sharded DTensors in host
memory, as the optimizer of an offloaded run sees them. Ours steps their local tensors through
its kernels (``docs/sharding.md``); torch's fused AdamW steps them through DTensor's dispatch.
Our step on the same lists as plain tensors runs in the same rounds: "× vs plain" is its time
over the FSDP2 step's (1: the sharded path costs nothing). DeepSpeed's CPU Adam steps plain
tensors only and is not in these rows.

Modes, bytes, threads, rounds and the probe as in :mod:`benchmarks.offload` (``fp32`` and
``fp32, bf16 state``: FSDP2's offload holds fp32 params). Timed: ``opt.step()`` alone, the grads
set once.

    python -m benchmarks.offload_fsdp2 [--sizes 25M 100M] [--threads 1 2] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from benchmarks.common import PARAM_LISTS, probe_medians, probe_row, run_description
from benchmarks.offload import TORCH, make_params, modes

MODES = ("fp32", "fp32, bf16 state")
PLAIN = "fused_optim, plain tensors"


def _mesh():
    """A one-rank CPU mesh (the gloo group made here unless one exists)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (dist.get_world_size(),))


def fsdp2_params(shapes, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """:func:`benchmarks.offload.make_params`' params (values and grads) as FSDP2 shards them
    under its CPU offload: DTensor params with DTensor grads of the same placement."""
    holder = torch.nn.Module()
    plain = make_params(shapes, dtype)
    for i, p in enumerate(plain):
        holder.register_parameter(f"p{i}", torch.nn.Parameter(p.detach().clone()))
    fully_shard(holder, mesh=_mesh(), offload_policy=CPUOffloadPolicy(pin_memory=False))
    params = list(holder.parameters())
    for p, q in zip(params, plain):
        assert isinstance(p, DTensor)
        p.grad = DTensor.from_local(q.grad.reshape(p.to_local().shape).clone(), p.device_mesh, p.placements)
    return params


def bench(mode: str, label: str, shapes, threads: int, repeats: int, min_sample_s: float = 0.05) -> list[dict]:
    """Rows of ours and torch's fused AdamW on FSDP2's params, with our step on plain tensors."""
    dtype, variants = modes(None)[mode]
    numel = sum(torch.Size(s).numel() for s in shapes)
    ours = next(iter(variants))  # ours first
    make_ours, ours_bytes = variants[ours]
    moved = {ours: ours_bytes, TORCH: variants[TORCH][1], PLAIN: ours_bytes}

    def steppers():
        return {ours: make_ours(fsdp2_params(shapes, dtype)).step,
                TORCH: variants[TORCH][0](fsdp2_params(shapes, dtype)).step,
                PLAIN: make_ours(make_params(shapes, dtype)).step}

    med, probe_gbs = probe_medians(steppers, numel, threads, repeats, min_sample_s)
    rows = []
    for name in (ours, TORCH, PLAIN):
        rows.append(dict(mode=mode, params=label, threads=threads,
                         **probe_row(name, med[name], moved[name], numel, probe_gbs),
                         vs_torch=med[TORCH] / med[name], vs_plain=med[PLAIN] / med[name]))
    return rows


def markdown(rows: list[dict], cpu: str = "") -> list[str]:
    lines = ["", "## CPU Adam inside FSDP2's CPU offload (one rank)", "",
             f"Bytes per element: fp32 28, bf16 state 20 (ours; torch's fused AdamW keeps fp32 state: 28); "
             f"probe fp32 `a.add_(b)`. {cpu}", "",
             "| mode | params | threads | variant | ms | of probe | × vs torch fused | × vs plain |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['params']} | {r['threads']} | {r['variant']} | {r['ms']:.2f} | "
                     f"{r['fraction_of_probe']:.2f} | {r['vs_torch']:.2f} | {r['vs_plain']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["25M", "100M"], choices=["25M", "100M"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes:
        label, make = PARAM_LISTS[size]
        for mode in args.modes:
            for threads in args.threads:
                rows += bench(mode, label, make(), threads, args.repeats)
    cpu = run_description(args.repeats)
    print("\n".join(markdown(rows, cpu)))


if __name__ == "__main__":
    main()
