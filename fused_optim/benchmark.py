"""``fused-optim bench``: ours vs torch.optim's single-tensor / foreach / fused modes.

All variants of one (optimizer, dtype, param list) run interleaved in one process, each on its
own copy of the same params and grads; each sample times ``inner`` steps, and the table reports
medians over ``repeats`` samples. Next to ms/step it reports the ratio torch-fused / ours (>1:
we are faster), the effective bandwidth (bytes an update must read and write / time) and its
fraction of an in-place read-modify-write probe (``a.add_(b)`` over the same number of elements
and dtype) timed in the same rounds. Absolute times on a shared machine are noisy: read ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .adam import FusedAdam
from .sgd import FusedSGD

# Bytes each update reads + writes per element, in units of the element size.
TRAFFIC = {"sgd": 5, "adamw": 7}  # sgd: r p,g,buf w p,buf; adamw: r p,g,m,v w p,m,v


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of torchvision's ResNet-50 (25.6M params)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,),
                       (planes,), (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


# id -> (label, shapes)
PARAM_LISTS: dict[str, tuple[str, Callable[[], list[tuple[int, ...]]]]] = {
    "1M": ("200 tensors / 1M", lambda: [(5000,)] * 200),
    "25M": ("ResNet-50: 161 tensors / 25.6M", resnet50_shapes),
    "100M": ("20 tensors / 100M", lambda: [(5_000_000,)] * 20),
}
QUICK_LISTS = ["1M", "25M"]


def _variants(opt: str) -> dict[str, Callable]:
    if opt == "sgd":
        kw = dict(lr=1e-3, momentum=0.9, weight_decay=1e-4)
        return {
            "fused_optim": lambda ps: FusedSGD(ps, fused=True, **kw),
            "torch fused": lambda ps: torch.optim.SGD(ps, fused=True, **kw),
            "torch foreach": lambda ps: torch.optim.SGD(ps, foreach=True, **kw),
            "torch single": lambda ps: torch.optim.SGD(ps, foreach=False, **kw),
        }
    kw = dict(lr=1e-3, weight_decay=1e-2)
    return {
        "fused_optim": lambda ps: FusedAdam(ps, fused=True, **kw),
        "torch fused": lambda ps: torch.optim.AdamW(ps, fused=True, **kw),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kw),
        "torch single": lambda ps: torch.optim.AdamW(ps, foreach=False, **kw),
    }


@dataclass
class Row:
    optimizer: str
    dtype: str
    params: str
    tensors: int
    numel: int
    variant: str
    ms_per_step: float
    speedup_vs_torch_fused: float
    gb_per_s: float
    fraction_of_probe: float
    probe_gb_per_s: float


def _make_params(shapes, dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
        p.grad = torch.randn(s, generator=gen).to(dtype) * 1e-3
        params.append(p)
    return params


def _time(fn: Callable[[], None], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def bench_case(opt: str, dtype: torch.dtype, list_id: str, repeats: int, min_sample_s: float = 0.02) -> list[Row]:
    label, make_shapes = PARAM_LISTS[list_id]
    shapes = make_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    steppers = {}
    for name, make in _variants(opt).items():
        o = make(_make_params(shapes, dtype))
        o.step()  # state allocation and the JIT build are not part of the timing
        steppers[name] = o.step
    a = torch.randn(numel).to(dtype)
    b = torch.randn(numel).to(dtype) * 1e-3
    steppers["probe"] = lambda: a.add_(b)
    # Samples of roughly min_sample_s each.
    inner = {k: max(1, int(min_sample_s / max(_time(f, 1), 1e-6))) for k, f in steppers.items()}
    samples: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(repeats):  # interleaved: every variant once per round
        for k, f in steppers.items():
            samples[k].append(_time(f, inner[k]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    size = torch.empty((), dtype=dtype).element_size()
    probe_gbs = 3 * size * numel / med["probe"] / 1e9
    rows = []
    for k in _variants(opt):
        gbs = TRAFFIC[opt] * size * numel / med[k] / 1e9
        rows.append(Row(opt, str(dtype).replace("torch.", ""), label, len(shapes), numel, k,
                        med[k] * 1e3, med["torch fused"] / med[k], gbs, gbs / probe_gbs, probe_gbs))
    return rows


def host_overhead_us(opt: str, tensors: int = 2000, repeats: int = 15) -> dict[str, float]:
    """Step time per tensor on 1-element tensors: the cost that is not arithmetic."""
    out = {}
    for name in ("fused_optim", "torch fused"):
        o = _variants(opt)[name](_make_params([(1,)] * tensors, torch.float32))
        o.step()
        out[name] = statistics.median(_time(o.step, 5) for _ in range(repeats)) / tensors * 1e6
    return out


def build_timing() -> dict[str, float]:
    """First fused step in a fresh process: with an empty build cache (it includes the cold build
    of all CPU kernels), then again with the cache filled. Timed apart: ``import torch`` and the
    first ``torch.optim`` optimizer of a process (torch imports dynamo lazily there; any
    optimizer pays it once)."""
    code = (
        "import time; t0=time.perf_counter(); import torch, fused_optim; t1=time.perf_counter(); "
        "p=torch.nn.Parameter(torch.zeros(10)); p.grad=torch.ones(10); torch.optim.SGD([p], lr=0.1); "
        "t2=time.perf_counter(); fused_optim.FusedAdam([p], fused=True).step(); "
        "print(t1-t0, t2-t1, time.perf_counter()-t2)"
    )

    def first_step(env) -> list[float]:
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        return [float(x) for x in out.stdout.split()[-3:]]

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache}
        cold = first_step(env)[2]
        imports, first_torch_optimizer, warm = first_step(env)
    return {"cold_first_step_s": cold, "cached_first_step_s": warm, "import_s": imports,
            "first_torch_optimizer_s": first_torch_optimizer}


def markdown(rows: list[Row], host: dict, build: dict | None) -> str:
    lines = [
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}; medians of interleaved rounds.",
        "",
        "| optimizer | dtype | params | variant | ms/step | × vs torch fused | GB/s | of probe |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.optimizer} | {r.dtype} | {r.params} | {r.variant} | {r.ms_per_step:.3f} | "
                     f"{r.speedup_vs_torch_fused:.2f} | {r.gb_per_s:.1f} | {r.fraction_of_probe:.2f} |")
    lines += ["", "| host overhead, µs per tensor (1-element tensors) | fused_optim | torch fused |", "|---|---:|---:|"]
    for opt, h in host.items():
        lines.append(f"| {opt} | {h['fused_optim']:.3f} | {h['torch fused']:.3f} |")
    if build:
        lines += ["", f"First fused step in a new process: {build['cold_first_step_s']:.1f} s with an empty build "
                      f"cache (cold build of all CPU kernels), {build['cached_first_step_s']:.2f} s with the cache "
                      f"filled (apart: {build['import_s']:.1f} s for `import torch, fused_optim`, "
                      f"{build['first_torch_optimizer_s']:.1f} s for the process's first torch.optim optimizer)."]
    return "\n".join(lines) + "\n"


def run(out: Path, quick: bool = False, repeats: int | None = None, lists: list[str] | None = None,
        build: bool | None = None) -> tuple[Path, Path]:
    """Run the benchmark, write ``bench.json`` and ``bench.md`` under ``out``, return their paths.
    Defaults: all param lists, 11 rounds and the build timing; ``quick``: 1M and 25M, 5 rounds, no build."""
    repeats = repeats or (5 if quick else 11)
    lists = lists or (QUICK_LISTS if quick else list(PARAM_LISTS))
    rows: list[Row] = []
    for list_id in lists:
        for opt in ("sgd", "adamw"):
            for dtype in (torch.float32, torch.bfloat16):
                rows += bench_case(opt, dtype, list_id, repeats)
                r = rows[-4]
                print(f"{opt:6} {r.dtype:9} {r.params:32} fused_optim {r.ms_per_step:8.3f} ms  "
                      f"×{r.speedup_vs_torch_fused:5.2f} vs torch fused  {r.fraction_of_probe:.2f} of probe",
                      flush=True)
    host = {opt: host_overhead_us(opt) for opt in ("sgd", "adamw")}
    build = build_timing() if (not quick if build is None else build) else None
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "bench.json", out / "bench.md"
    json_path.write_text(json.dumps({"rows": [asdict(r) for r in rows], "host_us_per_tensor": host,
                                     "build": build, "torch": torch.__version__,
                                     "threads": torch.get_num_threads()}, indent=2))
    md_path.write_text(markdown(rows, host, build))
    return json_path, md_path
