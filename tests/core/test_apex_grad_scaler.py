"""apex's FusedAdam GradScaler tests (apex tests/L0/run_optimizers/test_adam.py: testGradScaler,
testGradScalerCapturableMaster), on the CPU with our FusedAdam.

As apex's: a small CNN and a copy of it, torch.optim.Adam on one and FusedAdam on the other,
each with its own GradScaler under autocast (fp16); after every one of 100 steps the weights and
the grads of every conv and linear layer agree within apex's 1e-3, then the copy is reset to the
reference's weights. The grads are compared after ``scaler.step``: torch's Adam leaves them
unscaled (GradScaler unscales before stepping it), so ours must too, though GradScaler hands
them to it scaled. The master variant keeps the copy's convs in fp16 with fp32 master weights
(apex's ``master_weights=True``; its ``capturable`` is CUDA-graph capture, which a CPU has not).
"""

import copy

import pytest
import torch
from torch import nn

import fused_optim


class Model(nn.Module):
    """apex's test model: two 5x5 convs with max pooling, three linear layers, ReLU after each."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
                                  nn.ReLU())

    def forward(self, x):
        return self.head(self.features(x).reshape(x.shape[0], -1))


def _scaled_step(model, optimizer, scaler, x, gt):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ((gt - model(x)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize("master", [False, True], ids=["GradScaler", "GradScalerMaster"])
def test_fused_adam_follows_torch_adam_under_grad_scaler(master):
    torch.manual_seed(0)
    model, model_ = Model(), Model()
    model_.load_state_dict(copy.deepcopy(model.state_dict()))
    if master:
        for m in model_.modules():
            if isinstance(m, nn.Conv2d):
                m.half()
    lr = 1e-5
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    optimizer_ = fused_optim.FusedAdam(model_.parameters(), lr=lr, adam_w_mode=False, master_weights=master,
                                       fused=True)
    scaler, scaler_ = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for _ in range(100):
        x = torch.rand([32, 1, 28, 28]).to(memory_format=torch.channels_last)
        gt = torch.rand([32, 10])
        _scaled_step(model, optimizer, scaler, x, gt)
        _scaled_step(model_, optimizer_, scaler_, x.clone(), gt.clone())
        for m, m_ in zip(model.modules(), model_.modules()):
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                torch.testing.assert_close(m.weight, m_.weight.float(), atol=1e-3, rtol=1e-3, equal_nan=True)
                torch.testing.assert_close(m.weight.grad, m_.weight.grad.float(), atol=1e-3, rtol=1e-3, equal_nan=True)
        optimizer.zero_grad()
        optimizer_.zero_grad()
        model_.load_state_dict(copy.deepcopy(model.state_dict()))
    assert optimizer_.implementation == "fused"
