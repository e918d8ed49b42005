"""The demo's runs through mmengine (``python -m examples.demo --framework mmengine``): each run is an
mmengine config of registered names (the digits dataset and model of ``configs/``, registered by
importing :mod:`examples.mmengine_digits`; ``FusedOptimWrapper`` or
``AdaScaleOptimWrapper``, iteration-based schedules stepped by ``UpdateParamSchedulerHook``, its τ
stop) trained by ``Runner.from_cfg``; the DDP run spawns 2 CPU processes, each initialised as
``torchrun`` would (``launcher='pytorch'``)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch
from mmengine.config import Config
from mmengine.dist import is_main_process
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.runner import Runner

from fused_optim.process_group import end_process_group
from mmengine_optim import prepare_cpu_ddp

from .. import mmengine_digits  # noqa: F401  (registers the digits dataset and model)
from .plan import Run, Setup
from .recorder import Recorder, load_result


class RecordingHook(Hook):
    """Feeds the demo's :class:`Recorder` (on rank 0) after every iteration that updated the
    params: the update count, and with AdaScale τ."""

    priority = "VERY_LOW"

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self.updates = 0

    def before_train(self, runner) -> None:
        if is_main_process():
            self.recorder.start(_net(runner))

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        wrapper = runner.optim_wrapper
        if not wrapper.should_update():
            return  # the iteration only accumulated
        self.updates += 1
        if is_main_process():
            tau = getattr(wrapper, "scale_invariant_iter", None)
            self.recorder.update(_net(runner), self.updates, tau, None if tau is None else wrapper.optimizer)

    def after_train(self, runner) -> None:
        if is_main_process():
            self.recorder.finish(_net(runner))


def config(run: Run, setup: Setup, work_dir: Path) -> Config:
    """The run as an mmengine config: iteration-based schedules count updates (τ with AdaScale,
    whose run also stops at τ = its target); ``max_iters`` counts micro-batches, drawn by an
    ``InfiniteSampler`` (mmengine pauses 2 s each time it restarts a finite dataloader)."""
    cosine = dict(type="CosineAnnealingLR", by_epoch=False, begin=run.warmup_steps, end=run.schedule_steps,
                  T_max=run.schedule_steps - run.warmup_steps)
    warmup = [dict(type="LinearLR", by_epoch=False, start_factor=1 / run.scale, begin=0, end=run.warmup_steps)]
    adascale = run.method == "adascale"
    return Config(dict(
        default_scope="mmengine",
        work_dir=str(work_dir),
        launcher="pytorch" if run.world_size > 1 else "none",
        model=dict(type="DigitsClassifier"),
        train_dataloader=dict(batch_size=run.batch_size, num_workers=0,
                              sampler=dict(type="InfiniteSampler", shuffle=True, seed=setup.seed),
                              collate_fn=dict(type="default_collate"),
                              dataset=dict(type="DigitsDataset", split="train")),
        train_cfg=dict(type="IterBasedTrainLoop", max_iters=run.max_steps * run.accumulate, val_interval=10 ** 9),
        optim_wrapper=dict(
            type="mmengine_optim.AdaScaleOptimWrapper" if adascale else "mmengine_optim.FusedOptimWrapper",
            accumulative_counts=run.accumulate,
            optimizer=dict(type="mmengine_optim.FusedSGD", lr=run.lr, **setup.optimizer_options())),
        param_scheduler=(warmup if run.warmup_steps else []) + [cosine],
        default_hooks=dict(
            param_scheduler=dict(type="mmengine_optim.UpdateParamSchedulerHook",
                                 max_scale_invariant_iters=run.tau_target),
            logger=None, checkpoint=None),  # the recorder logs; an AdaScale run saves at its τ stop
        env_cfg=dict(dist_cfg=dict(backend="gloo")),
        randomness=dict(seed=setup.seed),
        log_level="WARNING",
    ))


def train(run: Run, setup: Setup, out_dir: Path, title: str) -> dict:
    """Train ``run`` with mmengine's Runner; its result as :meth:`Recorder.finish` wrote it."""
    if run.world_size == 1:
        _train(run, setup, out_dir, title)
    else:
        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.spawn(_train_rank, args=(run, setup, out_dir, title, port), nprocs=run.world_size)
    return load_result(run, out_dir)


def _train(run: Run, setup: Setup, out_dir: Path, title: str) -> None:
    work_dir = Path(out_dir) / "mmengine" / run.name
    if int(os.environ.get("RANK", 0)) == 0:
        shutil.rmtree(work_dir, ignore_errors=True)  # the last demo's logs and checkpoints of this run
    cfg = config(run, setup, work_dir)
    prepare_cpu_ddp(cfg)
    runner = Runner.from_cfg(cfg)
    runner.register_hook(RecordingHook(Recorder(run, setup, out_dir, title)))  # an object: not in the dumped config
    runner.train()


def _train_rank(rank: int, run: Run, setup: Setup, out_dir: Path, title: str, port: int) -> None:
    """One DDP rank, with the environment ``torchrun`` gives (and its share of the cores)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(run.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // run.world_size))
    _train(run, setup, out_dir, title)
    end_process_group()  # its gloo threads end before Python does (see fused_optim.process_group)


def _net(runner) -> torch.nn.Module:
    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    return model.net
