"""The cost of leaving unscaled grads after a scaled step (``scaler.step(opt)``) on the CPU.

Given GradScaler's ``grad_scale`` (other than 1), our kernels write ``g · (1/scale)`` back into
``p.grad`` in the pass that reads the grads (torch's fused optimizers do the same): one more
write of the grads per step, and no more reads. Unscaled steps (no scaler, or a scale of 1) do
not write. Variants, interleaved in one process with the fp32 ``a.add_(b)`` probe (medians over
``--repeats`` rounds, :func:`benchmarks.common.probe_medians`):

* ``unscaled``: ours without a scale;
* ``scaled``: ours with a scale, the grads written back in the kernel;
* ``unscaled + foreach``: ours without a scale, then ``torch._foreach_mul_(grads, 1/scale)``,
  what a separate unscaling pass would cost (GradScaler's ``unscale_`` reads the grads once more
  for its inf check on top);
* ``torch fused`` / ``torch fused, scaled``: torch's fused CPU optimizer (AdamW, SGD) without and
  with the scale, the same contract.

The scale alternates between 16 and 1/16 from step to step, so repeated write-backs neither
underflow the grads nor change their size. "bytes" counts what a step must move per element:
params, grads read and state read and written, plus the grads written by the scaled variants
(twice for the separate pass, which reads them again). "× unscaled" is a variant's time over
ours without the scale (the write-back's cost: ~ its extra bytes over the step's, where the step
is bandwidth-bound).

    python -m benchmarks.scaled_step [--optimizers adamw sgd] [--dtypes fp32 bf16] [--sizes 25M]
                                     [--threads 1 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import itertools
import torch

import fused_optim
from benchmarks.common import PARAM_LISTS, make_params, probe_medians, probe_row, run_description

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (ours, torch's fused counterpart, hyperparameters, state tensors per param)
OPTIMIZERS = {"adamw": (fused_optim.FusedAdam, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-2), 2),
              "sgd": (fused_optim.FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9), 1)}
SCALES = (16.0, 1.0 / 16.0)
VARIANTS = ("unscaled", "scaled", "unscaled + foreach", "torch fused", "torch fused, scaled")


def step_bytes(optimizer: str, dtype: torch.dtype, variant: str) -> int:
    """Bytes a step of ``variant`` must move per element: params read and written, grads read,
    each state tensor read and written (the params' dtype), and the grads' extra traffic."""
    size = torch.finfo(dtype).bits // 8
    moved = size * (3 + 2 * OPTIMIZERS[optimizer][3])
    extra = {"scaled": 1, "torch fused, scaled": 1, "unscaled + foreach": 2}.get(variant, 0)
    return moved + size * extra


class Stepper:
    """One variant: a call is one step of ``opt`` over its own params, whose ``grads`` a scaled
    variant unscales (alternating the scale, :data:`SCALES`), in the step or after it (``foreach``)."""

    def __init__(self, opt, params: list, scaled: bool, foreach: bool):
        self.opt, self.grads, self.scaled, self.foreach = opt, [p.grad for p in params], scaled, foreach
        self._scales = itertools.cycle([torch.tensor(s) for s in SCALES])
        self._found_inf = torch.tensor(0.0)

    def __call__(self) -> None:
        if self.scaled:  # what GradScaler.step sets on an optimizer with _step_supports_amp_scaling
            self.opt.grad_scale, self.opt.found_inf = next(self._scales), self._found_inf
        self.opt.step()
        if self.foreach:
            torch._foreach_mul_(self.grads, 1.0 / float(next(self._scales)))


def steppers(optimizer: str, shapes, dtype: torch.dtype) -> dict[str, Stepper]:
    """variant -> its Stepper, on params and grads of its own."""
    ours_cls, torch_cls, kw, _ = OPTIMIZERS[optimizer]
    made = {}
    for variant in VARIANTS:
        params = make_params(shapes, dtype)
        opt = torch_cls(params, fused=True, **kw) if variant.startswith("torch") else ours_cls(params, fused=True, **kw)
        made[variant] = Stepper(opt, params, scaled=variant in ("scaled", "torch fused, scaled"),
                                foreach="foreach" in variant)
    return made


def bench(optimizer: str, dtype_name: str, label: str, shapes, threads: int, repeats: int,
          min_sample_s: float = 0.05) -> list[dict]:
    """One row per variant: the interleaved medians on ``threads`` threads."""
    dtype = DTYPES[dtype_name]
    numel = sum(torch.Size(s).numel() for s in shapes)
    med, probe_gbs = probe_medians(lambda: steppers(optimizer, shapes, dtype), numel, threads, repeats, min_sample_s)
    rows = []
    for v in VARIANTS:
        moved = step_bytes(optimizer, dtype, v)
        rows.append(dict(optimizer=optimizer, dtype=dtype_name, params=label, threads=threads, bytes=moved,
                         **probe_row(v, med[v], moved, numel, probe_gbs), vs_unscaled=med[v] / med["unscaled"]))
    return rows


def markdown(rows: list[dict], cpu: str = "") -> list[str]:
    lines = ["", "## Scaled steps: the unscaled grads written back (CPU)", "",
             f"Probe fp32 `a.add_(b)`. {cpu}", "",
             "| optimizer | dtype | params | threads | variant | bytes | ms | GB/s | of probe | × unscaled |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['optimizer']} | {r['dtype']} | {r['params']} | {r['threads']} | {r['variant']} | "
                     f"{r['bytes']} | {r['ms']:.2f} | {r['gb_per_s']:.1f} | {r['fraction_of_probe']:.2f} | "
                     f"{r['vs_unscaled']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--sizes", nargs="+", default=["25M"], choices=list(PARAM_LISTS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = []
    for optimizer, dtype, size, threads in itertools.product(args.optimizers, args.dtypes, args.sizes, args.threads):
        label, shapes = PARAM_LISTS[size]
        rows += bench(optimizer, dtype, label, shapes(), threads, args.repeats)
    cpu = run_description(args.repeats)
    print("\n".join(markdown(rows, cpu)))


if __name__ == "__main__":
    main()
