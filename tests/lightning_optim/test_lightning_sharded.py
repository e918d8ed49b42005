"""Our optimizers under Lightning's sharding strategies on 2 gloo ranks (CPU):
``ModelParallelStrategy`` (FSDP2: the module's ``configure_model`` applies ``fully_shard``) with
the optimizer made in ``configure_optimizers``: given in code, by class path on ``LightningCLI``'s
command line (``--model.optimizer fused_optim.FusedAdam``) and in each YAML config of
``configs/lightning/``; and the CLI's own ``--optimizer`` through ``lightning_optim.LightningCLI``,
which points it at the sharded params (Lightning's own trains nothing there). One launch of
tests/workers/lightning_sharded_worker.py does every fit (Lightning's popen launcher runs rank 1).

Each fit must step the DTensor shards through the kernels (``implementation == "fused"``, no
fallback warning, state placed as its param) and end, on both ranks, with the params of the same
model trained unsharded in this process on the same grads: each step's grad is the mean of the
two ranks' micro-batch grads, which FSDP2 forms by reduce-scattering them with ``ReduceOp.AVG``;
for 2 ranks that is (g0 + g1) / 2 whatever the order (a sum of two floats commutes, halving is
exact), as here. The forward and backward see the same whole params (FSDP2 all-gathers them), so:

* elementwise optimizers (FusedAdam, FusedSGD): bit for bit;
* FusedLAMB (trust ratios and the global grad-norm clip from each tensor's norms, summed from the
  shards in float64): within test_sharded's LAYERWISE_TOL (its derivation: the same 4 steps at
  lr 1e-2 with |p| ≤ 5, where these params are ≤ 1).

Lightning's ``FSDPStrategy`` (FSDP1) does not run without a GPU (the exact errors are tested
here and quoted in docs/frameworks.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

import fused_optim
from lightning_sharded_worker import CONFIGS, ITEMS, OPTIMIZERS, WORLD, item, net
from test_sharded import LAYERWISE_TOL
from utils import WORKERS

WORKER = WORKERS / "lightning_sharded_worker.py"
TIMEOUT = 1200  # seconds for the launch: far above a loaded run; a hang fails the test
LAYERWISE = {"FusedLAMB"}
RUNS = [f"fsdp2/{name}" for name in OPTIMIZERS] + ["cli-fsdp2/FusedAdam", "cli-ours/FusedAdam"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launches the worker once; loads ``<run>-rank<r>.pt`` for r in (0, 1)."""
    out = tmp_path_factory.mktemp("lightning_sharded")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)  # rank 0 launches; Lightning sets LOCAL_RANK=1 for the other
    done = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "terminate called" not in done.stderr, done.stderr[-5000:]
    return lambda run: [torch.load(out / f"{run}-rank{r}.pt", weights_only=True) for r in range(WORLD)]


