"""A user's own training script, ``Runner.from_cfg`` with ``launcher='pytorch'``, under
``torchrun --nproc_per_node=2`` on CPU through the public ``mmengine_optim.prepare_cpu_ddp``:
both ranks train in one gloo group under DDP and end with the same params."""

from pathlib import Path

import pytest
import torch

from processes import torchrun

ROOT = Path(__file__).resolve().parents[2]

# As docs/frameworks.md shows it, plus what the test reads back.
SCRIPT = '''
import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.runner import Runner

from fused_optim.process_group import end_process_group
from mmengine_optim import prepare_cpu_ddp


def main():
    cfg = Config.fromfile('config.py')
    cfg.launcher = 'pytorch'
    cfg.work_dir = 'work'
    runner = Runner.from_cfg(prepare_cpu_ddp(cfg))
    runner.train()
    torch.save(dict(world_size=dist.get_world_size(), iters=runner.iter, ddp=type(runner.model).__name__,
                    params=[p.detach().clone() for p in runner.model.parameters()]),
               f'work/rank{dist.get_rank()}.pt')


if __name__ == '__main__':
    main()
    end_process_group()
'''


@pytest.mark.slow
def test_own_script_under_torchrun_trains_ddp_on_cpu(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "config.py").write_text(
        f"_base_ = [{str(ROOT / 'configs' / 'digits_fused_sgd.py')!r}]\n"
        "train_cfg = dict(max_iters=6, val_interval=1000)\nlog_level = 'WARNING'\n")
    torchrun(["train.py"], tmp_path)
    ranks = [torch.load(tmp_path / "work" / f"rank{r}.pt") for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["iters"] for r in ranks] == [6, 6]
    assert ranks[0]["ddp"] == ranks[1]["ddp"] == "MMDistributedDataParallel"
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
