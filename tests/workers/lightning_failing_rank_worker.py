"""Subprocess side of tests/lightning_optim/test_lightning_failing_rank.py: ``python
lightning_failing_rank_worker.py STRATEGY...``. For each strategy name (a spawn variant), a 2-rank
fit on CPU whose rank 1 raises in ``training_step`` at its second batch, while rank 0 goes on
into the step's collectives. Prints one line per strategy: ``<strategy> raised <exception type>``
followed by the exception text (which carries the failing rank's traceback), or ``<strategy>
finished`` if the fit did not raise."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch

import fused_optim.distributed as fd
import lightning_optim  # noqa: F401  (registers the strategies)

MESSAGE = "rank 1 fails on purpose at batch 1"


class FailingOnRank1(pl.LightningModule):
    def __init__(self, strategy: str):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.strategy = strategy

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 1:
            raise ValueError(MESSAGE)
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        if self.strategy.startswith("centralized"):
            return fd.CentralizedSGD(None, self.net, lr=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(strategies: list[str]) -> None:
    for strategy in strategies:
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        data = torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2)
        try:
            trainer.fit(FailingOnRank1(strategy), data)
        except Exception as err:  # noqa: BLE001  (the test reads which and what)
            print(f"{strategy} raised {type(err).__name__}: {err}", flush=True)
        else:
            print(f"{strategy} finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
