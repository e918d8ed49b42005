"""The ``fused-optim`` command: ``info``, ``build``, ``list``. The benchmarks and the demo are in
the repository, apart from the library: ``make bench`` and ``make demo`` (``python -m benchmarks``,
``python -m examples.demo``)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import _build
from .registry import get_spec, list_distributed_optimizers, list_optimizers


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


def cmd_list(args) -> int:
    """The registry's names (``create_optimizer(name, params, ...)``), with what each is."""
    for title, names in (("optimizers", list_optimizers()),
                         ("distributed optimizers (torch.distributed; docs/distributed.md)",
                          list_distributed_optimizers())):
        print(f"{title}:")
        for name in names:
            print(f"  {name:<28} {get_spec(name).description}")
    return 0


DESCRIPTION = ("fused_optim's kernels and registry. The benchmarks and the demo live in the repository, "
               "not the package: from a clone, `make bench` and `make demo`.")
COMMANDS = {
    "info": "show the versions, the CPU's ISA, the CUDA device, and whether the kernels are built and where",
    "build": "build the kernels now (or load them from the cache), with the time it took",
    "list": "list the optimizers' registry names (create_optimizer(name, params, ...)), with what each is",
}


def main(argv: list[str] | None = None) -> int:
    """Runs a command; without one, prints the help (exit status 0)."""
    parser = argparse.ArgumentParser(prog="fused-optim", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="{info,build,list}")
    parsers = {name: sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
               for name, text in COMMANDS.items()}
    parsers["info"].set_defaults(fn=cmd_info)
    build = parsers["build"]
    build.add_argument("--cuda", action="store_true",
                       help="build the CUDA kernels even where torch sees no GPU (needs a CUDA build of torch and nvcc;"
                            f" for TORCH_CUDA_ARCH_LIST, default {_build.CHECK_CUDA_ARCH_LIST}) and check that every "
                            "CUDA op is registered")
    build.set_defaults(fn=cmd_build)
    parsers["list"].set_defaults(fn=cmd_list)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
