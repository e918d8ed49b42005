"""Lion and Adagrad on the CPU, fp32 params: ours (``Lion``, ``Adagrad``) vs DeepSpeed's
``DeepSpeedCPULion`` / ``DeepSpeedCPUAdagrad`` (ZeRO-Offload's CPU optimizers) and
``torch.optim.Adagrad`` in its foreach and single-tensor modes (torch has no Lion).

Sizes: ResNet-50's 25.6M params and 100M (20 tensors of 5M), :data:`benchmarks.common.PARAM_LISTS`.
Both updates move 20 bytes per element: Lion reads p, g, m and writes p, m; Adagrad reads p, g,
sum and writes p, sum. Threads 1 and 2 (``torch.set_num_threads``, which also sets the OpenMP
count DeepSpeed's kernels run on). The variants of one (optimizer, size, threads) run interleaved
in one process, medians over ``--repeats`` rounds, with the fp32 ``a.add_(b)`` probe (12 bytes per
element) in the same rounds (:func:`benchmarks.common.probe_medians`). "of probe" is a variant's
bandwidth over the probe's; "× vs" columns are the peer's time over the variant's (> 1: faster
than the peer); for Adagrad "torch" is the faster of its two modes in that case.

Hyperparameters, the same in every variant: Lion ``lr=1e-4, betas=(0.9, 0.99),
weight_decay=1e-2`` (ours' and lion-pytorch's lr and betas; DeepSpeed's defaults are ``lr=1e-3,
betas=(0.9, 0.999)``, so they are passed); Adagrad torch's defaults (``lr=1e-2, eps=1e-10``, no
``lr_decay``, zero initial sums, which are also DeepSpeed's; DeepSpeed has no ``lr_decay`` nor
``initial_accumulator_value``) with L2 ``weight_decay=1e-4`` (``g + λ·p`` in all three). Before
timing, :func:`step_differences` takes 3 steps of every variant from the same params and grads
and reports the largest difference from ours; a variant beyond :data:`ULPS_PER_STEP` is marked ⚠.
They are the same update and differ only in rounding: DeepSpeed's Lion decays and steps p in one
fused multiply-add (ours: p·(1 − η·λ), then p − η·sign(c)), computes 1 − β in fp32 (ours in
fp64, rounded once) and moves p by ±η where c = 0 (ours, as lion-pytorch: by 0); its Adagrad
takes p + (g / (√s + eps))·(−η) in one multiply-add (ours: p + (−η·g) / (√s + eps)). DeepSpeed's
Lion also allocates an unused fp32 ``exp_avg_sq`` per param (memory only, no traffic).

DeepSpeed is not a dependency. For its rows install it, pinning torch so that pip keeps this one
(its CPU ops are compiled with ninja on first use; docs/benchmarks.md gives the install its
measurements there used, without build isolation):

    pip install deepspeed torch==2.13.0

Without it its rows and column say "not installed".

    python -m benchmarks.cpu_lion_adagrad [--optimizers lion adagrad] [--sizes 25M 100M] [--threads 1 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

import fused_optim
from benchmarks.common import PARAM_LISTS, deepspeed_optimizer, make_params, probe_medians, probe_row, run_description

BYTES = 20  # per element: read p, g and the state, write p and the state
KW = {"lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2),
      "adagrad": dict(lr=1e-2, eps=1e-10, weight_decay=1e-4)}
DEEPSPEED = {"lion": ("deepspeed.ops.lion", "DeepSpeedCPULion"),
             "adagrad": ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad")}
TORCH = ("torch foreach", "torch single")
SIZES = ("25M", "100M")
# A variant agrees with ours when every param is within this many ulps of max(|p|, lr) per step:
# each update rounds a handful of times (a multiply-add of p, the decay, the division), each off
# by at most half an ulp in either, so a few ulps per step; a different sign in Lion (2·lr) or
# another formula is far beyond it.
ULPS_PER_STEP = 4


def variants(opt: str) -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    """name -> (params -> optimizer): ours first, then DeepSpeed's (if it imports), then torch's."""
    kw = KW[opt]
    found = {"fused_optim": (lambda ps: fused_optim.Lion(ps, fused=True, **kw)) if opt == "lion"
             else (lambda ps: fused_optim.Adagrad(ps, fused=True, **kw))}
    deepspeed, _ = deepspeed_optimizer(*DEEPSPEED[opt])
    if deepspeed is not None:
        found[DEEPSPEED[opt][1]] = lambda ps: deepspeed(ps, **kw)
    if opt == "adagrad":
        found[TORCH[0]] = lambda ps: torch.optim.Adagrad(ps, foreach=True, **kw)
        found[TORCH[1]] = lambda ps: torch.optim.Adagrad(ps, foreach=False, **kw)
    return found


def step_differences(opt: str, steps: int = 3, numel: int = 4099) -> dict[str, float]:
    """variant -> the largest |p − p_ours| after ``steps`` steps from the same params and grads
    (fresh grads each step), in ulps of max(|p_ours|, lr) per step. ``numel`` is no multiple of a
    SIMD width, so vector loops and their scalar tails both run."""
    made = {name: make(make_params([(numel,)], torch.float32)) for name, make in variants(opt).items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grad = torch.randn(numel, generator=gen) * 1e-3
        for o in made.values():
            o.param_groups[0]["params"][0].grad = grad.clone()  # DeepSpeed's tails write into the grad
            o.step()
    params = {name: o.param_groups[0]["params"][0].detach() for name, o in made.items()}
    ours = params.pop("fused_optim")
    ulp = torch.finfo(torch.float32).eps * ours.abs().clamp_min(KW[opt]["lr"])
    return {name: ((p - ours).abs() / ulp).max().item() / steps for name, p in params.items()}


def bench(opt: str, label: str, shapes, threads: int, repeats: int, min_sample_s: float = 0.05) -> list[dict]:
    """One row per variant of ``opt``: the interleaved medians on ``threads`` threads."""
    made = variants(opt)
    numel = sum(torch.Size(s).numel() for s in shapes)
    med, probe_gbs = probe_medians(lambda: {name: make(make_params(shapes, torch.float32)).step
                                            for name, make in made.items()},
                                   numel, threads, repeats, min_sample_s)
    deepspeed = med.get(DEEPSPEED[opt][1])
    torch_best = min((med[t] for t in TORCH if t in med), default=None)
    rows = []
    for name in made:
        rows.append(dict(optimizer=opt, params=label, threads=threads,
                         **probe_row(name, med[name], BYTES, numel, probe_gbs),
                         vs_deepspeed=deepspeed / med[name] if deepspeed is not None else None,
                         vs_torch=torch_best / med[name] if torch_best is not None else None))
    return rows


def markdown(rows: list[dict], differences: dict[str, dict[str, float]], notes: dict[str, str],
             cpu: str = "") -> list[str]:
    """The table; ``differences``: :func:`step_differences` per optimizer; ``notes``: per
    optimizer, deepspeed's version or why DeepSpeed is missing."""
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    checks = "; ".join(f"{opt}: " + (", ".join(f"{name} {d:.2f}" for name, d in diff.items()) or "no peer")
                       for opt, diff in differences.items())
    deepspeed = "; ".join(f"{DEEPSPEED[opt][1]}: " + (f"DeepSpeed {note}" if note[0].isdigit() else
                                                      f"{note}, its rows and column n/a")
                          for opt, note in notes.items())
    lines = ["", "## Lion and Adagrad on the CPU (vs DeepSpeed's CPU Lion / Adagrad, torch's Adagrad)", "",
             f"fp32; {BYTES} bytes per element; probe fp32 `a.add_(b)`. {deepspeed}. Largest step difference "
             f"from ours, ulps per step (⚠ above {ULPS_PER_STEP}): {checks}. {cpu}", "",
             "| optimizer | params | threads | variant | ms | GB/s | of probe | × vs DeepSpeed | × vs torch |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        wrong = " ⚠" if differences[r["optimizer"]].get(r["variant"], 0.0) > ULPS_PER_STEP else ""
        lines.append(f"| {r['optimizer']} | {r['params']} | {r['threads']} | {r['variant']}{wrong} | {r['ms']:.2f} | "
                     f"{r['gb_per_s']:.1f} | {r['fraction_of_probe']:.2f} | {fmt(r['vs_deepspeed'])} | "
                     f"{fmt(r['vs_torch'])} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", nargs="+", default=list(KW), choices=list(KW))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    notes = {opt: deepspeed_optimizer(*DEEPSPEED[opt])[1] for opt in args.optimizers}
    differences = {opt: step_differences(opt) for opt in args.optimizers}
    rows = []
    for opt in args.optimizers:
        for size in args.sizes:
            label, shapes = PARAM_LISTS[size]
            for threads in args.threads:
                rows += bench(opt, label, shapes(), threads, args.repeats)
    cpu = run_description(args.repeats)
    print("\n".join(markdown(rows, differences, notes, cpu)))


if __name__ == "__main__":
    main()
