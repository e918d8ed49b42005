"""AdaScale's overhead per training step, ours vs fairscale's, and NoiseScale's, in one run (part of
``python -m benchmarks``).

The model is 100 ``Linear(w, w)`` layers (200 tensors: weights and biases); a training step is
``accum`` = 2 forward + backward passes of a batch of 32 and one FusedSGD step (momentum 0.9) with
``zero_grad()``. Three copies of the model, equal at the start, train interleaved round by round:
bare FusedSGD, ``fused_optim.AdaScale`` around it, ``fused_optim.NoiseScale`` around it and fairscale's
``AdaScale`` around it (when fairscale is installed). A wrapper's overhead is the median over rounds of its step time minus the
bare step time of the same round; the table gives it in ms, as a fraction of the bare step, and
ours over fairscale's.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from fused_optim import AdaScale, FusedSGD, NoiseScale

WIDTHS = {"1M": 100, "25M": 500}  # param list id of the optimizer benchmark -> layer width
ACCUM, BATCH, LAYERS = 2, 32, 100


def _fairscale_adascale() -> type | None:
    try:
        from fairscale.optim.adascale import AdaScale as FairscaleAdaScale
    except ImportError:
        return None
    return FairscaleAdaScale


def _trainer(width: int, wrap: Callable | None) -> Callable[[], None]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)])
    x = torch.randn(BATCH, width)
    opt = FusedSGD(model.parameters(), lr=1e-4, momentum=0.9)
    if wrap is not None:
        opt = wrap(opt, world_size=1, num_gradients_to_accumulate=ACCUM)

    def step() -> None:
        for _ in range(ACCUM):
            (model(x).square().mean() / ACCUM).backward()
        opt.step()
        opt.zero_grad()

    return step


def overhead(list_id: str, repeats: int, steps_per_sample: int = 2) -> dict:
    """Step times and overheads for the model of ``WIDTHS[list_id]``."""
    width = WIDTHS[list_id]
    variants = {"bare FusedSGD": None, "fused_optim.AdaScale": AdaScale, "fused_optim.NoiseScale": NoiseScale}
    fairscale = _fairscale_adascale()
    if fairscale is not None:
        variants["fairscale AdaScale"] = fairscale
    steps = {name: _trainer(width, wrap) for name, wrap in variants.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # state allocation and the JIT build are not timed
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(steps_per_sample):
                step()
            samples[name].append((time.perf_counter() - start) / steps_per_sample)
    bare = samples["bare FusedSGD"]
    result = {"list": list_id, "tensors": 2 * LAYERS, "params": LAYERS * (width * width + width),
              "bare_ms": statistics.median(bare) * 1e3}
    for name in list(steps)[1:]:
        extra = statistics.median(t - b for t, b in zip(samples[name], bare))
        result[name] = {"ms": statistics.median(samples[name]) * 1e3, "overhead_ms": extra * 1e3,
                        "overhead_of_bare": extra / statistics.median(bare)}
    if fairscale is not None:
        result["ours_over_fairscale"] = (result["fused_optim.AdaScale"]["overhead_ms"]
                                         / result["fairscale AdaScale"]["overhead_ms"])
    return result


def markdown(results: list[dict]) -> list[str]:
    lines = [f"AdaScale overhead per training step ({ACCUM} backward passes of batch {BATCH} + FusedSGD step, "
             f"{LAYERS} Linear layers): median over rounds of (wrapped − bare) step time.", "",
             "| model | bare ms/step | fused_optim overhead ms | of bare | fairscale overhead ms | of bare "
             "| ours / fairscale | NoiseScale overhead ms | of bare |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ours, ref, noise = r["fused_optim.AdaScale"], r.get("fairscale AdaScale"), r["fused_optim.NoiseScale"]
        ref_cells = (f"{ref['overhead_ms']:.2f} | {ref['overhead_of_bare']:.1%} | {r['ours_over_fairscale']:.2f}"
                     if ref else "n/a | n/a | n/a (fairscale not installed)")
        lines.append(f"| {r['tensors']} tensors / {r['params'] / 1e6:.1f}M | {r['bare_ms']:.2f} | "
                     f"{ours['overhead_ms']:.2f} | {ours['overhead_of_bare']:.1%} | {ref_cells} | "
                     f"{noise['overhead_ms']:.2f} | {noise['overhead_of_bare']:.1%} |")
    return lines
