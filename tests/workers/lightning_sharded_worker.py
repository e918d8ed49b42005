"""Subprocess side of tests/lightning_optim/test_lightning_sharded.py: ``python lightning_sharded_worker.py OUT``.
Rank 0 is this process; Lightning's popen launcher starts rank 1 by re-running the same command.
Each run writes ``OUT/<run>-rank<r>.pt``: ``{"optimizer", "implementation", "warnings", "params"
(the whole params after training), "state_placed_as_params", "holds_module_params"}``.

Runs, each a 2-rank fit of a small MLP on CPU (gloo), 32-true, one epoch of ``ITEMS // 2``
steps; rank r trains on micro-batches r, r + 2, ...:

* ``fsdp2/<Optimizer>``: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``,
  ``configure_model`` applying ``fully_shard`` (FSDP2) to each Linear and the net,
  ``configure_optimizers`` returning our optimizer;
* ``cli-fsdp2/FusedAdam``: the same module through ``LightningCLI``, the optimizer injected by
  class path (``--model.optimizer fused_optim.FusedAdam``), the strategy by class path;
* ``cli-auto/FusedAdam``: ``LightningCLI``'s own ``--optimizer fused_optim.FusedAdam``, which
  makes the optimizer when the CLI starts, over the params ``fully_shard`` replaces later;
* ``cli-ours/FusedAdam``: the same through ``lightning_optim.LightningCLI``, which points that
  optimizer at the sharded params;
* ``config/<name>``: ``examples.lightning_digits`` (the digits CNN, its LightningCLI) with a YAML
  config of ``configs/lightning/`` (``--trainer.max_steps`` shortened).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI, OptimizerCallable
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

import fused_optim
import lightning_optim
from fused_optim.process_group import end_process_group

WORLD = 2
ITEMS = 8  # micro-batches: 4 steps, each averaging rank 0's item 2k and rank 1's item 2k + 1
OPTIMIZERS = {  # class name: options (momentum, weight decay: every part of each update runs)
    "FusedAdam": dict(lr=1e-2, weight_decay=1e-2),
    "FusedSGD": dict(lr=0.1, momentum=0.9, nesterov=True),
    "FusedLAMB": dict(lr=1e-2, weight_decay=1e-2),
}
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "lightning").glob("*.yaml"))
TRAINER = dict(accelerator="cpu", devices=WORLD, precision="32-true", max_epochs=1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, use_distributed_sampler=False)


def item(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch i: 4 samples of a noisy nonlinear map 6 → 3."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(4, 6, generator=g)
    return x, torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1], x[:, 2].cos()], 1) + 0.1 * torch.randn(4, 3, generator=g)


def net() -> torch.nn.Sequential:
    """The same init on every rank and in the unsharded reference."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        return item(i)


class Regressor(pl.LightningModule):
    """The MLP, sharded by FSDP2 in ``configure_model``. Without ``configure_optimizers``:
    LightningCLI's ``--optimizer`` supplies it."""

    def __init__(self):
        super().__init__()
        self.net = net()

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def train_dataloader(self):
        sampler = torch.utils.data.DistributedSampler(Items(), WORLD, self.global_rank, shuffle=False)
        return torch.utils.data.DataLoader(Items(), batch_size=None, sampler=sampler)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


class OwnOptimizer(Regressor):
    """``configure_optimizers`` makes the optimizer it is given (a class path on LightningCLI's
    command line) over the sharded params."""

    def __init__(self, optimizer: OptimizerCallable):
        super().__init__()
        self.optimizer = optimizer

    def configure_optimizers(self):
        return self.optimizer(self.parameters())


def run_and_save(out: Path, run: str, fit) -> None:
    """``fit()`` (returns the trained module), then the module's whole params (its DTensors made
    whole), what its optimizer did and every warning the fit raised, saved for the test."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = fit()
    opt, params = module.trainer.optimizers[0], list(module.parameters())
    placed = [isinstance(v, DTensor) and v.placements == p.placements
              for p in params for k, v in opt.state[p].items() if k != "step"]
    held = {id(p) for group in opt.param_groups for p in group["params"]} == {id(p) for p in params}
    (out / run).parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(optimizer=type(opt).__name__, implementation=opt.implementation,
                    params=[p.full_tensor() for p in params], state_placed_as_params=placed, holds_module_params=held,
                    warnings=[f"{w.category.__name__}: {w.message}" for w in caught]),
               out / f"{run}-rank{module.global_rank}.pt")


def fit_own(out: Path, name: str) -> None:
    def fit():
        module = OwnOptimizer(lambda params: getattr(fused_optim, name)(params, **OPTIMIZERS[name]))
        pl.Trainer(strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
                   **TRAINER).fit(module)
        return module

    run_and_save(out, f"fsdp2/{name}", fit)


def fit_cli(out: Path, run: str, model: type, args: list[str], cli_class: type = LightningCLI) -> None:
    def fit():
        cli = cli_class(model, run=False, save_config_callback=None, args=args)
        cli.trainer.fit(cli.model)
        return cli.model

    run_and_save(out, run, fit)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    for name in OPTIMIZERS:
        fit_own(out, name)
    trainer_args = [f"--trainer.{k}={v}" for k, v in TRAINER.items()] + [
        "--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
        "--trainer.strategy.data_parallel_size", str(WORLD), "--trainer.strategy.tensor_parallel_size", "1"]
    for run, model, key, cli_class in (("cli-fsdp2", OwnOptimizer, "model.optimizer", LightningCLI),
                                       ("cli-auto", Regressor, "optimizer", LightningCLI),
                                       ("cli-ours", Regressor, "optimizer", lightning_optim.LightningCLI)):
        options = [f"--{key}", "fused_optim.FusedAdam",
                   *(arg for k, v in OPTIMIZERS["FusedAdam"].items() for arg in (f"--{key}.{k}", str(v)))]
        fit_cli(out, f"{run}/FusedAdam", model, [*options, *trainer_args], cli_class)
    from examples import lightning_digits

    for config in CONFIGS:  # as python -m examples.lightning_digits fit --config CONFIG runs them
        args = ["fit", "--config", str(config), "--trainer.max_steps=3", "--trainer.logger=false",
                f"--trainer.default_root_dir={out / 'config' / config.stem}", "--trainer.enable_checkpointing=false",
                "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
        run_and_save(out, f"config/{config.stem}", lambda args=args: lightning_digits.main(args).model)
    end_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
