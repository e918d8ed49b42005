"""Subprocess side of tests/lightning_optim/test_lightning_model_parallel.py: ``python
lightning_model_parallel_worker.py OUT MODE``.

MODE ``model_parallel``: rank 0 is this process; Lightning's popen launcher starts rank 1 by
re-running the same command. Under ``ModelParallelStrategy`` on 2 CPU ranks (gloo), the module's
MLP is split by tensor parallelism (``parallelize_module``: column-wise then row-wise, the
ranks hold one replica and see the same batches) and trained with ``AdaScaleCallback``, then with
``NoiseScaleCallback``; then, data-parallel (each rank its half of the batches, N = 2), the MLP
is sharded by FSDP2 over a ``data_parallel`` dimension of 2 and trained with both callbacks, and
so is the MLP whole under DDP. MODE ``single``: the first two runs on one device, unsharded.
Each writes ``OUT/<mode>-rank<r>.pt``: per run, the statistics read after each update and the
params at the end (whole tensors).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

import fused_optim
import lightning_optim

ACCUM, UPDATES, MICRO = 2, 6, 4  # accumulation count, optimizer updates, samples per micro-batch


class Module(pl.LightningModule):
    def __init__(self, parallel: str | None):
        super().__init__()
        torch.manual_seed(0)
        # float64 (ModelParallelStrategy refuses precision="64-true"; the default "32-true" casts nothing)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
        self.parallel = parallel

    def configure_model(self) -> None:
        if self.parallel == "tensor":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
        elif self.parallel == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return fused_optim.FusedSGD(self.parameters(), lr=0.1)


class Record(pl.Callback):
    """The statistics after each update (the gain it applied, B_simple)."""

    def __init__(self):
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % ACCUM == 0:
            opt = trainer.strategy.optimizers[0]
            self.rows.append({"gain": opt.gain() if isinstance(opt, fused_optim.AdaScale) else None,
                              "b_simple": opt.noise_scale(MICRO), "world_size": opt.world_size})


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ACCUM * UPDATES * MICRO, 8, generator=g, dtype=torch.float64)
    y = torch.sin(3 * x[:, :4]) + 0.3 * torch.randn(x.shape[0], 4, generator=g, dtype=torch.float64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO)


def strategy(parallel: str | None):
    if parallel in (None, "ddp"):
        return parallel or "auto"
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1} if parallel == "fsdp2" else {}
    return ModelParallelStrategy(**sizes)


def fit(parallel: str | None, callback: pl.Callback) -> dict:
    record = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=1 if parallel is None else 2, strategy=strategy(parallel),
                         max_steps=UPDATES, accumulate_grad_batches=ACCUM, logger=False,
                         # data-parallel runs split the batches (in order: the loader does not shuffle; two
                         # epochs make UPDATES); a tensor-parallel replica sees them all
                         use_distributed_sampler=parallel in ("ddp", "fsdp2"),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback, record])
    module = Module(parallel)
    trainer.fit(module, data())
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.net.parameters()]
    return {"rows": record.rows, "params": [p.detach().clone() for p in params], "rank": trainer.global_rank}


def main(out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    parallel = "tensor" if mode == "model_parallel" else None
    result = {"adascale": fit(parallel, lightning_optim.AdaScaleCallback()),
              "noise_scale": fit(parallel, lightning_optim.NoiseScaleCallback(micro_batch_size=MICRO))}
    rank = result["adascale"]["rank"]
    if mode == "model_parallel":
        for parallel in ("fsdp2", "ddp"):
            result[parallel] = {
                "adascale": fit(parallel, lightning_optim.AdaScaleCallback()),
                "noise_scale": fit(parallel, lightning_optim.NoiseScaleCallback(micro_batch_size=MICRO))}
    torch.save(result, out / f"{mode}-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
