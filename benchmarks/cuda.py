"""``python -m benchmarks --device cuda``: the GPU benchmark. Ours (FusedSGD momentum 0.9 + weight
decay, FusedAdam in AdamW mode, FusedLAMB, LARS, all ``fused=True``) vs ``torch.optim.SGD`` /
``AdamW`` with ``fused=True`` and ``foreach=True``, and vs timm's ``Lamb`` / ``Lars`` in their
foreach and single-tensor modes, on CUDA params of three lists (200 tensors / 1M, ResNet-50's 161
tensors / 25.6M, 20 tensors / 1B), fp32 and bf16.

How it is timed: every variant of one (optimizer, dtype, list) case steps its own copy of the same
params and grads (made on the GPU from one seed); after warm-up steps (state allocation, kernel
build) each sample is ``inner`` steps between two ``torch.cuda.Event(enable_timing=True)`` records
(``inner`` chosen so a sample lasts ~20 ms), so the time includes any launch overhead the GPU waits
on; the table reports medians over ``repeats`` rounds, variants interleaved within each round. A
device-to-device copy probe, ``dst.copy_(src)`` over flat byte buffers sized so that it moves
(reads + writes) the same bytes as one pass of the update (``common.TRAFFIC`` element sizes per
param), is timed in the same rounds. Each row reports ms/step, the ratio peer / ours (>1: ours is
faster; the peer is torch fused for SGD and AdamW, the faster timm mode for LAMB and LARS), the
effective bandwidth (bytes of one update pass / time) and its fraction of the copy bandwidth. At
1M elements the working set fits in L2 (50 MiB on H100), so the copy fraction means little there.

Memory: a case whose variants (and the probe) do not all fit in 90% of the free GPU memory by
``memory_bytes`` (params + grads + optimizer state + an upper bound on the peers' temporaries) runs
its variants one at a time, each interleaved with the probe, freeing each before the next (so does
a group that runs out of memory all the same); a variant that does not fit even alone is skipped,
and bench_cuda.md says so. At 1B params fp32 AdamW/LAMB need 16 GB each (bf16: 8 GB) and the
probe 28 GB (14 GB): on an 80 GB H100, fp32 AdamW and LAMB run one variant at a time.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

import fused_optim
from benchmarks.common import FUSED_ADAM, PARAM_LISTS, PEERS, TRAFFIC, Row, table, timm_optimizers, variants

OPTIMIZERS = ("sgd", "adamw", "lamb", "lars")
# id -> (label, shapes); 1M, 25M and 100M as in the CPU benchmark.
LISTS: dict[str, tuple[str, Callable[[], list[tuple[int, ...]]]]] = {
    "1M": PARAM_LISTS["1M"],
    "25M": PARAM_LISTS["25M"],
    "100M": PARAM_LISTS["100M"],
    "1B": ("20 tensors / 1B", lambda: [(50_000_000,)] * 20),
}
QUICK_LISTS = ["1M", "25M"]
SKIP_VARIANTS = {"torch single"}  # the issue compares torch's fused and foreach modes only
STATE = {"sgd": 1, "lars": 1, "adamw": 2, "lamb": 2}  # state tensors per param (momentum; m, v)
# Upper bounds on full-size temporaries a step allocates, in param copies: torch foreach makes one
# (SGD: grad + wd·p; AdamW: sqrt(v)); timm foreach up to three (clipped grads, denominator, update
# for Lamb; grad + wd·p, trust-scaled, + momentum for Lars), timm single three of the largest tensor.
TEMPORARIES = {"torch foreach": 1, "timm foreach": 3}
MEMORY_MARGIN = 0.9  # of the free memory
MIN_SAMPLE_S = 0.02
WARMUP = 3
DEVICE = "cuda"  # where params and the probe live (the tests stand the CPU in for it)
NO_GPU = "python -m benchmarks --device cuda needs a CUDA GPU: torch.cuda.is_available() is False"


class NoGPUError(RuntimeError):
    """Raised by ``run`` before doing anything when torch sees no CUDA GPU."""


def memory_bytes(opt: str, variant: str, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    """GPU bytes one variant needs: params, grads and state, plus an upper bound on its temporaries."""
    sizes = [math.prod(s) for s in shapes]
    temporaries = 3 * max(sizes) if variant == "timm single" else TEMPORARIES.get(variant, 0) * sum(sizes)
    return int((2 + STATE[opt]) * sum(sizes) + temporaries) * _element_size(dtype)


def probe_bytes(opt: str, numel: int, dtype: torch.dtype) -> int:
    """Size of each of the copy probe's two buffers: together they move TRAFFIC element sizes per param."""
    return TRAFFIC[opt] * numel * _element_size(dtype) // 2


