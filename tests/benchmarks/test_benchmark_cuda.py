"""The GPU benchmark (`make bench BENCH_ARGS="--device cuda"`): its lists, memory plan, tables and CLI
checks run anywhere; one test runs it for real and needs a CUDA GPU."""

import json
import math
import time

import pytest
import torch

from benchmarks import cuda as bc
from benchmarks.common import Row, timm_optimizers
from benchmarks.__main__ import main

GB = 10**9


@pytest.mark.parametrize("list_id, tensors, numel", [("1M", 200, 1_000_000), ("25M", 161, 25_557_032),
                                                     ("100M", 20, 100_000_000), ("1B", 20, 1_000_000_000)])
def test_lists_have_the_stated_sizes(list_id, tensors, numel):
    label, make = bc.LISTS[list_id]
    shapes = make()
    assert len(shapes) == tensors and sum(math.prod(s) for s in shapes) == numel
    assert f"{tensors} tensors" in label


def test_memory_estimates_at_1b():
    shapes = bc.LISTS["1B"][1]()
    f32, bf16 = torch.float32, torch.bfloat16
    # params + grads + state (+ temporaries), 4 bytes an element in fp32
    assert bc.memory_bytes("adamw", "fused_optim", shapes, f32) == 16 * GB
    assert bc.memory_bytes("adamw", "torch foreach", shapes, f32) == 20 * GB
    assert bc.memory_bytes("sgd", "torch fused", shapes, f32) == 12 * GB
    assert bc.memory_bytes("lamb", "timm foreach", shapes, f32) == 28 * GB
    assert bc.memory_bytes("lamb", "timm single", shapes, f32) == 16 * GB + 3 * 50_000_000 * 4
    assert bc.memory_bytes("adamw", "fused_optim", shapes, bf16) == 8 * GB
    # the copy probe's two buffers move TRAFFIC element sizes per param together
    assert bc.probe_bytes("adamw", 10**9, f32) == 14 * GB and bc.probe_bytes("sgd", 10**9, bf16) == 5 * GB


def test_plan_groups_by_free_memory():
    shapes, adamw = bc.LISTS["1B"][1](), ["fused_optim", "torch fused", "torch foreach"]
    # fp32: 52 GB of variants + 28 GB of probe do not fit in 90% of 80 GiB: one at a time
    assert bc.plan("adamw", adamw, shapes, torch.float32, 80 * 2**30) == ([[v] for v in adamw], {})
    assert bc.plan("adamw", adamw, shapes, torch.float32, 139 * 2**30) == ([adamw], {})
    assert bc.plan("adamw", adamw, shapes, torch.bfloat16, 80 * 2**30) == ([adamw], {})
    groups, skipped = bc.plan("adamw", adamw, shapes, torch.float32, 40 * 2**30)
    assert groups == [] and set(skipped) == set(adamw)
    assert skipped["torch foreach"] == "needs 18.6 GiB, 9.9 GiB left beside the probe"


class _HostEvent:
    """torch.cuda.Event stand-in: host clock."""

    def __init__(self, enable_timing):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """bench_case on the CPU: params and probe there, host-clock events, ``free`` bytes of memory."""
    monkeypatch.setattr(bc, "DEVICE", "cpu")
    monkeypatch.setattr(bc, "MIN_SAMPLE_S", 1e-3)
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setitem(bc.LISTS, "tiny", ("4 tensors / 4K", lambda: [(1000,)] * 4))
    free = {"bytes": 10**9}
    monkeypatch.setattr(bc, "_free_memory", lambda: free["bytes"])
    return free


