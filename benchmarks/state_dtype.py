"""AdamW on fp32 params with compact state: ours with fp32 state (``state_dtype=None``), bf16
state (to nearest, and stochastically rounded) and 8-bit state, and the 8-bit AdamW of torchao or
bitsandbytes where they are installed (CPU).

Bytes per element a step must move: grad 4 + param r/w 8 + m and v r/w: fp32 16, bf16 8, 8-bit 4
(+ 2 absmaxes per 256 elements, r/w: 0.06) -> 28, 20, ~16. State memory per element: 8, 4, ~2.03.
The probe is fp32 ``a.add_(b)`` (12 bytes per element), timed in the same rounds. Interleaved
rounds, medians, as :mod:`.optimizers`; ratios are against our fp32-state step of the same run.

    python -m benchmarks.state_dtype [--lists 25M 100M] [--repeats 7]
"""

from __future__ import annotations

import argparse
import importlib
import torch

from benchmarks.common import PARAM_LISTS, interleaved_medians, run_description
from fused_optim import AdamW

LISTS = ("25M", "100M")
VARIANTS = {  # label -> (our AdamW's keywords, bytes moved per element, state bytes per element)
    "fp32 state": (dict(), 28.0, 8.0),
    "bf16 state": (dict(state_dtype=torch.bfloat16), 20.0, 4.0),
    "bf16 state, stochastic": (dict(state_dtype=torch.bfloat16, state_rounding="stochastic"), 20.0, 4.0),
    "8-bit state": (dict(state_dtype="8bit"), 16.0 + 16 / 256, 2.0 + 8 / 256),
}
_KW = dict(lr=1e-3, weight_decay=1e-2)


def _params(shapes) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen))
        p.grad = torch.randn(s, generator=gen) * 1e-3
        params.append(p)
    return params


def peers() -> dict:
    """label -> constructor(params) of the 8-bit AdamWs that import here (torchao, bitsandbytes)."""
    found = {}
    try:
        optim = importlib.import_module("torchao.optim")
        found["torchao AdamW8bit"] = lambda params: optim.AdamW8bit(params, **_KW)
    except Exception:  # not installed, or built for another torch  # noqa: BLE001
        pass
    try:
        bnb = importlib.import_module("bitsandbytes")
        found["bitsandbytes AdamW8bit"] = lambda params: bnb.optim.AdamW8bit(params, **_KW)
    except Exception:  # noqa: BLE001
        pass
    return found


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, or of the inner tensors of a wrapper subclass (torchao's OptimState8bit)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_nbytes(t) for st in opt.state.values() for k, t in st.items()
               if isinstance(t, torch.Tensor) and k != "step")


def bench(list_id: str, repeats: int, min_sample_s: float = 0.05) -> dict:

    label, make_shapes = PARAM_LISTS[list_id]
    shapes = make_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    a, b = torch.randn(numel), torch.randn(numel) * 1e-3
    optimizers = {name: AdamW(_params(shapes), fused=True, **_KW, **kw) for name, (kw, _, _) in VARIANTS.items()}
    for name, make in peers().items():
        try:
            optimizers[name] = make(_params(shapes))
            optimizers[name].step()
        except Exception as exc:  # a peer that does not run on the CPU  # noqa: BLE001
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
            optimizers.pop(name, None)
    steppers = {name: opt.step for name, opt in optimizers.items()}
    steppers["probe"] = lambda: a.add_(b)
    med = interleaved_medians(steppers, repeats, min_sample_s)
    base = med["fp32 state"]
    rows = []
    for name, opt in optimizers.items():
        moved = VARIANTS[name][1] if name in VARIANTS else None
        rows.append(dict(variant=name, ms=med[name] * 1e3, speedup_vs_fp32_state=base / med[name],
                         gb_per_s=moved * numel / med[name] / 1e9 if moved else None,
                         state_bytes_per_param=state_bytes(opt) / numel))
    return dict(params=label, numel=numel, probe_gb_per_s=12 * numel / med["probe"] / 1e9, rows=rows)


def markdown(results: list[dict], cpu: str = "") -> list[str]:
    lines = ["", "## AdamW with compact state (state_dtype)", "",
             "fp32 params; bytes moved per element: fp32 state 28, bf16 20, 8-bit ~16; "
             f"ratios against our fp32-state step of the same run. {cpu}", "",
             "| params | variant | ms | × vs fp32 state | GB/s | of probe | state B/param |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            gbs = f"{r['gb_per_s']:.1f}" if r["gb_per_s"] else "–"
            probe = f"{r['gb_per_s'] / res['probe_gb_per_s']:.2f}" if r["gb_per_s"] else "–"
            lines.append(f"| {res['params']} | {r['variant']} | {r['ms']:.1f} | {r['speedup_vs_fp32_state']:.2f} | "
                         f"{gbs} | {probe} | {r['state_bytes_per_param']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lists", nargs="+", default=list(LISTS), choices=LISTS)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    cpu = run_description(args.repeats)
    results = [bench(list_id, args.repeats) for list_id in args.lists]
    print("\n".join(markdown(results, cpu)))


if __name__ == "__main__":
    main()
