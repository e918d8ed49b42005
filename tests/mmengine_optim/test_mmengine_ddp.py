"""2-process CPU DDP through ``torchrun -m mmengine_optim.train --launcher pytorch``: the gloo and
``device_ids`` workarounds are built in, and the ranks agree on τ and params."""

from pathlib import Path

import pytest
import torch

from processes import torchrun_mmengine

ROOT = Path(__file__).resolve().parents[2]

RANK_DUMP = '''
import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class RankDumpHook(Hook):
    """Each rank writes its τ, world size and params at the end of training."""

    def after_train(self, runner):
        wrapper = runner.optim_wrapper
        torch.save(dict(tau=wrapper.scale_invariant_iter, world_size=wrapper.optimizer.world_size,
                        iters=runner.iter, params=[p.detach().clone() for p in runner.model.parameters()],
                        ddp=type(runner.model).__name__),
                   f"{runner.work_dir}/rank{dist.get_rank()}.pt")
'''


@pytest.mark.slow
def test_two_rank_cpu_ddp_agrees_on_tau_and_params(tmp_path):
    (tmp_path / "rank_dump.py").write_text(RANK_DUMP)
    (tmp_path / "ddp.py").write_text(
        f"_base_ = [{str(ROOT / 'configs' / 'digits_fused_sgd_adascale.py')!r}]\n"
        "custom_imports = dict(imports=['examples.mmengine_digits', 'rank_dump'], allow_failed_imports=False)\n"
        "custom_hooks = [dict(type='mmengine_optim.PortableCheckpointHook'), dict(type='RankDumpHook')]\n"
        "train_cfg = dict(max_iters=12, val_interval=1000)\n"
        "default_hooks = dict(logger=dict(interval=4))\n")
    torchrun_mmengine(tmp_path / "ddp.py", tmp_path / "work", tmp_path)
    ranks = [torch.load(tmp_path / "work" / f"rank{r}.pt") for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["iters"] for r in ranks] == [12, 12]
    assert ranks[0]["ddp"] == "MMDistributedDataParallel"
    assert ranks[0]["tau"] == ranks[1]["tau"] > 3  # 3 updates with gains > 1
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
