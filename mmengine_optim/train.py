"""Train from an mmengine config, OpenMMLab ``tools/train.py`` style::

    python -m mmengine_optim.train CONFIG [--work-dir DIR] [--resume [CHECKPOINT]]
                                   [--cfg-options KEY=VALUE ...] [--launcher {none,pytorch}]
    torchrun --nproc_per_node=2 -m mmengine_optim.train CONFIG --launcher pytorch

What it adds to mmengine 0.10's Runner:

* ``PortableCheckpointHook`` in ``custom_hooks`` (unless the config has it, or its old name
  ``WeightsOnlyCheckpointHook``): checkpoints that ``torch.load(weights_only=True)`` reads also
  where ``mmengine_optim`` is not imported (where it is, mmengine's own load too:
  :mod:`.checkpoint_globals`).
* DDP without CUDA (``--launcher pytorch`` on CPU): :func:`~mmengine_optim.prepare_cpu_ddp`.
* A config with a ``strategy`` (mmengine's ``FSDPStrategy``, ``DeepSpeedStrategy``, ...) runs in
  mmengine's ``FlexibleRunner``, the runner that takes one; FSDP on CPU as DDP above.
* A DDP rank destroys its process group once training is over on every rank, before its Python
  exits (:func:`fused_optim.process_group.end_process_group`).
"""

from __future__ import annotations

import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction
from mmengine.runner import FlexibleRunner, Runner

from fused_optim.process_group import end_process_group

from .cpu_ddp import prepare_cpu_ddp
from .hooks import PortableCheckpointHook  # importing the package registers the scope

_CHECKPOINT_HOOK = "mmengine_optim.PortableCheckpointHook"
# the names a config may give it (the old one included), scoped or bare
_CHECKPOINT_HOOK_NAMES = {f"{scope}{name}" for scope in ("", "mmengine_optim.")
                          for name in ("PortableCheckpointHook", "WeightsOnlyCheckpointHook")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mmengine_optim.train", description="Train a model from a config")
    parser.add_argument("config", help="the config file")
    parser.add_argument("--work-dir", help="where logs and checkpoints go (default ./work_dirs/<config name>)")
    parser.add_argument("--resume", nargs="?", const="auto", metavar="CHECKPOINT",
                        help="resume from CHECKPOINT, or without one from the latest in the work dir")
    parser.add_argument("--cfg-options", nargs="+", action=DictAction, metavar="KEY=VALUE",
                        help="override config keys, e.g. optim_wrapper.optimizer.lr=0.05 train_cfg.max_iters=100")
    parser.add_argument("--launcher", choices=["none", "pytorch"], default="none", help="job launcher")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return args


def build_config(args: argparse.Namespace) -> Config:
    """The config with the command line applied and the workarounds above."""
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    cfg.launcher = args.launcher
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get("work_dir") is None:
        cfg.work_dir = osp.join("./work_dirs", osp.splitext(osp.basename(args.config))[0])
    if args.resume == "auto":
        cfg.resume, cfg.load_from = True, None
    elif args.resume is not None:
        cfg.resume, cfg.load_from = True, args.resume
    hooks = list(cfg.get("custom_hooks") or [])
    if not any(isinstance(h, PortableCheckpointHook) or (isinstance(h, dict) and (
            h.get("type") is PortableCheckpointHook or h.get("type") in _CHECKPOINT_HOOK_NAMES)) for h in hooks):
        hooks.append(dict(type=_CHECKPOINT_HOOK))
    cfg.custom_hooks = hooks
    return cfg


def main(argv: list[str] | None = None) -> Runner | FlexibleRunner:
    args = parse_args(argv)
    cfg = build_config(args)
    prepare_cpu_ddp(cfg)
    runner = (FlexibleRunner if cfg.get("strategy") else Runner).from_cfg(cfg)
    runner.train()
    return runner


if __name__ == "__main__":
    main()
    end_process_group()  # a DDP rank's gloo threads end before Python does (see fused_optim.process_group)
