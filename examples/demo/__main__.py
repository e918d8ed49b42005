"""``python -m examples.demo`` (``make demo``): AdaScale vs a small-batch baseline and linear lr
scaling on digits; writes a table and a plot."""

from __future__ import annotations

import argparse
import sys

from examples.demo import run_demo


def run(args) -> int:
    try:
        run_demo(args.out, framework=args.framework, scales=tuple(args.scales), seed=args.seed, quick=args.quick,
                 lr=args.lr, state_dtype=args.state_dtype, force=args.force)
    except ValueError as exc:  # bad options: plan_runs / Setup name the parameter and the fix
        print(f"python -m examples.demo: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # an optional dependency missing: the message names the extra
        print(f"python -m examples.demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.demo", description="AdaScale vs a small-batch baseline "
                                     "and linear lr scaling on digits: table and plot")
    parser.add_argument("--quick", action="store_true", help="a 5× shorter budget (a smoke run)")
    parser.add_argument("--scales", nargs="+", type=int, default=[4, 8], metavar="S",
                        help="batch scales, each dividing the budget (default: 4 8; the smallest even one also runs "
                              "as 2-process DDP)")
    parser.add_argument("--framework", choices=["lightning", "mmengine"], default="lightning",
                        help="train through Lightning (default) or mmengine's Runner and configs")
    parser.add_argument("--seed", type=int, default=0, help="init and data order (default 0)")
    parser.add_argument("--lr", type=float, default=None, help="the baseline's lr (default 0.05; others scale it)")
    parser.add_argument("--state-dtype", choices=["bfloat16", "8bit"], default=None,
                        help="FusedSGD's momentum buffer in bf16 or 8-bit (default: fp32)")
    parser.add_argument("--out", default=None,
                        help="output directory (default: demo-results/FRAMEWORK, demo-results/FRAMEWORK-quick)")
    parser.add_argument("--force", action="store_true", help="replace the results an earlier run left in --out")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