def test_bench_case_interleaves_all_variants_when_they_fit(cpu_as_cuda):
    rows, record = bc.bench_case("lamb", torch.float32, "tiny", repeats=3)
    by = {r.variant: r for r in rows}
    peers = ("timm foreach", "timm single") if timm_optimizers()[0] else ()
    assert list(by) == ["fused_optim", *peers, "FusedAdam (AdamW)"]
    assert not record["one_at_a_time"] and record["skipped"] == {} and record["probe_bytes_moved"] == 7 * 4000 * 4
    assert record["copy_gb_per_s"] == rows[0].probe_gb_per_s > 0
    ours = by["fused_optim"]
    assert ours.numel == 4000 and ours.tensors == 4 and ours.params == "4 tensors / 4K"
    assert ours.gb_per_s == pytest.approx(7 * 4 * 4000 / ours.ms_per_step / 1e6)
    assert ours.fraction_of_probe == pytest.approx(ours.gb_per_s / ours.probe_gb_per_s)
    assert ours.time_vs_fused_adam == pytest.approx(ours.ms_per_step / by["FusedAdam (AdamW)"].ms_per_step)
    if peers:
        assert ours.speedup_vs_peer == pytest.approx(min(by[p].ms_per_step for p in peers) / ours.ms_per_step)


# 48 KB per SGD variant (params, grads, momentum; foreach: 64 KB with a temporary), 80 KB of probe:
# either all fit (and then the out-of-memory error splits the group) or one at a time does
@pytest.mark.parametrize("free", [10**9, (80_000 + 100_000) / bc.MEMORY_MARGIN])
def test_bench_case_runs_one_at_a_time_and_records_out_of_memory(free, cpu_as_cuda, monkeypatch):
    cpu_as_cuda["bytes"] = free
    real = bc.variants

    def variants(opt):
        out = real(opt)
        out["torch foreach"] = lambda ps: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory."))
        return out

    monkeypatch.setattr(bc, "variants", variants)
    rows, record = bc.bench_case("sgd", torch.float32, "tiny", repeats=2)
    assert record["one_at_a_time"] and record["skipped"] == {"torch foreach": "out of memory (CUDA out of memory.)"}
    assert [(r.variant, r.peer) for r in rows] == [("fused_optim", "torch fused"), ("torch fused", "torch fused")]
    cpu_as_cuda["bytes"] = (80_000 + 40_000) / bc.MEMORY_MARGIN  # not even one variant beside the probe
    rows, record = bc.bench_case("sgd", torch.float32, "tiny", repeats=2)
    assert rows == [] and set(record["skipped"]) == {"fused_optim", "torch fused", "torch foreach"}


def _row(opt, params, numel, variant, ms, peer, speedup, frac, dtype="float32", adam=None):
    return Row(opt, dtype, params, 200, numel, variant, ms, peer, speedup, 100.0 / ms, frac, 400.0, adam)


def test_markdown_tables_and_targets():
    one, big = "200 tensors / 1M", "20 tensors / 1B"
    rows = [
        _row("sgd", one, 10**6, "fused_optim", 0.1, "torch fused", 2.0, 0.5),
        _row("sgd", one, 10**6, "torch fused", 0.2, "torch fused", 1.0, 0.25),
        _row("adamw", big, 10**9, "fused_optim", 20.0, "torch fused", 0.95, 0.85, dtype="bfloat16"),
        _row("lamb", one, 10**6, "fused_optim", 0.5, "timm foreach", 6.0, 0.3, adam=1.25),
        _row("lamb", one, 10**6, "timm foreach", 3.0, "timm foreach", 1.0, 0.05, adam=7.5),
        _row("lars", big, 10**9, "fused_optim", 25.0, None, None, 0.92),
    ]
    records = [{"optimizer": "sgd", "dtype": "float32", "params": one, "probe_bytes_moved": 20 * 10**6,
                "copy_gb_per_s": 400.0, "one_at_a_time": False, "skipped": {}, "free_gib": 79.0},
               {"optimizer": "lars", "dtype": "float32", "params": big, "probe_bytes_moved": 20 * GB,
                "copy_gb_per_s": None, "one_at_a_time": True, "skipped": {"timm foreach": "needs 99.0 GiB"},
                "free_gib": 79.0}]
    md = bc.markdown(rows, records, "NVIDIA H100 80GB HBM3 (CUDA 12.8)", "1.0.31").splitlines()
    assert md[0].startswith("NVIDIA H100 80GB HBM3 (CUDA 12.8), torch ")
    assert md[2:6] == [
        "Targets (fused_optim rows):",
        "- ≥1.0× torch fused (SGD, AdamW): met in 1/2; worst 0.95× (adamw bfloat16 20 tensors / 1B)",
        "- ≥0.9 of the copy bandwidth at 25M and above: met in 1/2; worst 0.85 (adamw bfloat16 20 tensors / 1B)",
        "- ≥5× the faster timm mode (LAMB, LARS): met in 1/1, 1 without a peer; worst 6.00× "
        "(lamb float32 200 tensors / 1M)",
    ]
    assert "| optimizer | dtype | params | variant | ms/step | × vs torch fused | GB/s | of copy |" in md
    assert "| sgd | float32 | 200 tensors / 1M | fused_optim | 0.100 | 2.00 | 1000.0 | 0.50 |" in md
    assert "| adamw | bfloat16 | 20 tensors / 1B | fused_optim | 20.000 | 0.95 | 5.0 | 0.85 |" in md
    assert ("| optimizer | dtype | params | variant | ms/step | peer | × vs peer | time / FusedAdam | GB/s | of copy |"
            in md)
    assert ("| lamb | float32 | 200 tensors / 1M | fused_optim | 0.500 | timm foreach | 6.00 | 1.25 | 200.0 | 0.30 |"
            in md)
    assert "| lars | float32 | 20 tensors / 1B | fused_optim | 25.000 | n/a | n/a | n/a | 4.0 | 0.92 |" in md
    assert "| 200 tensors / 1M | float32 | sgd | 20.0 | 400 |" in md
    assert "| 20 tensors / 1B | float32 | lars | 20000.0 | n/a |" in md
    assert "lars float32 20 tensors / 1B: **timm foreach skipped**: needs 99.0 GiB." in md
    assert any(line.startswith("lars float32 20 tensors / 1B: variants run one at a time") for line in md)


