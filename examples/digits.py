"""The examples' data and model: scikit-learn's 8×8 handwritten digits (1797 real images that
ship inside scikit-learn, no download) and a small CNN for them. Used by the mmengine configs
and the demo; not needed by the optimizers."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fused_optim.optional import require

VAL_FRACTION = 0.2


def load_digits(split: str, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(images, labels)`` of the ``"train"`` or ``"val"`` split: images float32 [N, 1, 8, 8]
    scaled to [0, 1], labels int64 in 0..9. The split is a fixed permutation by ``seed`` with
    ``VAL_FRACTION`` of the images held out (359 val, 1438 train)."""
    if split not in ("train", "val"):
        raise ValueError(f"Invalid split: {split!r} ('train' or 'val')")
    data = require("sklearn.datasets", "examples", "the digits dataset").load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * VAL_FRACTION)
    index = order[:n_val] if split == "val" else order[n_val:]
    return images[index], labels[index]


class DigitsCNN(nn.Module):
    """conv(1→16, 3×3) → ReLU → conv(16→32, 3×3, stride 2) → ReLU → flatten → linear(512→10):
    logits for 1×8×8 images."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
        )
        self.head = nn.Linear(2 * width * 16, 10)

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))
