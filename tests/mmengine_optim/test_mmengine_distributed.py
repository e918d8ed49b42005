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

ROOT = Path(__file__).resolve().parents[2]

RANK_DUMP = '''
import copy

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from fused_optim.registry import create_optimizer


@HOOKS.register_module()
class RankDumpHook(Hook):
    """Each rank records its model at the start of training and every batch it trains on; at the
    end it runs the same updates in a hand-written loop (a copy of the model from the start,
    ``hand``: the optimizer by registry name, its own step in a plain torch.distributed loop) and
    writes both results, its model wrapper and optimizer class."""

    def __init__(self, hand):
        self.hand, self.batches = hand, []

    def before_train(self, runner):
        self.start = copy.deepcopy(runner.model.module.state_dict())

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.batches.append(copy.deepcopy(data_batch))

    def after_train(self, runner):
        model = copy.deepcopy(runner.model.module)
        model.load_state_dict(self.start)
        hand = dict(self.hand)
        opt = create_optimizer(hand.pop("name"), model.parameters(), **hand)
        for batch in self.batches:  # what mmengine's train_step does, by hand
            opt.zero_grad()
            model(**model.data_preprocessor(batch, True), mode="loss")["loss"].backward()
            opt.step()
        torch.save(dict(params=[p.detach().clone() for p in runner.model.parameters()], iters=runner.iter,
                        hand=[p.detach().clone() for p in model.parameters()],
                        wrapper=type(runner.model).__name__, optimizer=type(runner.optim_wrapper.optimizer).__name__),
                   f"{runner.work_dir}/rank{dist.get_rank()}.pt")
'''


def train(tmp_path: Path, optimizer: str, hand: dict, extra: str = "") -> list[dict]:
    """6 iterations of configs/digits_centralized_sgd.py with ``optimizer`` (config keywords) on 2
    ranks, a checkpoint every 3 (per rank), and ``extra`` config lines; each rank's dump."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "rank_dump.py").write_text(RANK_DUMP)
    (tmp_path / "run.py").write_text(
        f"_base_ = [{str(ROOT / 'configs' / 'digits_centralized_sgd.py')!r}]\n"
        "custom_imports = dict(imports=['examples.mmengine_digits', 'rank_dump'],\n"
        "                      allow_failed_imports=False)\n"
        "custom_hooks = [dict(type='mmengine_optim.PortableCheckpointHook'),\n"
        "                dict(type='mmengine_optim.PerRankCheckpointHook'),\n"
        f"                dict(type='RankDumpHook', hand={hand!r})]\n"
        f"optim_wrapper = dict(optimizer=dict(_delete_=True, {optimizer}))\n"
        "train_cfg = dict(max_iters=6, val_interval=1000)\n"
        "default_hooks = dict(logger=dict(interval=3), checkpoint=dict(interval=3))\n" + extra)
    torchrun_mmengine(tmp_path / "run.py", tmp_path / "work", tmp_path)
    return [torch.load(tmp_path / "work" / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.slow
def test_two_ranks_train_without_ddp_as_a_hand_written_loop(tmp_path):
    """The config's optimizer and model wrapper are built by name; averaged grads keep the two
    ranks' models identical although their batches differ (there is no DDP to do it), and equal
    the same batches' updates in a hand-written loop bit for bit (one run, ~20 s: every name's
    construction is checked in one process below)."""
    cls = "CentralizedSGD"
    ranks = train(tmp_path, "type='mmengine_optim.CentralizedSGD', lr=0.1, momentum=0.9",
                  dict(name="centralized_sgd", lr=0.1, momentum=0.9))
    assert [r["iters"] for r in ranks] == [6, 6]
    assert {r["wrapper"] for r in ranks} == {"OptimizerSyncedModel"}
    assert {r["optimizer"] for r in ranks} == {cls}
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], r["hand"]))
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_powersgd_as_a_hand_written_loop_and_resumed_exactly(tmp_path):
    """PowerSGD (rank 1, warm start) on 2 ranks equals the hand-written loop bit for bit; resumed
    in fresh processes from the iteration-3 checkpoint, each rank ends where the uninterrupted run
    did, bit for bit (PerRankCheckpointHook: every rank's error memories, Q and momentum)."""
    optimizer = "type='mmengine_optim.PowerSGD', lr=0.1, momentum=0.9, rank=1, reuse_query=True"
    hand = dict(name="powersgd", lr=0.1, momentum=0.9, rank=1, reuse_query=True)
    straight = train(tmp_path / "straight", optimizer, hand)
    for r in straight:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], r["hand"]))
    checkpoint = torch.load(tmp_path / "straight" / "work" / "iter_3.pth", weights_only=True)
    memories = [rank["optimizer"]["communication"]["memories"] for rank in checkpoint["per_rank"]]
    assert not all(torch.equal(a, b) for a, b in zip(*memories))  # the ranks' states differ
    resumed = train(tmp_path / "resumed", optimizer, hand,
                    f"resume = True\nload_from = {str(tmp_path / 'straight' / 'work' / 'iter_3.pth')!r}\n")
    for s, r in zip(straight, resumed):
        assert r["iters"] == 6
        assert all(torch.equal(a, b) for a, b in zip(s["params"], r["params"]))


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


@pytest.mark.parametrize("optimizer", ["SGD", "mmengine_optim.FusedSGD", "mmengine_optim.CentralizedSGD"])
def test_the_synced_model_wrapper_takes_only_optimizers_that_communicate(optimizer):
    """OptimizerSyncedModel does no communication of its own, so with an optimizer that does not
    communicate each rank would train its own model in silence: the first train_step refuses it,
    naming the fix, before the module's step (the params are unchanged). In one process (the
    check needs no process group), through mmengine's builders."""
    from mmengine.model import BaseModel
    from mmengine.optim import OptimWrapperDict

    class Model(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)

        def forward(self, x, mode="loss"):
            return {"loss": self.linear(x).square().mean()}

    wrapped = mmengine_optim.OptimizerSyncedModel(Model())
    before = [p.detach().clone() for p in wrapped.parameters()]
    wrapper = build_optim_wrapper(wrapped.module, dict(type="OptimWrapper", optimizer=dict(type=optimizer, lr=0.1)))
    if optimizer.endswith("CentralizedSGD"):
        wrapped.train_step(dict(x=torch.ones(4, 3)), wrapper)
        assert not all(torch.equal(p, q) for p, q in zip(wrapped.parameters(), before))
        return
    for given in (wrapper, OptimWrapperDict(only=wrapper)):  # (a module with several optimizers)
        with pytest.raises(TypeError, match=r"OptimizerSyncedModel does not wrap .* does not communicate.*"
                                            r"fused_optim\.distributed.*leave out model_wrapper_cfg"):
            wrapped.train_step(dict(x=torch.ones(4, 3)), given)
        assert all(torch.equal(p, q) for p, q in zip(wrapped.parameters(), before))
