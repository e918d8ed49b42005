"""``fused-optim bench``: ours vs torch.optim's single-tensor / foreach / fused modes (SGD, AdamW),
vs timm's Lamb and Lars (foreach and single-tensor modes), and ``multi_tensor_l2norm`` vs
``torch._foreach_norm``.

All variants of one (optimizer, dtype, param list) run interleaved in one process, each on its
own copy of the same params and grads; each sample times ``inner`` steps, and the table reports
medians over ``repeats`` samples. Next to ms/step it reports the ratio peer / ours (>1: we are
faster; the peer is torch fused, the faster timm mode, or foreach_norm + stack), the effective
bandwidth (bytes one pass of the update must read and write / time) and its fraction of a probe
timed in the same rounds: an in-place read-modify-write (``a.add_(b)`` over the same number of
elements and dtype) for the optimizers, a read of one flat buffer for the norm. LAMB rows also
carry their step time over FusedAdam's (AdamW) from the same rounds. Absolute times on a shared
machine are noisy: read ratios.

AdaScale's overhead over the bare optimizer, ours vs fairscale's, is timed by
``adascale_overhead`` for the 1M and 25M lists (models of 200 tensors of those sizes).

timm is optional (``pip install --no-deps timm``: its package ``__init__`` needs torchvision); its
``optim/lamb.py`` and ``optim/lars.py`` are loaded by path, without ``timm/__init__``. Without it
the timm rows are missing and bench.md says so.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import _build
from ..adam import FusedAdam
from ..lamb import FusedLAMB
from ..lars import LARS
from ..norm import multi_tensor_l2norm
from ..sgd import FusedSGD
from . import adascale_overhead, master_weights, state_dtype

OPTIMIZERS = ("sgd", "adamw", "lamb", "lars", "norm")
# Bytes one pass of each update reads + writes per element, in units of the element size:
# sgd, lars: r p,g,buf w p,buf; adamw, lamb: r p,g,m,v w p,m,v; norm: r g. LAMB and LARS need norms
# before they can update (more reads unless a tensor stays in cache): their fraction stays lower.
TRAFFIC = {"sgd": 5, "adamw": 7, "lamb": 7, "lars": 5, "norm": 1}
# The variants each row's "× vs peer" divides by; with several, the fastest one of the case.
PEERS = {"sgd": ("torch fused",), "adamw": ("torch fused",), "lamb": ("timm foreach", "timm single"),
         "lars": ("timm foreach", "timm single"), "norm": ("torch foreach_norm + stack",)}
FUSED_ADAM = "FusedAdam (AdamW)"  # timed in the LAMB rounds: LAMB's step time over Adam's


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


def _foreach_global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The global norm with torch alone, as timm's Lamb computes it."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


_TIMM_PACKAGE = "_fused_optim_timm_optim"  # private name: a real `import timm` later is not shadowed


@functools.lru_cache(maxsize=None)
def timm_optimizers() -> tuple[dict[str, type], str]:
    """({"Lamb": .., "Lars": ..}, timm version), or ({}, why not): timm's ``optim/lamb.py`` and
    ``optim/lars.py`` imported as modules of an empty stub package whose path is timm's ``optim``
    directory, so their relative imports (``._helpers``, ``._types``) resolve and neither
    ``timm/__init__`` (needs torchvision) nor ``timm/optim/__init__`` runs."""
    spec = importlib.util.find_spec("timm")  # a top-level find_spec does not import the package
    if spec is None or not spec.submodule_search_locations:
        return {}, "timm is not installed"
    try:
        if _TIMM_PACKAGE not in sys.modules:
            stub = types.ModuleType(_TIMM_PACKAGE)
            stub.__path__ = [os.path.join(next(iter(spec.submodule_search_locations)), "optim")]
            sys.modules[_TIMM_PACKAGE] = stub
        classes = {name: getattr(importlib.import_module(f"{_TIMM_PACKAGE}.{name.lower()}"), name)
                   for name in ("Lamb", "Lars")}
    except Exception as exc:  # another timm version, a broken install: the rows are just missing
        return {}, f"timm's optim/lamb.py, lars.py did not load ({type(exc).__name__}: {exc})"
    return classes, importlib.metadata.version("timm")


def _variants(opt: str) -> dict[str, Callable[[list[torch.nn.Parameter]], Callable[[], object]]]:
    """name -> (params -> the step to time). The first one is ours."""
    if opt == "sgd":
        kw = dict(lr=1e-3, momentum=0.9, weight_decay=1e-4)
        return {
            "fused_optim": lambda ps: FusedSGD(ps, fused=True, **kw).step,
            "torch fused": lambda ps: torch.optim.SGD(ps, fused=True, **kw).step,
            "torch foreach": lambda ps: torch.optim.SGD(ps, foreach=True, **kw).step,
            "torch single": lambda ps: torch.optim.SGD(ps, foreach=False, **kw).step,
        }
    if opt == "adamw":
        kw = dict(lr=1e-3, weight_decay=1e-2)
        return {
            "fused_optim": lambda ps: FusedAdam(ps, fused=True, **kw).step,
            "torch fused": lambda ps: torch.optim.AdamW(ps, fused=True, **kw).step,
            "torch foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kw).step,
            "torch single": lambda ps: torch.optim.AdamW(ps, foreach=False, **kw).step,
        }
    if opt == "norm":  # the global norm of the grads, as LAMB's clipping (and clip_grad_norm_) needs it
        grads = lambda ps: [p.grad for p in ps]  # noqa: E731
        return {
            "fused_optim": lambda ps: functools.partial(multi_tensor_l2norm, grads(ps), fused=True),
            "torch foreach_norm + stack": lambda ps: functools.partial(_foreach_global_norm, grads(ps)),
            "torch foreach_norm (per tensor only)": lambda ps: functools.partial(torch._foreach_norm, grads(ps)),
        }
    # LAMB: timm Lamb's defaults (decay added to the update, as FusedLAMB's adam_w_mode). LARS: the
    # trust coefficient is trust_coefficient in ours, trust_coeff in timm.
    if opt == "lamb":
        ours, timm, kw = FusedLAMB, "Lamb", dict(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
        timm_kw = kw
    else:
        ours, timm, timm_kw = LARS, "Lars", dict(lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coeff=1e-3)
        kw = {k.replace("trust_coeff", "trust_coefficient"): v for k, v in timm_kw.items()}
    variants = {"fused_optim": lambda ps: ours(ps, fused=True, **kw).step}
    timm_cls = timm_optimizers()[0].get(timm)
    if timm_cls is not None:
        variants["timm foreach"] = lambda ps: timm_cls(ps, foreach=True, **timm_kw).step
        variants["timm single"] = lambda ps: timm_cls(ps, foreach=False, **timm_kw).step
    if opt == "lamb":
        variants[FUSED_ADAM] = _variants("adamw")["fused_optim"]
    return variants


def _step_disagreements(opt: str, dtype: torch.dtype) -> set[str]:
    """The variants of ``opt`` (sgd, adamw) whose two steps on one 4097-element tensor move the
    param far from where torch's single-tensor mode moves it: ‖Δ − Δ_single‖ > ½‖Δ_single‖.

    Params ~N(0, 0.01²) and grads ~N(0, 10²) make the benchmarked lr's steps visible in bf16 (the
    timed lists' 1e-3 grads barely move bf16 params). Rounding differences between correct modes
    stay far below the bound; a mode that skips part of the update does not: torch 2.13's fused
    CPU SGD never writes fp16/bf16 params (Δ = 0), so it also skips that memory traffic."""
    if opt not in ("sgd", "adamw"):
        return set()
    gen = torch.Generator().manual_seed(1)
    start = (torch.randn(4097, generator=gen) * 1e-2).to(dtype)
    grads = [(torch.randn(4097, generator=gen) * 10).to(dtype) for _ in range(2)]
    moves = {}
    for name, make in _variants(opt).items():
        p = torch.nn.Parameter(start.clone())
        step = make([p])
        for g in grads:
            p.grad = g.clone()
            step()
        moves[name] = p.detach().float() - start.float()
    single = moves.pop("torch single")
    bound = 0.5 * torch.linalg.vector_norm(single)
    return {name for name, move in moves.items() if torch.linalg.vector_norm(move - single) > bound}


@dataclass
class Row:
    optimizer: str
    dtype: str
    params: str
    tensors: int
    numel: int
    variant: str
    ms_per_step: float
    peer: str | None  # the (fastest) peer variant; None: none ran (timm missing)
    speedup_vs_peer: float | None  # peer's time / this row's
    gb_per_s: float
    fraction_of_probe: float  # read-modify-write probe; for "norm" the read probe
    probe_gb_per_s: float
    time_vs_fused_adam: float | None = None  # lamb: this row's time / FusedAdam's in the same rounds
    wrong: bool = False  # its step disagrees with torch's single-tensor mode (_step_disagreements)


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


def interleaved_medians(steppers: dict[str, Callable[[], None]], repeats: int, min_sample_s: float) -> dict[str, float]:
    """Median seconds per call of each stepper: one warm-up call each (state allocation), then
    ``repeats`` rounds that time every stepper in turn, each sample long enough (min_sample_s)."""
    for f in steppers.values():
        f()
    inner = {k: max(1, int(min_sample_s / max(min(_time(f, 1) for _ in range(3)), 1e-6))) for k, f in steppers.items()}
    samples: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(repeats):
        for k, f in steppers.items():
            samples[k].append(_time(f, inner[k]))
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_case(opt: str, dtype: torch.dtype, list_id: str, repeats: int, min_sample_s: float = 0.02) -> list[Row]:
    label, make_shapes = PARAM_LISTS[list_id]
    shapes = make_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    variants = _variants(opt)
    steppers = {}
    for name, make in variants.items():
        steppers[name] = make(_make_params(shapes, dtype))
        steppers[name]()  # state allocation and the JIT build are not part of the timing
    size = torch.empty((), dtype=dtype).element_size()
    if opt == "norm":
        # Read probe: an int64 sum over the same bytes. Plain integer adds, the same for every dtype,
        # stream at the read bandwidth: on 2 AVX-512 threads 37-42 GB/s at 25M and 100M elements, as
        # fast as a.sum() (34-39; bf16 upcasts) and above a.amax() (11-36) and _foreach_norm([a]) (23-30).
        ints = torch.randint(1 << 62, (numel * size // 8,))
        probe_bytes, steppers["probe"] = 1, ints.sum
    else:
        a = torch.randn(numel).to(dtype)
        b = torch.randn(numel).to(dtype) * 1e-3
        probe_bytes, steppers["probe"] = 3, lambda: a.add_(b)
    # Samples of roughly min_sample_s each, from the fastest of 3 calls: the first call after another
    # variant finds its data evicted from the cache and can take several times a step, which made
    # samples of a dozen steps where a hundred were meant. Each sample still starts with such a step.
    inner = {k: max(1, int(min_sample_s / max(min(_time(f, 1) for _ in range(3)), 1e-6))) for k, f in steppers.items()}
    samples: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(repeats):  # interleaved: every variant once per round
        for k, f in steppers.items():
            samples[k].append(_time(f, inner[k]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    probe_gbs = probe_bytes * size * numel / med["probe"] / 1e9
    peer = min((p for p in PEERS[opt] if p in med), key=med.get, default=None)
    wrong = _step_disagreements(opt, dtype)
    rows = []
    for k in variants:
        gbs = TRAFFIC[opt] * size * numel / med[k] / 1e9
        rows.append(Row(opt, str(dtype).replace("torch.", ""), label, len(shapes), numel, k, med[k] * 1e3,
                        peer, med[peer] / med[k] if peer else None, gbs, gbs / probe_gbs, probe_gbs,
                        med[k] / med[FUSED_ADAM] if FUSED_ADAM in med else None, k in wrong))
    return rows


def host_overhead_us(opt: str, tensors: int = 2000, repeats: int = 15) -> dict[str, float]:
    """Step time per tensor on 1-element tensors: the cost that is not arithmetic."""
    out = {}
    for name in ("fused_optim", "torch fused"):
        step = _variants(opt)[name](_make_params([(1,)] * tensors, torch.float32))
        step()
        out[name] = statistics.median(_time(step, 5) for _ in range(repeats)) / tensors * 1e6
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


def _table(rows: list[Row], speedup: str, probe: str = "of probe", peer: bool = False, adam: bool = False) -> list[str]:
    """One markdown table; optional columns: the peer's name, LAMB's time over FusedAdam's."""
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    cols = [("optimizer", lambda r: r.optimizer), ("dtype", lambda r: r.dtype), ("params", lambda r: r.params),
            ("variant", lambda r: r.variant + " ⚠" * r.wrong), ("ms/step", lambda r: f"{r.ms_per_step:.3f}")]
    cols += [("peer", lambda r: r.peer or "n/a")] * peer + [(speedup, lambda r: fmt(r.speedup_vs_peer))]
    cols += [("time / FusedAdam", lambda r: fmt(r.time_vs_fused_adam))] * adam
    cols += [("GB/s", lambda r: f"{r.gb_per_s:.1f}"), (probe, lambda r: f"{r.fraction_of_probe:.2f}")]
    numeric = lambda h: h not in ("optimizer", "dtype", "params", "variant", "peer")  # noqa: E731
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "".join("---:|" if numeric(h) else "---|" for h, _ in cols)]
    return lines + ["| " + " | ".join(cell(r) for _, cell in cols) + " |" for r in rows]


