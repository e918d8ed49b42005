"""Subprocess side of tests/lightning_optim/test_lightning_distributed.py: ``python lightning_distributed_worker.py
OUT PHASE``. Rank 0 is this process; Lightning's popen launcher starts rank 1 by re-running the
same command. Each rank writes ``OUT/<run>-rank<r>.pt`` (float64 params, optimizer state, the
items it trained on).

Phase ``train``: Lightning runs with strategies "centralized" (CentralizedSGD), "decentralized"
(DecentralizedSGD) and "powersgd_ddp", then the same updates written by hand with
torch.distributed (``hand-*``; in the group the strategies left, which lives until exit), then runs
saving a checkpoint halfway (``straight-*``: RESUMED). Phase ``resume``: fresh processes resume that
checkpoint (``resumed-*``). The powersgd_ddp runs also save the hook's state (``hook``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import fused_optim
import fused_optim.distributed as fd
import lightning_optim  # noqa: F401  (registers the strategies)

WORLD = 2
ITEMS = 8  # micro-batches per epoch: DistributedSampler (no shuffle) gives rank r items r, r + 2, ...
POWERSGD = dict(matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5)
EPOCHS = 4  # the checkpointed runs: 4 epochs × 4 steps, saved after epoch 2 (an epoch boundary)
# the checkpointed runs: (run name, Module kind, strategy maker)
RESUMED = (("decentralized", "decentralized", lambda: "decentralized"), ("powersgd", "powersgd", lambda: "centralized"),
           ("powersgd_ddp", "ddp", lambda: lightning_optim.PowerSGDDDPStrategy(**POWERSGD)))


def item(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch i: 4 samples of a noisy linear map, float64."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(4, 1, generator=g, dtype=torch.float64)


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        return (*item(i), torch.tensor(i))


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()


def make_optimizer(kind: str, model: torch.nn.Module, rank: int):
    if kind == "centralized":
        return fd.CentralizedSGD(None, model, lr=0.1, momentum=0.9)
    if kind == "decentralized":
        return fd.DecentralizedSGD(rank, fd.ring(rank, WORLD), model, lr=0.1, momentum=0.9)
    if kind == "powersgd":  # ours, under strategy "centralized": per-rank error memories in the checkpoint
        return fd.PowerSGD(model, lr=0.1, momentum=0.9, rank=1, reuse_query=True)
    return fused_optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # under DDP


class Module(pl.LightningModule):
    """Initialised differently on each rank: the strategy's broadcast of rank 0's model is tested."""

    def __init__(self, kind: str, own_sampler: bool):
        super().__init__()
        self.kind, self.net, self.seen = kind, net(int(os.environ.get("LOCAL_RANK", 0))), []
        self.own_sampler = own_sampler

    def train_dataloader(self):
        if not self.own_sampler:  # Lightning adds its DistributedSampler (shuffled)
            return DataLoader(Items(), batch_size=None)
        # Unshuffled: Lightning (2.6) replays epoch 0's shuffle in the first epoch after a resume.
        return DataLoader(Items(), batch_size=None, sampler=DistributedSampler(Items(), WORLD, self.global_rank,
                                                                               shuffle=False))

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        self.seen.append(int(i))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.kind, self.net, self.global_rank)


def dump(out: Path, run: str, rank: int, model, optimizer, seen, hook=None) -> None:
    torch.save(dict(params=[p.detach().clone() for p in model.parameters()], optimizer=optimizer.state_dict(),
                    seen=list(seen), hook=hook), out / f"{run}-rank{rank}.pt")


def fit(out: Path, run: str, kind: str, strategy: str, steps_or_ckpt, **trainer_kwargs) -> None:
    module = Module(kind, own_sampler="callbacks" in trainer_kwargs)
    trainer = pl.Trainer(**{**dict(accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true",
                                   logger=False, enable_progress_bar=False, enable_model_summary=False,
                                   num_sanity_val_steps=0, enable_checkpointing=False,
                                   use_distributed_sampler=not module.own_sampler), **trainer_kwargs})
    trainer.fit(module, ckpt_path=steps_or_ckpt if isinstance(steps_or_ckpt, str) else None)
    hook = None
    if isinstance(trainer.strategy, lightning_optim.PowerSGDDDPStrategy):  # (fit unwrapped the DDP module)
        hook = trainer.strategy.powersgd_keeper.state_dict()
        assert hook["iter"] == trainer.global_step  # the hook ran at every step (and resumed its count)
    else:
        assert trainer.model is module  # no DDP wrapper
    dump(out, run, trainer.global_rank, module.net, trainer.optimizers[0], module.seen, hook)


def hand_loop(out: Path, kind: str, rank: int) -> None:
    """The same updates without Lightning: each rank's shard of items, closure, step."""
    model = net(0)  # rank 0's init: what the strategies broadcast
    if kind in ("powersgd_ddp", "ddp"):
        model = DistributedDataParallel(model)
        if kind == "powersgd_ddp":
            model.register_comm_hook(PowerSGDState(process_group=None, **POWERSGD), powerSGD_hook)
    opt = make_optimizer(kind, model, rank)
    seen = list(DistributedSampler(Items(), WORLD, rank, shuffle=True, seed=0))  # Lightning's for training
    for i in seen:
        x, y = item(i)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    dump(out, f"hand-{kind}", rank, model, opt, seen)


def main(out: Path, phase: str) -> None:
    ckpt_dir = out / "ckpt"
    if phase == "train":
        fit(out, "centralized", "centralized", "centralized", None, max_epochs=1)
        fit(out, "decentralized", "decentralized", "decentralized", None, max_epochs=1)
        fit(out, "powersgd_ddp", "ddp", lightning_optim.PowerSGDDDPStrategy(**POWERSGD), None, max_epochs=1)
        for kind in ("centralized", "decentralized", "powersgd_ddp", "ddp"):  # in the strategies' process group
            hand_loop(out, kind, torch.distributed.get_rank())
        for run, kind, strategy in RESUMED:
            save = ModelCheckpoint(dirpath=ckpt_dir / run, filename="{epoch}", every_n_epochs=EPOCHS // 2,
                                   save_top_k=-1)
            fit(out, f"straight-{run}", kind, strategy(), None, max_epochs=EPOCHS, callbacks=[save],
                enable_checkpointing=True)
    else:
        for run, kind, strategy in RESUMED:
            fit(out, f"resumed-{run}", kind, strategy(), str(ckpt_dir / run / f"epoch={EPOCHS // 2 - 1}.ckpt"),
                max_epochs=EPOCHS, callbacks=[])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
