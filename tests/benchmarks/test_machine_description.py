"""Benchmark output names the machine it measured: the CPU model and ATen's CPU capability."""

import torch

from fused_optim import _build
from benchmarks import cuda as bench_cuda, optimizers as bench

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f
"""


def test_the_cpu_description_names_the_model_and_the_aten_capability(monkeypatch, tmp_path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    monkeypatch.setattr(_build, "CPUINFO", tmp_path / "cpuinfo")
    capability = torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512
    assert _build.cpu_description() == (f"Intel(R) Xeon(R) Platinum 8480+, ATen CPU capability {capability}, "
                                        f"{torch.get_num_threads()} threads")
    monkeypatch.setattr(_build, "CPUINFO", tmp_path / "missing")
    # (platform.processor() runs `uname -p` on its first call: a process this fast test must not start)
    monkeypatch.setattr(_build.platform, "processor", lambda: "x86_64")
    assert _build.cpu_description().startswith(f"x86_64, ATen CPU capability {capability}")  # no /proc


def test_the_benchmark_headers_name_the_machine():
    """bench.md (printed by `python -m benchmarks` too) and bench_cuda.md start with the description."""
    machine = _build.cpu_description()
    assert machine in bench.markdown([], {}, None).splitlines()[0]
    assert f"host CPU {machine}" in bench_cuda.markdown([], [], "NVIDIA H100 (CUDA 12.8)", None).splitlines()[0]
