"""What the CPU and CUDA benchmarks share: the param lists (ResNet-50's shapes among them), the
variants each optimizer is timed in (ours, torch.optim's modes, timm's Lamb and Lars), the timing
loop (interleaved rounds, medians; with the fp32 probe on a set thread count for the CPU
benchmarks against DeepSpeed), DeepSpeed's optional CPU optimizers, the result row and its
markdown table."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch

import fused_optim
from fused_optim import LARS, FusedAdam, FusedLAMB, FusedSGD, multi_tensor_l2norm

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


def foreach_global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
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


def variants(opt: str) -> dict[str, Callable[[list[torch.nn.Parameter]], Callable[[], object]]]:
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
            "torch foreach_norm + stack": lambda ps: functools.partial(foreach_global_norm, grads(ps)),
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
    timed = {"fused_optim": lambda ps: ours(ps, fused=True, **kw).step}
    timm_cls = timm_optimizers()[0].get(timm)
    if timm_cls is not None and "foreach" in inspect.signature(timm_cls).parameters:
        timed["timm foreach"] = lambda ps: timm_cls(ps, foreach=True, **timm_kw).step
        timed["timm single"] = lambda ps: timm_cls(ps, foreach=False, **timm_kw).step
    elif timm_cls is not None:  # a timm whose Lamb / Lars take no foreach: their loops are per tensor
        timed["timm single"] = lambda ps: timm_cls(ps, **timm_kw).step
    if opt == "lamb":
        timed[FUSED_ADAM] = variants("adamw")["fused_optim"]
    return timed


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


def make_params(shapes, dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
        p.grad = torch.randn(s, generator=gen).to(dtype) * 1e-3
        params.append(p)
    return params


def time_calls(fn: Callable[[], None], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def interleaved_medians(steppers: dict[str, Callable[[], None]], repeats: int, min_sample_s: float,
                        agree: Callable[[dict[str, int]], dict[str, int]] | None = None) -> dict[str, float]:
    """Median seconds per call of each stepper: one warm-up call each (state allocation, the JIT
    build), then ``repeats`` rounds that time every stepper in turn (interleaved: drifts in the
    machine's speed hit all alike). Each sample is roughly ``min_sample_s`` long, its call count
    sized from the fastest of 3 calls: the first call after another stepper finds its data evicted
    from the cache and can take several times a step, which made samples of a dozen steps where a
    hundred were meant. Each sample still starts with such a step. ``agree`` (processes timing
    steps that meet in collectives) makes the call counts the same in every process."""
    for f in steppers.values():
        f()
    inner = {k: max(1, int(min_sample_s / max(min(time_calls(f, 1) for _ in range(3)), 1e-6)))
             for k, f in steppers.items()}
    if agree is not None:
        inner = agree(inner)
    samples: dict[str, list[float]] = {k: [] for k in steppers}
    for _ in range(repeats):
        for k, f in steppers.items():
            samples[k].append(time_calls(f, inner[k]))
    return {k: statistics.median(v) for k, v in samples.items()}


PROBE_BYTES = 12  # fp32 a.add_(b): read a and b, write a


def probe_medians(make_steppers: Callable[[], dict[str, Callable[[], object]]], numel: int, threads: int,
                  repeats: int, min_sample_s: float) -> tuple[dict[str, float], float]:
    """(median seconds per call of each stepper, the probe's GB/s) on ``threads`` threads
    (``torch.set_num_threads``, which also sets the OpenMP count DeepSpeed's kernels run on;
    restored after). ``make_steppers`` is called with the threads set; the probe, fp32
    ``a.add_(b)`` over ``numel`` elements (:data:`PROBE_BYTES` per element), runs in the same
    :func:`interleaved_medians` rounds under the name ``"probe"``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steppers = make_steppers()
        a, b = torch.randn(numel), torch.randn(numel) * 1e-3
        steppers["probe"] = lambda: a.add_(b)
        med = interleaved_medians(steppers, repeats, min_sample_s)
    finally:
        torch.set_num_threads(previous)
    return med, PROBE_BYTES * numel / med["probe"] / 1e9


def probe_row(variant: str, seconds: float, moved: float, numel: int, probe_gbs: float) -> dict:
    """A timed variant's row of the probe benchmarks: its ms per step, its bandwidth (``moved``
    bytes per element over ``numel`` elements) and that as a fraction of the probe's."""
    gbs = moved * numel / seconds / 1e9
    return dict(variant=variant, ms=seconds * 1e3, gb_per_s=gbs, fraction_of_probe=gbs / probe_gbs,
                probe_gb_per_s=probe_gbs)


def run_description(repeats: int) -> str:
    """The line a CPU benchmark's table names its run by: the CPU (and its ISA), torch, the rounds."""
    return (f"CPU: {fused_optim.cpu_description()}, torch {torch.__version__}, {repeats} interleaved rounds, "
            "medians.")


def deepspeed_optimizer(module: str, name: str) -> tuple[type | None, str]:
    """(DeepSpeed's class ``name`` of ``module``, deepspeed's version), or (None, why it is
    missing). DeepSpeed is not a dependency; its CPU ops are compiled with ninja on first use."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:
        return None, "not installed"
    except Exception as exc:  # installed but broken (built for another torch, no compiler)  # noqa: BLE001
        return None, f"did not import ({type(exc).__name__}: {exc})"
    return cls, importlib.metadata.version("deepspeed")


def table(rows: list[Row], speedup: str, probe: str = "of probe", peer: bool = False, adam: bool = False) -> list[str]:
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