def test_run_without_gpu_raises_before_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^python -m benchmarks --device cuda needs a CUDA GPU: "
                                           r"torch.cuda.is_available\(\) is False$"):
        bc.run(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_without_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--device", "cuda", "--quick", "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"python -m benchmarks: error: {bc.NO_GPU}\n"
    assert not (tmp_path / "out").exists()


def test_cli_rejects_a_list_of_the_other_device(tmp_path, capsys):
    """1B is the GPU's list only (every list of the CPU benchmark is the GPU's too)."""
    assert main(["--device", "cpu", "--lists", "1B", "--out", str(tmp_path)]) == 2
    message = "--lists 1B is not a list for --device cpu (choose from 1M, 25M, 100M)"
    assert capsys.readouterr().err == f"python -m benchmarks: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_an_unknown_device(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "gpu"])
    assert exit_.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_run_on_the_gpu(tmp_path):
    json_path, md_path = bc.run(tmp_path, quick=True, lists=["1M"])
    data = json.loads(json_path.read_text())
    variants = {(r["optimizer"], r["dtype"], r["variant"]) for r in data["rows"]}
    for dtype in ("float32", "bfloat16"):
        for opt in bc.OPTIMIZERS:
            assert (opt, dtype, "fused_optim") in variants
        assert {("sgd", dtype, "torch fused"), ("sgd", dtype, "torch foreach"), ("adamw", dtype, "torch fused"),
                ("adamw", dtype, "torch foreach"), ("lamb", dtype, "FusedAdam (AdamW)")} <= variants
        if data["timm"]:
            assert {("lamb", dtype, "timm foreach"), ("lars", dtype, "timm single")} <= variants
    assert all(r["ms_per_step"] > 0 and r["fraction_of_probe"] > 0 and r["probe_gb_per_s"] > 0 for r in data["rows"])
    ours = [r for r in data["rows"] if r["variant"] == "fused_optim" and r["optimizer"] in ("sgd", "adamw")]
    assert len(ours) == 4 and all(r["peer"] == "torch fused" and r["speedup_vs_peer"] > 0 for r in ours)
    assert len(data["cases"]) == 8 and not any(c["skipped"] or c["one_at_a_time"] for c in data["cases"])
    md = md_path.read_text()
    assert "| sgd | float32 | 200 tensors / 1M | fused_optim |" in md and "Targets (fused_optim rows):" in md
