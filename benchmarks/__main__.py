"""``python -m benchmarks`` (``make bench``): ours vs torch.optim and timm on the CPU
(:mod:`benchmarks.optimizers`), or on a GPU with ``--device cuda`` (:mod:`benchmarks.cuda`);
writes JSON + markdown."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import cuda, optimizers


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


def run(args) -> int:
    module, lists = {"cpu": (optimizers, optimizers.PARAM_LISTS), "cuda": (cuda, cuda.LISTS)}[args.device]
    bad = [name for name in args.lists or () if name not in lists]
    if bad:
        print(f"python -m benchmarks: error: --lists {' '.join(bad)} is not a list for --device {args.device} "
              f"(choose from {', '.join(lists)})", file=sys.stderr)
        return 2
    try:
        json_path, md_path = module.run(Path(args.out), quick=args.quick, repeats=args.repeats, lists=args.lists)
    except cuda.NoGPUError as exc:
        print(f"python -m benchmarks: error: {exc}", file=sys.stderr)
        return 1
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="ours vs torch.optim, interleaved; "
                                     "writes JSON + markdown")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (default), or cuda: the GPU benchmark, timed with CUDA events")
    parser.add_argument("--quick", action="store_true", help="skip the largest list (and, on cpu, the build timing)")
    parser.add_argument("--repeats", type=_positive_int, default=None, help="rounds per case (default 11, quick 5)")
    parser.add_argument("--lists", nargs="+", choices=["1M", "25M", "100M", "1B"], default=None,
                        help="param lists to run: cpu 1M 25M 100M, cuda 1M 25M 100M 1B (default: all; quick: 1M 25M)")
    parser.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
