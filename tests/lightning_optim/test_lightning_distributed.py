"""The strategies of lightning_optim/distributed.py on 2 gloo ranks: Lightning runs with
"centralized" (CentralizedSGD), "decentralized" (DecentralizedSGD) and "powersgd_ddp" equal the
same updates written by hand with torch.distributed, and a run resumed in fresh processes from a
per-rank checkpoint equals the uninterrupted run. One launch of tests/workers/lightning_distributed_worker.py
does all the training (Lightning's popen launcher runs rank 1); a second one resumes.

Every comparison is exact: both sides run the same float64 ops in the same order on the same
data in the same kind of process (the same collectives, the same fused kernels), so a mismatch is
a different update, not rounding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_optim
from utils import WORKERS

# Every test here shares 2-rank runs a module fixture launches (processes).
pytestmark = pytest.mark.slow

WORKER = WORKERS / "lightning_distributed_worker.py"
TIMEOUT = 1800  # seconds per launch: far above a loaded run; a hang fails the test


def launch(out: Path, phase: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)  # rank 0 launches; Lightning sets LOCAL_RANK=1 for the other
    done = subprocess.run([sys.executable, str(WORKER), str(out), phase], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # Rank 1's exit code is not seen (Lightning's child; its output is inherited): gloo's abort at exit
    # (racy, see fused_optim/process_group.py) must not appear in it.
    assert "terminate called" not in done.stderr, done.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Loads ``<run>-rank<r>.pt`` of both launches."""
    out = tmp_path_factory.mktemp("lightning_distributed")
    launch(out, "train")
    launch(out, "resume")
    return lambda run, rank: torch.load(out / f"{run}-rank{rank}.pt", weights_only=True)


def assert_same_rank(a: dict, b: dict, what: str) -> None:
    assert len(a["params"]) == len(b["params"]) == 4, what
    for i, (p, q) in enumerate(zip(a["params"], b["params"])):
        assert p.dtype == torch.float64 and torch.equal(p, q), f"{what}: param {i} differs by {(p - q).abs().max()}"


