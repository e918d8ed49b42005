"""The small GPU programs ``tools/check_gpu.py`` runs, one per subcommand, each printing what it did
and exiting non-zero on a mismatch:

- ``build``: imports fused_optim (the copy ``check_gpu.py`` installed) and builds the CPU kernels,
  then the CUDA library (``--emulated``: the CUDA code compiled for the CPU), printing each build's
  wall time (the first build's, on a machine whose cache is empty).
- ``one-step``: one fused step of every registered optimizer (fp32, bf16 with fp32 master weights,
  and FusedAdam with bf16 and 8-bit state, and bf16 params with fp32 state) and one
  ``multi_tensor_l2norm``, at small sizes: the program ``compute-sanitizer`` runs under ``--tool
  memcheck`` and ``--tool racecheck``.
- ``compile``: ``torch.compile(step, fullgraph=True)`` of FusedSGD and FusedAdam steps on the GPU
  equals eager steps of a twin (3 steps; fp32, one kernel each way: tolerance a few ulps).
- ``errors``: a C++ error raised in an op's kernel reaches Python as a RuntimeError: first that of
  a minimal extension built here with torch's own flags (not on ``--emulated``: its build would
  cost the dry run half a minute), then fused_optim's CPU kernels' and its CUDA library's. Where
  the first one crashes the interpreter, the machine's toolchain, not fused_optim, is at fault.

``--emulated``: CPU tensors sent through the CUDA code by ``fused_optim.testing.emulated_cuda()``
(the dry run on a machine without a GPU; ``compile`` then uses dynamo's ``eager`` backend, which
traces the step as on a GPU without generating code).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

import fused_optim
from fused_optim import _build
from fused_optim.registry import create_optimizer, list_optimizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from utils import compiled_step_matches_eager, optimizer_kwargs  # noqa: E402  (as the tests step)

SIZES = (33, 4097)  # a partial vector and a partial block of 512 threads


def _where(emulated: bool) -> tuple[torch.device, type[contextlib.AbstractContextManager]]:
    """The params' device and the context (a factory: one per use) that sends steps to the CUDA code."""
    if emulated:
        return torch.device("cpu"), fused_optim.testing.emulated_cuda
    return torch.device("cuda"), contextlib.nullcontext


def build(emulated: bool) -> None:
    print(f"fused_optim {fused_optim.__version__} from {Path(fused_optim.__file__).parent}; torch {torch.__version__}")
    if not emulated:
        print(f"GPU: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    start = time.perf_counter()
    _build.load("cpu")
    print(f"CPU kernels ready in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    if emulated:
        _build.load_emulated_cuda()
        print(f"emulated CUDA library ready in {time.perf_counter() - start:.1f} s")
        return
    missing = _build.check_cuda_build()
    if missing:
        sys.exit(f"the CUDA library registers no CUDA kernel for {', '.join(missing)}")
    print(f"CUDA library ready in {time.perf_counter() - start:.1f} s, for architectures {_build.cuda_archs()} "
          f"({_build.build_directory(_build.cuda_extension_name())})")


def _one_step(name: str, device: torch.device, dtype: torch.dtype, **extra) -> None:
    params = [torch.nn.Parameter(torch.randn(n, device=device).to(dtype)) for n in SIZES]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = create_optimizer(name, params, fused=True, **optimizer_kwargs(name), **extra)
    opt.step()
    if not all(torch.isfinite(p.float()).all() for p in params):
        sys.exit(f"{name} {dtype} {extra}: a non-finite param after one step")


def one_step(emulated: bool) -> None:
    device, context = _where(emulated)
    with context():
        for name in list_optimizers():
            _one_step(name, device, torch.float32)
            _one_step(name, device, torch.bfloat16, master_weights=True)
            print(f"{name}: fp32, bf16 + fp32 masters", flush=True)
        for state_dtype in ("bfloat16", "8bit"):
            _one_step("adam", device, torch.float32, state_dtype=state_dtype)
            print(f"adam: state_dtype {state_dtype}", flush=True)
        _one_step("adam", device, torch.bfloat16, state_dtype="float32")
        print("adam: bf16 params, state_dtype float32", flush=True)
        norm = fused_optim.multi_tensor_l2norm([torch.ones(n, device=device) for n in SIZES])
    expected = sum(SIZES) ** 0.5
    if abs(float(norm) - expected) > 1e-5 * expected:  # fp32 sum of ones: exact up to 2**24
        sys.exit(f"multi_tensor_l2norm of ones: {float(norm)}, expected {expected}")
    print("multi_tensor_l2norm: ok")


def compiled(emulated: bool) -> None:
    device, context = _where(emulated)
    backend = "eager" if emulated else "inductor"
    for cls, kw in ((fused_optim.FusedSGD, dict(lr=0.1, momentum=0.9)),
                    (fused_optim.FusedAdam, dict(lr=0.1, weight_decay=0.1))):
        params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in SIZES]
        compiled_step_matches_eager(cls, kw, params, backend, context)
        print(f"{cls.__name__}: torch.compile(fullgraph=True, backend={backend}) == eager over 3 steps")


_PROBE = """#include <ATen/ATen.h>
#include <torch/library.h>
void fails(const at::Tensor& t) { TORCH_CHECK(false, "refused a tensor of shape ", t.sizes()); }
TORCH_LIBRARY(fused_optim_error_probe, m) { m.def("fails(Tensor t) -> ()", &fails); }
"""


def _raises(what: str, call, message: str) -> None:
    print(f"{what}: calling", flush=True)  # the last line printed where a crash ends the program
    try:
        call()
    except RuntimeError as e:
        if message not in str(e):
            sys.exit(f"{what}: raised {str(e).splitlines()[0]!r}, not one saying {message!r}")
        print(f"{what}: raised RuntimeError", flush=True)
        return
    sys.exit(f"{what}: did not raise")


def errors(emulated: bool) -> None:
    if not emulated:
        from torch.utils.cpp_extension import load_inline

        load_inline("fused_optim_error_probe", cpp_sources=_PROBE, is_python_module=False)
        _raises("a minimal extension's TORCH_CHECK", lambda: torch.ops.fused_optim_error_probe.fails(torch.zeros(2)),
                "refused a tensor of shape [2]")
    device, context = _where(emulated)
    floats = torch.zeros(1)  # sums must be float64
    _raises("fused_optim's CPU kernels", lambda: fused_optim.sum_squares_(floats, [torch.ones(3)], [0], fused=True),
            "sums must be a contiguous 1-D float64")
    with context():
        _raises("fused_optim's CUDA library" + (" (emulated)" if emulated else ""),
                lambda: fused_optim.sum_squares_(floats.to(device), [torch.ones(3, device=device)], [0], fused=True),
                "sums must be a contiguous 1-D float64")


COMMANDS = {"build": build, "errors": errors, "one-step": one_step, "compile": compiled}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tools/gpu_steps.py", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=list(COMMANDS))
    parser.add_argument("--emulated", action="store_true", help="CPU tensors through the CUDA emulation")
    args = parser.parse_args(argv)
    COMMANDS[args.command](args.emulated)


if __name__ == "__main__":
    main()
