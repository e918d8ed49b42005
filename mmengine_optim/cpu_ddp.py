"""DDP without CUDA for a user's own training script: ``Runner.from_cfg`` under ``torchrun`` on CPU.

mmengine 0.10's ``init_dist`` (run by the Runner for ``launcher='pytorch'``) calls
``torch.cuda.set_device`` and fails without CUDA (``module 'torch._C' has no attribute
'_cuda_setDevice'``), and its default model wrapper passes ``device_ids=[LOCAL_RANK]``, which a
CPU module refuses. :func:`prepare_cpu_ddp` sets up both before the Runner is built::

    from mmengine.config import Config
    from mmengine.runner import Runner
    from fused_optim.process_group import end_process_group
    from mmengine_optim import prepare_cpu_ddp

    cfg = Config.fromfile('my_config.py')
    cfg.launcher = 'pytorch'
    runner = Runner.from_cfg(prepare_cpu_ddp(cfg))
    runner.train()
    end_process_group()  # before Python exits (see fused_optim.process_group)

run with ``torchrun --nproc_per_node=2 my_train.py``.

mmengine's ``FSDPStrategy`` (``FlexibleRunner``, FSDP1) needs the same process group and, in its
model wrapper, ``device_id='cpu'``: it passes ``device_id=LOCAL_RANK``, which torch's
``FullyShardedDataParallel`` takes for an accelerator's index and refuses without one
(``RuntimeError: Cannot access accelerator device when none is available.``).
:func:`prepare_cpu_ddp` sets that too, for a config with ``strategy=dict(type='FSDPStrategy')``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mmengine.registry import STRATEGIES

from fused_optim.process_group import init_process_group


def prepare_cpu_ddp(cfg):
    """For a config (``mmengine.Config`` or dict) whose ``launcher`` is not ``'none'``, on a machine
    without CUDA: the model wrapper without ``device_ids`` (unless the config has its own
    ``model_wrapper_cfg``), an ``FSDPStrategy``'s wrapper with ``device_id='cpu'`` (unless it
    names its own) and the gloo process group from the launcher's environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so the Runner finds the group
    initialised and skips mmengine's CUDA-only ``init_dist``. Nothing otherwise (with CUDA,
    mmengine's own path is used). Returns ``cfg``, changed in place."""
    if cfg.get("launcher", "none") == "none" or torch.cuda.is_available():
        return cfg
    if cfg.get("model_wrapper_cfg") is None:
        cfg["model_wrapper_cfg"] = dict(type="MMDistributedDataParallel", device_ids=None, broadcast_buffers=False,
                                        find_unused_parameters=cfg.get("find_unused_parameters", False))
    strategy = cfg.get("strategy")
    if strategy is not None and _is_fsdp(strategy.get("type")):
        if strategy.get("model_wrapper") is None:
            strategy["model_wrapper"] = dict(type="MMFullyShardedDataParallel")
        strategy["model_wrapper"].setdefault("device_id", "cpu")
    if not dist.is_initialized():
        init_process_group("gloo")
    return cfg


def _is_fsdp(strategy_type) -> bool:
    """Whether a config's ``strategy.type`` (a registered name or a class) is mmengine's
    ``FSDPStrategy`` or a subclass."""
    cls = STRATEGIES.get(strategy_type) if isinstance(strategy_type, str) else strategy_type
    return isinstance(cls, type) and issubclass(cls, STRATEGIES.get("FSDPStrategy"))