def assert_same_tree(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same_tree(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    else:
        assert a == b, what


@pytest.mark.parametrize("strategy", ["centralized", "decentralized", "powersgd_ddp"])
def test_lightning_run_equals_hand_written_loop_on_each_rank(runs, strategy):
    """Each rank trained on its own DistributedSampler shard (disjoint, together all items), and
    ended with the params of the hand-written loop on that shard, starting from rank 0's init
    (each rank's module is initialised differently: the strategy broadcast rank 0's)."""
    seen = [runs(strategy, r)["seen"] for r in (0, 1)]
    assert sorted(seen[0] + seen[1]) == list(range(8)) and len(seen[0]) == len(seen[1]) == 4
    for r in (0, 1):
        assert seen[r] == runs(f"hand-{strategy}", r)["seen"]
        assert_same_rank(runs(strategy, r), runs(f"hand-{strategy}", r), f"{strategy}, rank {r}")


def test_powersgd_ddp_compresses(runs):
    """The hook changed the update: after start_powerSGD_iter the rank-1 approximation of the
    averaged grads differs from plain DDP's exact average (the worker also checked that the hook's
    state counted every step)."""
    powersgd, exact = runs("powersgd_ddp", 0)["params"], runs("hand-ddp", 0)["params"]
    assert not torch.equal(powersgd[0], exact[0])


def test_resume_from_a_per_rank_checkpoint_continues_exactly(runs):
    """Saved after 2 of 4 epochs by ModelCheckpoint, resumed in fresh processes: each rank's params
    and optimizer state (DecentralizedSGD's momenta; PowerSGD's error memories, warm-start Q and
    generator, which differ per rank) equal the uninterrupted run's; under powersgd_ddp the DDP
    hook's state too (its error memories, P, Q, iteration and generator, per rank)."""
    for kind in ("decentralized", "powersgd"):
        for r in (0, 1):
            straight, resumed = runs(f"straight-{kind}", r), runs(f"resumed-{kind}", r)
            assert_same_rank(resumed, straight, f"{kind}, rank {r}")
            assert_same_tree(resumed["optimizer"], straight["optimizer"], f"{kind}, rank {r}: optimizer state")
            assert len(resumed["seen"]) == 8 and len(straight["seen"]) == 16  # 2 epochs resumed, 4 straight
        # the per-rank entries mattered: the ranks' optimizer states differ
        other = runs(f"straight-{kind}", 1)["optimizer"]
        with pytest.raises(AssertionError):
            assert_same_tree(runs(f"straight-{kind}", 0)["optimizer"], other, "rank 0 vs rank 1")


def test_powersgd_ddp_resumes_its_hook_state_exactly(runs):
    """powersgd_ddp (rank 1, compressing from step 3) saved after 8 of 16 steps and resumed: each
    rank's params, optimizer state and hook state equal the uninterrupted run's bit for bit; the
    hook's error memories differ between the ranks (so the per-rank entries mattered). The model's
    backward makes a Linear's weight grad before its bias grad: DDP's bucket layout after its
    rebuild is not the one of a new process's first step (the memories are rebuilt per param)."""
    for r in (0, 1):
        straight, resumed = runs("straight-powersgd_ddp", r), runs("resumed-powersgd_ddp", r)
        assert_same_rank(resumed, straight, f"rank {r}")
        assert_same_tree(resumed["optimizer"], straight["optimizer"], f"rank {r}: optimizer state")
        assert_same_tree(resumed["hook"], straight["hook"], f"rank {r}: hook state")
        assert straight["hook"]["iter"] == 16 and len(straight["hook"]["error"]) == 4
    errors = [runs("straight-powersgd_ddp", r)["hook"]["error"] for r in (0, 1)]
    assert not all(torch.equal(errors[0][k], errors[1][k]) for k in errors[0])


def test_strategies_are_registered_by_name_with_their_launchers():
    names = {"centralized": "popen", "centralized_spawn": "spawn", "decentralized": "popen",
             "decentralized_spawn": "spawn", "powersgd_ddp": "popen", "powersgd_ddp_spawn": "spawn"}
    for name, start_method in names.items():
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        cls = (lightning_optim.PowerSGDDDPStrategy if name.startswith("powersgd")
               else lightning_optim.OptimizerSyncedStrategy)
        assert type(trainer.strategy) is cls and trainer.strategy._start_method == start_method, name
    StrategyRegistry.register("powersgd_r4", lightning_optim.PowerSGDDDPStrategy, matrix_approximation_rank=4,
                              start_powerSGD_iter=10, override=True)
    assert StrategyRegistry.get("powersgd_r4").powersgd_options == dict(matrix_approximation_rank=4,
                                                                        start_powerSGD_iter=10)
    with pytest.raises(ValueError, match="drop ddp_comm_hook="):
        lightning_optim.PowerSGDDDPStrategy(ddp_comm_hook=print)
    with pytest.raises(TypeError):
        lightning_optim.OptimizerSyncedStrategy(find_unused_parameters=True)  # no DDP wrapper to pass it to


def test_a_per_rank_checkpoint_refuses_another_world_size(tmp_path):
    """In one process (world size 1, no group needed to load): a checkpoint of 2 ranks is refused
    with the fix; one without per-rank entries (another strategy's) loads as saved."""
    strategy = pl.Trainer(accelerator="cpu", devices=1, strategy="centralized", logger=False).strategy
    assert strategy.world_size == 1
    path = tmp_path / "two_ranks.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "per_rank": [{"state_dict": {"w": torch.zeros(1)}}] * 2}, path)
    with pytest.raises(ValueError, match=r"saved by 2 ranks, resumed on 1: .* devices × num_nodes = 2"):
        strategy.load_checkpoint(path)
    torch.save({"state_dict": {"w": torch.ones(1)}}, path)
    assert torch.equal(strategy.load_checkpoint(path)["state_dict"]["w"], torch.ones(1))


@pytest.mark.parametrize("returned", ["torch.optim.SGD", "fused_optim.SGD", "centralized"])
def test_centralized_strategy_takes_only_an_optimizer_that_communicates(returned):
    """"centralized" / "decentralized" leave the model unwrapped, so an optimizer that does not
    communicate would let each rank train its own model in silence: setup refuses it with the fix.
    In one process (the check needs no process group): Lightning's own setup_optimizers step."""
    import fused_optim
    import fused_optim.distributed as fd
    from lightning.pytorch.demos.boring_classes import BoringModel

    make = {"torch.optim.SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            "fused_optim.SGD": lambda m: fused_optim.SGD(m.parameters(), lr=0.1),
            "centralized": lambda m: fd.CustomCentralizedOptimizer(m, 1, torch.optim.SGD(m.parameters(), lr=0.1))}
    model = BoringModel()
    model.configure_optimizers = lambda: make[returned](model)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="centralized", logger=False)
    trainer.strategy.connect(model)
    model.trainer = trainer
    if returned == "centralized":
        trainer.strategy.setup_optimizers(trainer)
        assert isinstance(trainer.strategy.optimizers[0], fd.CustomCentralizedOptimizer)
    else:
        with pytest.raises(TypeError, match=r"'decentralized' does not wrap the model .* SGD does not communicate.*"
                                            r"fused_optim\.distributed.*strategy='ddp'"):
            trainer.strategy.setup_optimizers(trainer)
