"""``python -m benchmarks``: ours vs torch.optim's single-tensor / foreach / fused modes (SGD, AdamW),
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

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

import fused_optim
from benchmarks import adascale_overhead, master_weights, state_dtype
from benchmarks.common import (FUSED_ADAM, PARAM_LISTS, PEERS, QUICK_LISTS, TRAFFIC, Row, interleaved_medians,
                               make_params, table, time_calls, timm_optimizers, variants)

OPTIMIZERS = ("sgd", "adamw", "lamb", "lars", "norm")


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
    for name, make in variants(opt).items():
        p = torch.nn.Parameter(start.clone())
        step = make([p])
        for g in grads:
            p.grad = g.clone()
            step()
        moves[name] = p.detach().float() - start.float()
    single = moves.pop("torch single")
    bound = 0.5 * torch.linalg.vector_norm(single)
    return {name for name, move in moves.items() if torch.linalg.vector_norm(move - single) > bound}




def bench_case(opt: str, dtype: torch.dtype, list_id: str, repeats: int, min_sample_s: float = 0.02) -> list[Row]:
    label, make_shapes = PARAM_LISTS[list_id]
    shapes = make_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    timed = variants(opt)
    steppers = {}
    for name, make in timed.items():
        steppers[name] = make(make_params(shapes, dtype))
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
    med = interleaved_medians(steppers, repeats, min_sample_s)
    probe_gbs = probe_bytes * size * numel / med["probe"] / 1e9
    peer = min((p for p in PEERS[opt] if p in med), key=med.get, default=None)
    wrong = _step_disagreements(opt, dtype)
    rows = []
    for k in timed:
        gbs = TRAFFIC[opt] * size * numel / med[k] / 1e9
        rows.append(Row(opt, str(dtype).replace("torch.", ""), label, len(shapes), numel, k, med[k] * 1e3,
                        peer, med[peer] / med[k] if peer else None, gbs, gbs / probe_gbs, probe_gbs,
                        med[k] / med[FUSED_ADAM] if FUSED_ADAM in med else None, k in wrong))
    return rows


def host_overhead_us(opt: str, tensors: int = 2000, repeats: int = 15) -> dict[str, float]:
    """Step time per tensor on 1-element tensors: the cost that is not arithmetic."""
    out = {}
    for name in ("fused_optim", "torch fused"):
        step = variants(opt)[name](make_params([(1,)] * tensors, torch.float32))
        step()
        out[name] = statistics.median(time_calls(step, 5) for _ in range(repeats)) / tensors * 1e6
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




def markdown(rows: list[Row], host: dict, build: dict | None, timm: str | None = None,
             adascale: list[dict] | None = None) -> str:
    """``timm``: its version, or why it is unavailable (None: no LAMB / LARS rows to explain)."""
    by_opt = lambda *opts: [r for r in rows if r.optimizer in opts]  # noqa: E731
    lines = [
        f"{fused_optim.cpu_description()}; torch {torch.__version__}; medians of interleaved rounds.",
        "",
        *table(by_opt("sgd", "adamw"), "× vs torch fused"),
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
                  *table(by_opt("lamb", "lars"), "× vs peer", peer=True, adam=True)]
    if by_opt("norm"):
        lines += ["", "Global L2 norm of the grads: `multi_tensor_l2norm(grads)` vs "
                      "`torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))` (peer) and the bare "
                      "per-tensor `torch._foreach_norm(grads)`; of read probe: fraction of the GB/s of an int64 "
                      "`sum()` over the same bytes.", "",
                  *table(by_opt("norm"), "× vs peer", probe="of read probe", peer=True)]
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
    print(f"benchmarks on {fused_optim.cpu_description()}", flush=True)
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
                                     "threads": torch.get_num_threads(), "cpu": fused_optim.cpu_description()},
                                    indent=2))
    md_path.write_text(markdown(rows, host, build, timm, adascale) + "\n".join(master_weights.markdown(masters))
                       + "\n".join(state_dtype.markdown(compact)) + "\n")
    return json_path, md_path
