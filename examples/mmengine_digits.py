"""The example configs' dataset, model and metric: :mod:`.digits` for mmengine, registered on import
under their bare names in mmengine's root registries (``DATASETS``, ``MODELS``, ``METRICS``).

A config that names them imports this module (the fragments in ``configs/_base_`` that name them do)::

    custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
    model = dict(type='DigitsClassifier', width=16)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, METRICS, MODELS
from torch.utils.data import Dataset

from .digits import DigitsCNN, load_digits

@DATASETS.register_module()
class DigitsDataset(Dataset):
    """scikit-learn's 8×8 digits, ``split`` ``"train"`` or ``"val"``; items are
    ``dict(inputs=float32 [1, 8, 8], data_samples=int64 label)`` (use ``default_collate``)."""

    metainfo = dict(classes=tuple("0123456789"))

    def __init__(self, split: str = "train", seed: int = 0):
        self.images, self.labels = load_digits(split, seed)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return dict(inputs=self.images[index], data_samples=self.labels[index])


@MODELS.register_module()
class DigitsClassifier(BaseModel):
    """:class:`examples.digits.DigitsCNN` with mmengine's modes: ``loss`` → cross-entropy,
    ``predict`` → per-image ``dict(pred, label, loss)``, ``tensor`` → logits. ``dtype``
    (``'float16'``, ``'bfloat16'``): the params' dtype, a half model (inputs cast to it, logits
    back to fp32), e.g. for an optimizer with ``master_weights=True``."""

    def __init__(self, width: int = 16, data_preprocessor: dict | None = None, dtype: str | None = None):
        super().__init__(data_preprocessor)
        self.net = DigitsCNN(width)
        # the inputs' dtype, kept here: FSDP with use_orig_params=False leaves the net no params to read it from
        self.input_dtype = torch.float32 if dtype is None else getattr(torch, dtype)
        self.net.to(self.input_dtype)

    def forward(self, inputs: torch.Tensor, data_samples: torch.Tensor | None = None, mode: str = "tensor"):
        logits = self.net(inputs.to(self.input_dtype)).float()
        if mode == "loss":
            return dict(loss=F.cross_entropy(logits, data_samples))
        if mode == "predict":
            losses = F.cross_entropy(logits, data_samples, reduction="none")
            return [dict(pred=int(p), label=int(t), loss=float(l))
                    for p, t, l in zip(logits.argmax(1), data_samples, losses)]
        return logits


@METRICS.register_module()
class DigitsAccuracy(BaseMetric):
    """``digits/accuracy`` (percent) and mean cross-entropy ``digits/loss`` over the validation set."""

    default_prefix = "digits"  # the message hub gets val/digits/accuracy, val/digits/loss

    def process(self, data_batch, data_samples: list[dict]) -> None:
        self.results.extend(data_samples)

    def compute_metrics(self, results: list[dict]) -> dict:
        n = len(results)
        return dict(accuracy=100.0 * sum(r["pred"] == r["label"] for r in results) / n,
                    loss=sum(r["loss"] for r in results) / n)