def unsharded(name: str) -> list[torch.Tensor]:
    """The worker's MLP whole, in this process: step k's grad is the mean of micro-batch 2k's
    (rank 0's) and 2k + 1's (rank 1's) grads."""
    model = net()
    opt = getattr(fused_optim, name)(model.parameters(), **OPTIMIZERS[name])
    for k in range(ITEMS // WORLD):
        grads = []
        for r in range(WORLD):
            model.zero_grad(set_to_none=True)
            x, y = item(WORLD * k + r)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = sum(per_rank) / WORLD
        opt.step()
    assert opt.implementation == "fused"
    return [p.detach() for p in model.parameters()]


def assert_fused_and_agreed(ranks: list[dict], optimizer: str, what: str) -> None:
    """``optimizer`` stepped every rank's shards through the kernels, without a fallback warning,
    its state placed as the params; the ranks end with the same whole params."""
    for r, run in enumerate(ranks):
        assert run["optimizer"] == optimizer, f"{what}, rank {r}: {run['optimizer']}"
        assert run["implementation"] == "fused", f"{what}, rank {r}: stepped by {run['implementation']}"
        fallback = [w for w in run["warnings"]  # ours begin with the optimizer's name
                    if w.split(": ", 1)[1].startswith(optimizer) or "reference implementation" in w]
        assert not fallback, f"{what}, rank {r} warned: {fallback}"
        assert run["state_placed_as_params"] and all(run["state_placed_as_params"]), \
            f"{what}, rank {r}: state not DTensors placed as their params"
    for k, (p0, p1) in enumerate(zip(ranks[0]["params"], ranks[1]["params"])):
        assert torch.isfinite(p0).all() and torch.equal(p0, p1), f"{what}: param {k}: the ranks disagree"


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_run_equals_the_model_trained_unsharded(runs, run):
    name = run.split("/")[1]
    ranks = runs(run)
    assert_fused_and_agreed(ranks, name, run)
    for k, (sharded, whole) in enumerate(zip(ranks[0]["params"], unsharded(name))):
        if name in LAYERWISE:
            torch.testing.assert_close(sharded, whole, **LAYERWISE_TOL, msg=lambda m: f"{run}, param {k}: {m}")
        else:
            assert torch.equal(sharded, whole), f"{run}: param {k} differs by {(sharded - whole).abs().max()}"


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_lightning_config_trains_sharded(runs, config):
    """``examples.lightning_digits`` with the config (3 steps): the config's optimizer, fused on
    the shards; each param moved from its init (``seed_everything``, then the DigitsCNN's), by at
    most what 3 steps can move it: Adam's step per element at most lr·(1 − β1)/√(1 − β2) ≈ 3.2·lr
    (Kingma & Ba, §2.1), LAMB's at most lr·‖p‖ (its trust ratio ‖p‖/‖u‖ times |u_i| ≤ ‖u‖), each
    plus lr·wd·|p| (≤ 1e-5 here): 10·lr·max(1, ‖p‖) bounds 3 of either, below the distance
    between two random inits."""
    import yaml

    from examples.digits import DigitsCNN

    cfg = yaml.safe_load(config.read_text())
    ranks = runs(f"config/{config.stem}")
    assert_fused_and_agreed(ranks, cfg["model"]["optimizer"]["class_path"].split(".")[-1], config.stem)
    torch.manual_seed(cfg["seed_everything"])
    init = list(DigitsCNN(cfg["model"]["width"]).parameters())
    bound = 10 * cfg["model"]["optimizer"]["init_args"]["lr"]
    for k, (p, q) in enumerate(zip(ranks[0]["params"], init)):
        assert 0 < (p - q).abs().max() <= bound * max(1.0, q.norm()), f"{config.stem}: param {k}"


@pytest.mark.slow
def test_lightning_cli_own_optimizer_option_trains_nothing_under_fsdp2(runs):
    """LightningCLI's ``--optimizer fused_optim.FusedAdam`` makes the optimizer when the CLI
    starts, over the module's params then; ``configure_model``'s ``fully_shard`` replaces them by
    DTensors: the optimizer holds none of the params that get grads and never steps (Lightning
    2.6.6, whatever the optimizer; Lightning #19110). docs/frameworks.md says to inject the
    optimizer instead, or to use lightning_optim.LightningCLI (the ``cli-ours`` run)."""
    for run in runs("cli-auto/FusedAdam"):
        assert run["optimizer"] == "FusedAdam" and not run["holds_module_params"]
        assert run["implementation"] is None and not run["state_placed_as_params"]
        assert all(torch.equal(p, q) for p, q in zip(run["params"], net().parameters()))  # the init


def test_the_lightning_configs_are_there():
    assert {p.name for p in CONFIGS} >= {"digits_fsdp2_fused_adam.yaml", "digits_fsdp2_fused_lamb.yaml"}


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the refusals without an accelerator")
def test_fsdp1_refuses_the_cpu_with_the_documented_errors():
    """Lightning's FSDPStrategy by name or instance: the Trainer refuses the CPU accelerator; a
    subclass passes that check, then torch's FullyShardedDataParallel (to which Lightning gives
    ``device_id=None`` on the CPU) refuses a module without an accelerator."""
    for strategy in ("fsdp", FSDPStrategy()):
        with pytest.raises(ValueError, match=r"^The strategy `fsdp` requires a GPU accelerator, but received "
                                             r"`accelerator='cpu'`"):
            pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    from torch.distributed.fsdp import FullyShardedDataParallel

    with pytest.raises(RuntimeError, match=r"^FSDP needs a non-CPU accelerator device, but no accelerator "
                                           r"device is detected\.$"):
        FullyShardedDataParallel(torch.nn.Linear(2, 2), device_id=None)