def plan(opt: str, variants: list[str], shapes, dtype, free: int) -> tuple[list[list[str]], dict[str, str]]:
    """(groups of variants to hold and interleave at once, {skipped variant: why}) for ``free`` bytes:
    all in one group if they fit together with the probe, else one at a time."""
    budget = MEMORY_MARGIN * free - 2 * probe_bytes(opt, sum(math.prod(s) for s in shapes), dtype)
    need = {v: memory_bytes(opt, v, shapes, dtype) for v in variants}
    if sum(need.values()) <= budget:
        return [list(variants)], {}
    skipped = {v: f"needs {need[v] / 2**30:.1f} GiB, {max(budget, 0) / 2**30:.1f} GiB left beside the probe"
               for v in variants if need[v] > budget}
    return [[v] for v in variants if v not in skipped], skipped


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _make_params(shapes, dtype) -> list[torch.nn.Parameter]:
    """Params and grads made on the GPU from one seed: every call returns the same values.
    (common.make_params makes them on the CPU: too slow at 1B.)"""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen, device=DEVICE, dtype=dtype))
        p.grad = torch.randn(s, generator=gen, device=DEVICE, dtype=dtype) * 1e-3
        params.append(p)
    return params


def _time(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call: ``inner`` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / inner


def _free_memory() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def bench_case(opt: str, dtype: torch.dtype, list_id: str, repeats: int) -> tuple[list[Row], dict]:
    """The rows of one case and a record of how it ran (memory estimates, groups, skipped variants)."""
    label, make_shapes = LISTS[list_id]
    shapes = make_shapes()
    numel = sum(math.prod(s) for s in shapes)
    timed = {k: v for k, v in variants(opt).items() if k not in SKIP_VARIANTS}
    free = _free_memory()
    groups, skipped = plan(opt, list(timed), shapes, dtype, free)
    n = probe_bytes(opt, numel, dtype) if groups else 0  # nothing fits: no probe either
    src, dst = torch.ones(n, dtype=torch.uint8, device=DEVICE), torch.empty(n, dtype=torch.uint8, device=DEVICE)
    probe = lambda: dst.copy_(src)  # noqa: E731
    samples: dict[str, list[float]] = {"probe": []}
    inner: dict[str, int] = {}
    one_at_a_time, queue = len(groups) > 1, list(groups)
    while queue:
        group = queue.pop(0)
        try:
            steppers = {k: timed[k](_make_params(shapes, dtype)) for k in group}
            steppers["probe"] = probe
            for k, f in steppers.items():
                for _ in range(WARMUP):
                    f()
                inner.setdefault(k, max(1, math.ceil(MIN_SAMPLE_S / _time(f, WARMUP))))
            for _ in range(repeats):  # interleaved: every variant of the group and the probe once per round
                for k, f in steppers.items():
                    samples.setdefault(k, []).append(_time(f, inner[k]))
        except torch.cuda.OutOfMemoryError as exc:  # the estimate was short: retry alone, else skip
            for k in group:
                samples.pop(k, None)
            if len(group) > 1:
                one_at_a_time, queue = True, queue + [[k] for k in group]
            else:
                skipped[group[0]] = f"out of memory ({str(exc).splitlines()[0]})"
        finally:
            steppers = f = None  # drop the group's optimizers, params and grads
            _free_memory()
    probe = src = dst = None  # free the probe buffers
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    size = _element_size(dtype)
    probe_gbs = 2 * n / med["probe"] / 1e9 if "probe" in med else math.nan
    peer = min((p for p in PEERS[opt] if p in med), key=med.get, default=None)
    rows = []
    for k in timed:
        if k not in med:
            continue
        gbs = TRAFFIC[opt] * size * numel / med[k] / 1e9
        rows.append(Row(opt, str(dtype).replace("torch.", ""), label, len(shapes), numel, k, med[k] * 1e3,
                        peer, med[peer] / med[k] if peer else None, gbs, gbs / probe_gbs, probe_gbs,
                        med[k] / med[FUSED_ADAM] if FUSED_ADAM in med else None))
    record = {"optimizer": opt, "dtype": str(dtype).replace("torch.", ""), "params": label,
              "free_gib": free / 2**30,
              "probe_bytes_moved": 2 * probe_bytes(opt, numel, dtype),
              "copy_gb_per_s": probe_gbs if "probe" in med else None,
              "variant_gib": {k: memory_bytes(opt, k, shapes, dtype) / 2**30 for k in timed},
              "one_at_a_time": one_at_a_time, "skipped": skipped}
    return rows, record


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets, each with how many of our rows meet it and the worst one."""
    ours = [r for r in rows if r.variant == "fused_optim"]
    checks = [
        ("≥1.0× torch fused (SGD, AdamW)", [r for r in ours if r.optimizer in ("sgd", "adamw")],
         lambda r: r.speedup_vs_peer, 1.0, "×"),
        ("≥0.9 of the copy bandwidth at 25M and above", [r for r in ours if r.numel >= 20_000_000],
         lambda r: r.fraction_of_probe, 0.9, ""),
        ("≥5× the faster timm mode (LAMB, LARS)", [r for r in ours if r.optimizer in ("lamb", "lars")],
         lambda r: r.speedup_vs_peer, 5.0, "×"),
    ]
    lines = []
    for name, cases, value, target, unit in checks:
        known = [r for r in cases if value(r) is not None]
        if not known:
            lines.append(f"- {name}: no measurement")
            continue
        worst = min(known, key=value)
        missing = f", {len(cases) - len(known)} without a peer" if len(known) < len(cases) else ""
        lines.append(f"- {name}: met in {sum(value(r) >= target for r in known)}/{len(known)}{missing}; worst "
                     f"{value(worst):.2f}{unit} ({worst.optimizer} {worst.dtype} {worst.params})")
    return lines


def markdown(rows: list[Row], records: list[dict], device: str, timm: str | None) -> str:
    by_opt = lambda *opts: [r for r in rows if r.optimizer in opts]  # noqa: E731
    lines = [f"{device}, torch {torch.__version__}; host CPU {fused_optim.cpu_description()}; CUDA-event timing, "
             f"medians of interleaved rounds; "
             f"of copy: fraction of the bandwidth of `dst.copy_(src)` moving the same bytes in the same rounds.",
             "", "Targets (fused_optim rows):", *targets(rows), "",
             *table(by_opt("sgd", "adamw"), "× vs torch fused", probe="of copy")]
    if by_opt("lamb", "lars"):
        lines += ["", f"LAMB and LARS vs timm {timm}: × vs the faster of its foreach and single-tensor modes "
                      f"(peer); time / FusedAdam: LAMB's step over FusedAdam's (AdamW) in the same rounds. GB/s "
                      f"count one pass (7 and 5 element sizes), though both need norms before updating.", "",
                  *table(by_opt("lamb", "lars"), "× vs peer", probe="of copy", peer=True, adam=True)]
    lines += ["", "| params | dtype | optimizer | copy MB moved | copy GB/s |", "|---|---|---|---:|---:|"]
    for rec in records:
        gbs = "n/a" if rec["copy_gb_per_s"] is None else f"{rec['copy_gb_per_s']:.0f}"
        lines.append(f"| {rec['params']} | {rec['dtype']} | {rec['optimizer']} | "
                     f"{rec['probe_bytes_moved'] / 1e6:.1f} | {gbs} |")
    for rec in records:
        case = f"{rec['optimizer']} {rec['dtype']} {rec['params']}"
        if rec["one_at_a_time"]:
            lines.append(f"\n{case}: variants run one at a time (each interleaved with the copy probe only): "
                         f"together they need more than {MEMORY_MARGIN:.0%} of the {rec['free_gib']:.1f} GiB free.")
        for variant, why in rec["skipped"].items():
            lines.append(f"\n{case}: **{variant} skipped**: {why}.")
    return "\n".join(lines) + "\n"


def run(out: Path, quick: bool = False, repeats: int | None = None,
        lists: list[str] | None = None) -> tuple[Path, Path]:
    """Run the GPU benchmark, write ``bench_cuda.json`` and ``bench_cuda.md`` under ``out``, return
    their paths. Defaults: all lists, 11 rounds; ``quick``: 1M and 25M, 5 rounds."""
    if not torch.cuda.is_available():
        raise NoGPUError(NO_GPU)
    repeats = repeats or (5 if quick else 11)
    lists = lists or (QUICK_LISTS if quick else list(LISTS))
    device = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    print(f"benchmarks on {device}, host CPU {fused_optim.cpu_description()}", flush=True)
    rows: list[Row] = []
    records: list[dict] = []
    for list_id in lists:
        for opt in OPTIMIZERS:
            for dtype in (torch.float32, torch.bfloat16):
                case, record = bench_case(opt, dtype, list_id, repeats)
                rows += case
                records.append(record)
                r = next((r for r in case if r.variant == "fused_optim"), None)
                print(f"{opt:6} {record['dtype']:9} {record['params']:32} " + (
                      f"fused_optim {r.ms_per_step:8.3f} ms  ×{r.speedup_vs_peer or float('nan'):6.2f} vs {r.peer}  "
                      f"{r.fraction_of_probe:.2f} of copy" if r else f"skipped: {record['skipped']}"), flush=True)
    classes, timm = timm_optimizers()
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "bench_cuda.json", out / "bench_cuda.md"
    json_path.write_text(json.dumps({"rows": [asdict(r) for r in rows], "cases": records, "device": device,
                                     "host_cpu": fused_optim.cpu_description(),
                                     "torch": torch.__version__, "timm": timm if classes else None,
                                     "timm_unavailable": None if classes else timm}, indent=2))
    md_path.write_text(markdown(rows, records, device, timm if classes else f"unavailable: {timm}"))
    return json_path, md_path
