"""The distributed optimizers through ``torchrun -m mmengine_optim.train --launcher pytorch`` on 2
CPU ranks (configs/digits_centralized_sgd.py): the model is not wrapped in DDP, the optimizer
communicates; and every distributed name builds through mmengine's optimizer constructor."""

from pathlib import Path

from mmengine.optim import build_optim_wrapper
import pytest
import torch

import mmengine_optim  # noqa: F401  (registers the names)
from fused_optim import distributed as fd
from processes import torchrun_mmengine

ROOT = Path(__file__).resolve().parent.parent

RANK_DUMP = '''
import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class RankDumpHook(Hook):
    """Each rank writes its params, model wrapper and optimizer class at the end of training."""

    def after_train(self, runner):
        torch.save(dict(params=[p.detach().clone() for p in runner.model.parameters()], iters=runner.iter,
                        wrapper=type(runner.model).__name__, optimizer=type(runner.optim_wrapper.optimizer).__name__),
                   f"{runner.work_dir}/rank{dist.get_rank()}.pt")
'''


def train(tmp_path: Path, optimizer: str) -> list[dict]:
    """6 iterations of configs/digits_centralized_sgd.py with ``optimizer`` (config keywords) on 2
    ranks; each rank's dump."""
    (tmp_path / "rank_dump.py").write_text(RANK_DUMP)
    (tmp_path / "run.py").write_text(
        f"_base_ = [{str(ROOT / 'configs' / 'digits_centralized_sgd.py')!r}]\n"
        "custom_imports = dict(imports=['fused_optim.examples.mmengine_digits', 'rank_dump'],\n"
        "                      allow_failed_imports=False)\n"
        "custom_hooks = [dict(type='mmengine_optim.WeightsOnlyCheckpointHook'), dict(type='RankDumpHook')]\n"
        f"optim_wrapper = dict(optimizer=dict(_delete_=True, {optimizer}))\n"
        "train_cfg = dict(max_iters=6, val_interval=1000)\n"
        "default_hooks = dict(logger=dict(interval=3))\n")
    torchrun_mmengine(tmp_path / "run.py", tmp_path / "work", tmp_path)
    return [torch.load(tmp_path / "work" / f"rank{r}.pt") for r in (0, 1)]


def test_two_ranks_train_without_ddp(tmp_path):
    """The config's optimizer and model wrapper are built by name; averaged grads keep the two
    ranks' models identical although their batches differ (there is no DDP to do it). One run
    (~20 s): every name's construction is checked in one process below."""
    cls = "CentralizedSGD"
    ranks = train(tmp_path, "type='mmengine_optim.CentralizedSGD', lr=0.1, momentum=0.9")
    assert [r["iters"] for r in ranks] == [6, 6]
    assert {r["wrapper"] for r in ranks} == {"OptimizerSyncedModel"}
    assert {r["optimizer"] for r in ranks} == {cls}
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_names_build_the_distributed_optimizers_in_one_process():
    """Through mmengine's optimizer constructor (which fills each name's first parameter with the
    model's params), without a process group (world size 1), each name builds its class."""
    model = torch.nn.Linear(3, 2)
    lr = dict(lr=0.1)
    extras = {"CentralizedSGD": lr, "CentralizedAdam": lr, "PowerSGD": lr, "DecentralizedSGD": lr,
              "CentralizedSparsifiedSGD": lr,
              "CustomCentralizedOptimizer": {"optimizer": dict(type="mmengine_optim.adamw")}}
    built = {name: build_optim_wrapper(model, dict(type="OptimWrapper", optimizer=dict(
        type=f"mmengine_optim.{name}", **extra))).optimizer for name, extra in extras.items()}
    assert {name: type(opt) for name, opt in built.items()} == {name: getattr(fd, name) for name in built}
    assert type(built["CustomCentralizedOptimizer"].optimizer).__name__ == "AdamW"
    with pytest.raises(ValueError, match=r"param groups .* are not supported"):
        build_optim_wrapper(model, dict(type="OptimWrapper", paramwise_cfg=dict(bias_lr_mult=2.0),
                                        optimizer=dict(type="mmengine_optim.CentralizedSGD", lr=0.1)))