def markdown(rows: list[Row], host: dict, build: dict | None, timm: str | None = None,
             adascale: list[dict] | None = None) -> str:
    """``timm``: its version, or why it is unavailable (None: no LAMB / LARS rows to explain)."""
    by_opt = lambda *opts: [r for r in rows if r.optimizer in opts]  # noqa: E731
    lines = [
        f"{_build.cpu_description()}; torch {torch.__version__}; medians of interleaved rounds.",
        "",
        *_table(by_opt("sgd", "adamw"), "× vs torch fused"),
    ]
    if any(r.wrong for r in rows):
        lines += ["", "⚠ wrong results: two steps of this mode on a 4097-element check tensor land far from torch's "
                      "single-tensor mode (‖Δ − Δ_single‖ > ½‖Δ_single‖). It skips part of the update, and with it "
                      "part of the memory traffic (torch 2.13's fused CPU SGD never writes fp16/bf16 params): its "
                      "time is no like-for-like baseline."]
    if by_opt("lamb", "lars"):
        have_timm = any(r.variant.startswith("timm") for r in rows)
        floor = ("With clipping, LAMB moves 11 element sizes where nothing stays in the cache (the grads' norm 1, "
                 "the moments 6, the update 4) against Adam's 7: at the memory bandwidth, time / FusedAdam is "
                 "11/7 = 1.57.")
        lines += ["", (f"LAMB (lr 1e-3, weight decay 0.01, max_grad_norm 1.0) and LARS (lr 0.1, momentum 0.9, "
                       f"weight decay 1e-4, trust coefficient 0.001) vs timm {timm}: × vs the faster of its foreach "
                       f"and single-tensor modes (peer); time / FusedAdam: LAMB's step over FusedAdam's "
                       f"(AdamW, weight decay 0.01) in the same rounds. GB/s count one pass (7 and 5 element "
                       f"sizes), though both need norms before updating. {floor}" if have_timm else
                       f"LAMB and LARS: **timm rows unavailable** ({timm}; `pip install --no-deps timm==1.0.31`), "
                       f"so there is no × vs timm; time / FusedAdam: LAMB's step over FusedAdam's in the same "
                       f"rounds. {floor}"), "",
                  *_table(by_opt("lamb", "lars"), "× vs peer", peer=True, adam=True)]
    if by_opt("norm"):
        lines += ["", "Global L2 norm of the grads: `multi_tensor_l2norm(grads)` vs "
                      "`torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))` (peer) and the bare "
                      "per-tensor `torch._foreach_norm(grads)`; of read probe: fraction of the GB/s of an int64 "
                      "`sum()` over the same bytes.", "",
                  *_table(by_opt("norm"), "× vs peer", probe="of read probe", peer=True)]
    if adascale:
        lines += ["", *adascale_overhead.markdown(adascale)]
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
    print(f"fused-optim bench on {_build.cpu_description()}", flush=True)
    for list_id in lists:
        for opt in OPTIMIZERS:
            for dtype in (torch.float32, torch.bfloat16):
                case = bench_case(opt, dtype, list_id, repeats)
                rows += case
                r = case[0]
                wrong = " (wrong results)" * any(row.wrong and row.variant == r.peer for row in case)
                print(f"{opt:6} {r.dtype:9} {r.params:32} fused_optim {r.ms_per_step:8.3f} ms  "
                      f"×{r.speedup_vs_peer or float('nan'):6.2f} vs {r.peer}{wrong}  {r.fraction_of_probe:.2f} of probe",
                      flush=True)
    adascale = [adascale_overhead.overhead(list_id, repeats * 2) for list_id in lists
                if list_id in adascale_overhead.WIDTHS]
    for r in adascale:
        print(f"adascale {r['tensors']} tensors / {r['params'] / 1e6:.1f}M: overhead "
              f"{r['fused_optim.AdaScale']['overhead_ms']:.2f} ms, fairscale's "
              f"{r.get('fairscale AdaScale', {}).get('overhead_ms', float('nan')):.2f} ms, NoiseScale "
              f"{r['fused_optim.NoiseScale']['overhead_ms']:.2f} ms", flush=True)
    masters = [master_weights.bench(opt, list_id, repeats) for list_id in lists if list_id in master_weights.LISTS
               for opt in ("adamw", "sgd")]
    for r in masters:
        print(f"{r['opt']:6} bf16 + fp32 masters {r['params']:32} fused_optim {r['ours_ms']:8.3f} ms  "
              f"×{r['speedup']:6.2f} vs torch fused on masters + copies  {r['fraction_of_probe']:.2f} of probe",
              flush=True)
    compact = [state_dtype.bench(list_id, repeats) for list_id in lists if list_id in state_dtype.LISTS]
    for res in compact:
        for r in res["rows"]:
            print(f"adamw  {r['variant']:24} {res['params']:32} {r['ms']:8.3f} ms  ×{r['speedup_vs_fp32_state']:5.2f} "
                  f"vs fp32 state  {r['state_bytes_per_param']:.2f} B/param of state", flush=True)
    host = {opt: host_overhead_us(opt) for opt in ("sgd", "adamw")}
    build = build_timing() if (not quick if build is None else build) else None
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "bench.json", out / "bench.md"
    classes, timm = timm_optimizers()
    json_path.write_text(json.dumps({"rows": [asdict(r) for r in rows], "host_us_per_tensor": host,
                                     "build": build, "adascale": adascale, "master_weights": masters,
                                     "state_dtype": compact,
                                     "torch": torch.__version__,
                                     "timm": timm if classes else None, "timm_unavailable": None if classes else timm,
                                     "threads": torch.get_num_threads(), "cpu": _build.cpu_description()},
                                    indent=2))
    md_path.write_text(markdown(rows, host, build, timm, adascale) + "\n".join(master_weights.markdown(masters))
                       + "\n".join(state_dtype.markdown(compact)) + "\n")
    return json_path, md_path
