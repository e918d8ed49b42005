"""The CPU Adam step of offloaded training (ZeRO-Offload's, FSDP2's ``CPUOffloadPolicy``): ours vs
torch's fused CPU AdamW vs DeepSpeed's ``DeepSpeedCPUAdam``.

Sizes: ResNet-50's 25.6M params, 100M (20 tensors of 5M), and "max": the largest list of 20 equal
tensors whose params, grads and state, for every variant of the mode at once plus the probe's two
fp32 buffers, fit ``--memory-gib`` (24 by default; each variant's bytes per element are measured
after one step on a small tensor). Modes, with the bytes per element one step must move:

* ``fp32``: fp32 params, grads and state everywhere: 28 (read p, g, m, v; write p, m, v).
* ``fp32, bf16 state``: ours with ``state_dtype=torch.bfloat16``: 20; the peers as in fp32: 28.
* ``bf16 params``: bf16 params and grads. Ours with ``master_weights=True`` (fp32 master and
  state): 28; ours plain and torch's (bf16 state): 14; DeepSpeed (fp32 state, its default): 22.

Threads 1 and 2 (``torch.set_num_threads``, which also sets the OpenMP count DeepSpeed's kernel
runs on). The variants of one (size, mode, threads) run interleaved in one process, medians over
``--repeats`` rounds (:func:`benchmarks.common.probe_medians`), with the probe of the other
CPU benchmarks in the same rounds: fp32 ``a.add_(b)``, 12 bytes per element. "of probe" is a
variant's bandwidth (its bytes / its time) over the probe's; "× vs" columns are the peer's time
over the variant's (> 1: faster than the peer).

DeepSpeed is not a dependency of the package. For its column install it, pinning torch so that
pip keeps this one (its CPU Adam is compiled with ninja on first use; docs/benchmarks.md gives
the install its measurements there used, without build isolation):

    pip install deepspeed torch==2.13.0

Without it its rows and column say "not installed".

    python -m benchmarks.offload [--sizes 25M 100M max] [--threads 1 2] [--repeats 7] [--memory-gib 24]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import PARAM_LISTS, deepspeed_optimizer, probe_medians, probe_row, run_description
from fused_optim import FusedAdam

KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)  # AdamW in all three
SIZES = ("25M", "100M", "max")
MAX_TENSORS = 20
TORCH = "torch fused AdamW"
DEEPSPEED = "DeepSpeedCPUAdam"


def deepspeed_adam() -> tuple[type | None, str]:
    """(DeepSpeedCPUAdam, deepspeed's version), or (None, why it is missing)."""
    return deepspeed_optimizer("deepspeed.ops.adam", DEEPSPEED)


def modes(deepspeed: type | None) -> dict[str, tuple[torch.dtype, dict]]:
    """mode -> (param dtype, {variant: (params -> optimizer, bytes moved per element)}); ours first."""
    def ours(**kw):
        return lambda params: FusedAdam(params, fused=True, **KW, **kw)

    def peers(ds_bytes: int, torch_bytes: int) -> dict:
        found = {TORCH: (lambda params: torch.optim.AdamW(params, fused=True, **KW), torch_bytes)}
        if deepspeed is not None:
            found[DEEPSPEED] = (lambda params: deepspeed(params, adamw_mode=True, **KW), ds_bytes)
        return found

    return {
        "fp32": (torch.float32, {"fused_optim": (ours(), 28), **peers(28, 28)}),
        "fp32, bf16 state": (torch.float32, {"fused_optim state_dtype=bf16": (ours(state_dtype=torch.bfloat16), 20),
                                             **peers(28, 28)}),
        "bf16 params": (torch.bfloat16, {"fused_optim master_weights": (ours(master_weights=True), 28),
                                         "fused_optim": (ours(), 14), **peers(22, 14)}),
    }


def make_params(shapes, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def resident_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's params, grads and state tensors."""
    tensors = [t for g in opt.param_groups for p in g["params"] for t in (p, p.grad) if t is not None]
    tensors += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def max_numel(mode: str, memory_bytes: int, deepspeed: type | None) -> int:
    """The largest multiple of MAX_TENSORS elements whose every variant (params, grads and state,
    measured after one step on a small tensor) and the probe's buffers fit ``memory_bytes``."""
    dtype, variants = modes(deepspeed)[mode]
    probe = 4096 * MAX_TENSORS
    per_element = 8.0  # the probe's a and b
    for make, _ in variants.values():
        opt = make(make_params([(probe,)], dtype))
        opt.step()
        per_element += resident_bytes(opt) / probe
    return int(memory_bytes / per_element) // MAX_TENSORS * MAX_TENSORS


def shapes_of(size: str, mode: str, memory_bytes: int, deepspeed: type | None) -> tuple[str, list[tuple[int, ...]]]:
    if size != "max":
        label, make = PARAM_LISTS[size]
        return label, make()
    numel = max_numel(mode, memory_bytes, deepspeed)
    return f"{MAX_TENSORS} tensors / {numel / 1e6:.0f}M (max)", [(numel // MAX_TENSORS,)] * MAX_TENSORS


def bench(mode: str, label: str, shapes, threads: int, repeats: int, deepspeed: type | None,
          min_sample_s: float = 0.05) -> list[dict]:
    """One row per variant of ``mode``: the interleaved medians on ``threads`` threads."""
    dtype, variants = modes(deepspeed)[mode]
    numel = sum(torch.Size(s).numel() for s in shapes)
    med, probe_gbs = probe_medians(
        lambda: {name: make(make_params(shapes, dtype)).step for name, (make, _) in variants.items()},
        numel, threads, repeats, min_sample_s)
    rows = []
    for name, (_, moved) in variants.items():
        rows.append(dict(mode=mode, params=label, threads=threads,
                         **probe_row(name, med[name], moved, numel, probe_gbs),
                         vs_torch=med[TORCH] / med[name],
                         vs_deepspeed=med[DEEPSPEED] / med[name] if DEEPSPEED in med else None))
    return rows


def markdown(rows: list[dict], deepspeed: type | None, deepspeed_note: str, cpu: str = "") -> list[str]:
    """The table; ``deepspeed_note``: :func:`deepspeed_adam`'s version, or why DeepSpeed is missing."""
    ds = f"DeepSpeed {deepspeed_note}" if deepspeed else f"DeepSpeed: {deepspeed_note}, its rows and column n/a"
    lines = ["", "## CPU Adam of offloaded training", "",
             f"Bytes per element: fp32 28, bf16 state 20, bf16 params 14 (bf16 state) / 22 (DeepSpeed, fp32 state) / "
             f"28 (master weights); probe fp32 `a.add_(b)`. {ds}. {cpu}", "",
             "| mode | params | threads | variant | ms | GB/s | of probe | × vs torch fused | × vs DeepSpeed |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs_ds = "n/a" if r["vs_deepspeed"] is None else f"{r['vs_deepspeed']:.2f}"
        lines.append(f"| {r['mode']} | {r['params']} | {r['threads']} | {r['variant']} | {r['ms']:.2f} | "
                     f"{r['gb_per_s']:.1f} | {r['fraction_of_probe']:.2f} | {r['vs_torch']:.2f} | {vs_ds} |")
    if deepspeed is None:
        lines.append(f"| all | – | – | {DEEPSPEED} | {deepspeed_note} | | | | |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--modes", nargs="+", default=list(modes(None)), choices=list(modes(None)))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory-gib", type=float, default=24.0)
    args = parser.parse_args(argv)
    deepspeed, note = deepspeed_adam()
    memory = int(args.memory_gib * 2**30)
    rows = []
    for size in args.sizes:
        for mode in args.modes:
            label, shapes = shapes_of(size, mode, memory, deepspeed)
            for threads in args.threads:
                rows += bench(mode, label, shapes, threads, args.repeats, deepspeed)
    cpu = run_description(args.repeats)
    print("\n".join(markdown(rows, deepspeed, note, cpu)))


if __name__ == "__main__":
    main()
