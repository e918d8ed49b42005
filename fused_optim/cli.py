"""The ``fused-optim`` command: ``info``, ``build``, ``bench``, ``demo``, ``list``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from . import _build


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 rounds would report no time, a negative count fails only
    after the cases are set up)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return value


def cmd_info(args) -> int:
    """Versions, the CPU, and the kernels' build state, read from the cache: builds nothing."""
    print(f"fused_optim      {__import__('fused_optim').__version__}")
    print(f"torch            {torch.__version__}")
    print(f"CPU              {_build.cpu_description()}  (extension {_build.extension_name()})")
    print(f"CUDA             {'available: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}")
    kernels = [("CPU kernels", _build.extension_name())]
    if torch.cuda.is_available():
        kernels.append(("CUDA kernels", _build.cuda_extension_name()))
    problems = []
    for label, name in kernels:
        state, problem = _build.cached_state(name)
        hint = "  (run `fused-optim build`)" if state == "not built yet" else ""
        print(f"{label:<17}{state}  ({_build.extension_directory(name)}){hint}")
        if problem is not None and problem not in problems:
            problems.append(problem)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


def cmd_build(args) -> int:
    """The CPU kernels, and the CUDA kernels too where torch sees a GPU or with ``--cuda`` (then
    checked to register every CUDA op; see ``_build.check_cuda_build``)."""
    start = time.perf_counter()
    try:
        _build.load("cpu")
        print(f"CPU kernels ready in {time.perf_counter() - start:.1f} s ({_build.build_directory()})")
        if not (args.cuda or torch.cuda.is_available()):
            return 0
        start = time.perf_counter()
        missing = _build.check_cuda_build()
    except _build.BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    where = _build.build_directory(_build.cuda_extension_name())
    if missing:
        print(f"fused-optim build: error: the CUDA library in {where} registers no CUDA kernel for "
              f"{', '.join(missing)}: add them to the TORCH_LIBRARY_IMPL(fused_optim, CUDA, m) block of "
              "csrc/cuda/binding.cpp", file=sys.stderr)
        return 1
    print(f"CUDA kernels ready in {time.perf_counter() - start:.1f} s, for architectures {_build.cuda_archs()}, "
          f"{len(_build.CUDA_OPS)} ops registered for CUDA ({where})")
    return 0


def cmd_bench(args) -> int:
    from .bench import cuda, optimizers

    module, lists = {"cpu": (optimizers, optimizers.PARAM_LISTS), "cuda": (cuda, cuda.LISTS)}[args.device]
    bad = [name for name in args.lists or () if name not in lists]
    if bad:
        print(f"fused-optim bench: error: --lists {' '.join(bad)} is not a list for --device {args.device} "
              f"(choose from {', '.join(lists)})", file=sys.stderr)
        return 2
    try:
        json_path, md_path = module.run(Path(args.out), quick=args.quick, repeats=args.repeats, lists=args.lists)
    except cuda.NoGPUError as exc:
        print(f"fused-optim bench: error: {exc}", file=sys.stderr)
        return 1
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


def cmd_demo(args) -> int:
    from .examples.demo import run_demo  # the one import of the examples: the command that runs them

    try:
        run_demo(args.out, framework=args.framework, scales=tuple(args.scales), seed=args.seed, quick=args.quick,
                 lr=args.lr, state_dtype=args.state_dtype)
    except ValueError as exc:  # bad options: plan_runs / Setup name the parameter and the fix
        print(f"fused-optim demo: error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_list(args) -> int:
    """The registry's names (``create_optimizer(name, params, ...)``), with what each is."""
    from .registry import get_spec, list_distributed_optimizers, list_optimizers

    for title, names in (("optimizers", list_optimizers()),
                         ("distributed optimizers (torch.distributed; docs/distributed.md)",
                          list_distributed_optimizers())):
        print(f"{title}:")
        for name in names:
            print(f"  {name:<28} {get_spec(name).description}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fused-optim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="build status, CPU ISA, threads, CUDA").set_defaults(fn=cmd_info)
    build = sub.add_parser("build", help="build (or load from cache) the kernels, with timing")
    build.add_argument("--cuda", action="store_true",
                       help="build the CUDA kernels even where torch sees no GPU (needs a CUDA build of torch and nvcc;"
                            f" for TORCH_CUDA_ARCH_LIST, default {_build.CHECK_CUDA_ARCH_LIST}) and check that every "
                            "CUDA op is registered")
    build.set_defaults(fn=cmd_build)
    bench = sub.add_parser("bench", help="ours vs torch.optim, interleaved; writes JSON + markdown")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="cpu (default), or cuda: the GPU benchmark, timed with CUDA events")
    bench.add_argument("--quick", action="store_true", help="skip the largest list (and, on cpu, the build timing)")
    bench.add_argument("--repeats", type=_positive_int, default=None, help="rounds per case (default 11, quick 5)")
    bench.add_argument("--lists", nargs="+", choices=["1M", "25M", "100M", "1B"], default=None,
                       help="param lists to run: cpu 1M 25M 100M, cuda 1M 25M 1B (default: all; quick: 1M 25M)")
    bench.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    bench.set_defaults(fn=cmd_bench)
    demo = sub.add_parser("demo", help="AdaScale vs a small-batch baseline and linear lr scaling on digits: "
                                       "table and plot")
    demo.add_argument("--quick", action="store_true", help="a 5× shorter budget (a smoke run)")
    demo.add_argument("--scales", nargs="+", type=int, default=[4, 8], metavar="S",
                      help="batch scales, each dividing the budget (default: 4 8; the smallest even one also runs "
                           "as 2-process DDP)")
    demo.add_argument("--framework", choices=["lightning", "mmengine"], default="lightning",
                      help="train through Lightning (default) or mmengine's Runner and configs")
    demo.add_argument("--seed", type=int, default=0, help="init and data order (default 0)")
    demo.add_argument("--lr", type=float, default=None, help="the baseline's lr (default 0.05; others scale it)")
    demo.add_argument("--state-dtype", choices=["bfloat16", "8bit"], default=None,
                      help="FusedSGD's momentum buffer in bf16 or 8-bit (default: fp32)")
    demo.add_argument("--out", default="demo-results", help="output directory (default: demo-results)")
    demo.set_defaults(fn=cmd_demo)
    sub.add_parser("list", help="the optimizers' registry names").set_defaults(fn=cmd_list)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
