"""What a demo run records, whatever framework trains it: validation curves in τ and updates, and
the gain and gradient noise scale of every AdaScale update; a progress bar while it runs; one JSON
file at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fused_optim.optional import require

from ..digits import load_digits
from .plan import Run, Setup


@torch.no_grad()
def evaluate(model: nn.Module, images: Tensor, labels: Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy in percent) of ``model``'s logits on the whole set."""
    was_training = model.training
    model.eval()
    logits = model(images)
    model.train(was_training)
    return F.cross_entropy(logits, labels).item(), 100.0 * (logits.argmax(1) == labels).float().mean().item()


class Recorder:
    """Observes one run on rank 0. The framework adapter calls :meth:`start`, then
    :meth:`update` after every optimizer update (with τ for AdaScale; a fixed-lr run's τ is
    ``updates × run.nominal_gain``), then :meth:`finish`, which writes ``<out>/<run.name>.json``.

    The model is validated at τ = 0, whenever τ passes the next of ``setup.evaluations`` evenly
    spaced points up to the budget, and after the last update.
    """

    def __init__(self, run: Run, setup: Setup, out_dir: str | Path, title: str):
        self.run, self.setup, self.path, self.title = run, setup, Path(out_dir) / f"{run.name}.json", title

    def start(self, model: nn.Module) -> None:
        tqdm = require("tqdm.auto", "examples", "the demo's progress bars").tqdm

        self._val = load_digits("val")
        self._interval = self.setup.budget / self.setup.evaluations
        self._next_eval = self._interval
        self.curve: list[dict] = []
        self.gains: list[dict] = []
        self.steps, self.tau = 0, 0.0
        self._bar = tqdm(total=self.setup.budget, desc=self.title, unit="τ", dynamic_ncols=True, leave=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| τ {n:.0f}/{total:.0f} [{elapsed}{postfix}]")
        self._evaluate(model)

    def update(self, model: nn.Module, steps: int, tau: float | None = None, adascale=None) -> None:
        """After update number ``steps``; ``tau``: AdaScale's τ (None for a fixed-lr run), and
        ``adascale`` the AdaScale. The gain recorded is the update's increment of τ: the gain its lr
        got (also for a short window at an epoch's end, whose gain has a smaller scale than the
        next :meth:`AdaScale.gain`); ``b_simple`` is its gradient noise scale in samples."""
        if tau is None:
            tau = steps * self.run.nominal_gain
        else:
            self.gains.append(dict(step=steps, tau=tau, gain=tau - self.tau,
                                   b_simple=None if adascale is None else adascale.noise_scale(self.run.batch_size)))
        self.steps, self.tau = steps, tau
        self._bar.update(min(tau, self.setup.budget) - self._bar.n)
        if tau >= self._next_eval - 1e-9:
            self._next_eval = (math.floor(tau / self._interval + 1e-9) + 1) * self._interval
            self._evaluate(model)

    def finish(self, model: nn.Module) -> dict:
        if self.curve[-1]["step"] != self.steps:
            self._evaluate(model)
        self._bar.close()
        gains = [g["gain"] for g in self.gains]
        result = dict(run=self.run.to_dict(), steps=self.steps, tau=self.tau,
                      val_loss=self.curve[-1]["val_loss"], val_acc=self.curve[-1]["val_acc"],
                      gain_min=min(gains) if gains else None, gain_max=max(gains) if gains else None,
                      curve=self.curve, gains=self.gains)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(result, indent=1))
        return result

    def _evaluate(self, model: nn.Module) -> None:
        loss, acc = evaluate(model, *self._val)
        self.curve.append(dict(step=self.steps, tau=self.tau, val_loss=loss, val_acc=acc))
        self._bar.set_postfix_str(f"update {self.steps}, val acc {acc:.1f}%", refresh=False)


def load_result(run: Run, out_dir: str | Path) -> dict:
    """The result :meth:`Recorder.finish` wrote for ``run`` (also from another process)."""
    path = Path(out_dir) / f"{run.name}.json"
    if not path.exists():
        raise RuntimeError(f"run {run.name!r} ended without writing {path}: see the errors above")
    return json.loads(path.read_text())
