"""bf16 params with fp32 master weights: ours (``master_weights=True``: one pass reads the bf16
grad, updates the fp32 master and state, writes the bf16 param) vs the best torch way to do the
same: the bf16 grads copied into fp32 grads of fp32 masters, torch's fused AdamW / SGD on the
masters, the masters copied into the bf16 params (``torch._foreach_copy_`` both ways).

Bytes per element one pass must move (ours): SGD r g(2) + r/w master(8) + r/w buffer(8) + w p(2)
= 20; AdamW 20 + r/w v(8) = 28. The probe is fp32 ``a.add_(b)`` (12 bytes per element), timed in
the same rounds; "of probe" is our bandwidth over its. Interleaved rounds, medians, as
:mod:`.optimizers`."""

from __future__ import annotations

import torch

from benchmarks.common import PARAM_LISTS, interleaved_medians
from fused_optim import FusedAdam, FusedSGD

BYTES = {"sgd": 20, "adamw": 28}
LISTS = ("25M", "100M")
_KW = {"sgd": dict(lr=1e-3, momentum=0.9, weight_decay=1e-4), "adamw": dict(lr=1e-3, weight_decay=1e-2)}


def _bf16_params(shapes) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16())
        p.grad = (torch.randn(s, generator=gen) * 1e-3).bfloat16()
        params.append(p)
    return params


def _ours(opt: str, shapes):
    cls = FusedSGD if opt == "sgd" else FusedAdam
    return cls(_bf16_params(shapes), master_weights=True, fused=True, **_KW[opt]).step


def _torch(opt: str, shapes):
    params = _bf16_params(shapes)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    for m in masters:
        m.grad = torch.empty_like(m)
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.AdamW
    inner = cls(masters, fused=True, **_KW[opt])
    grads, master_grads = [p.grad for p in params], [m.grad for m in masters]

    def step():
        torch._foreach_copy_(master_grads, grads)
        inner.step()
        torch._foreach_copy_([p.data for p in params], masters)
    return step


def bench(opt: str, list_id: str, repeats: int, min_sample_s: float = 0.05) -> dict:

    label, make_shapes = PARAM_LISTS[list_id]
    shapes = make_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    a, b = torch.randn(numel), torch.randn(numel) * 1e-3
    steppers = {"fused_optim master_weights": _ours(opt, shapes), "torch fused on fp32 masters + copies":
                _torch(opt, shapes), "probe": lambda: a.add_(b)}
    med = interleaved_medians(steppers, repeats, min_sample_s)
    ours, theirs = med["fused_optim master_weights"], med["torch fused on fp32 masters + copies"]
    gbs, probe_gbs = BYTES[opt] * numel / ours / 1e9, 12 * numel / med["probe"] / 1e9
    return dict(opt=opt, params=label, numel=numel, ours_ms=ours * 1e3, torch_ms=theirs * 1e3,
                speedup=theirs / ours, gb_per_s=gbs, probe_gb_per_s=probe_gbs, fraction_of_probe=gbs / probe_gbs)


def markdown(results: list[dict]) -> list[str]:
    lines = ["", "## bf16 params with fp32 master weights", "",
             "Ours (`master_weights=True`, one pass) vs torch fused on fp32 masters plus the two copies; "
             "bytes: SGD 20, AdamW 28 per element; probe: fp32 `a.add_(b)`.", "",
             "| optimizer | params | ours ms | torch ms | × vs torch | GB/s | of probe |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['opt']} | {r['params']} | {r['ours_ms']:.2f} | {r['torch_ms']:.2f} | "
                     f"{r['speedup']:.2f} | {r['gb_per_s']:.1f} | {r['fraction_of_probe']:.2f} |")
    return lines
