"""Half-precision training with fp32 master weights through Lightning: ``precision="bf16-true"``
with an optimizer of ``master_weights=True``, and fp16 (``ScaledHalfPrecision``: 16-true plus a
dynamic loss scale), each against a hand-written loop on the same batches, and resumed from a
checkpoint."""

import lightning.pytorch as pl
import pytest
import torch

import fused_optim
import lightning_optim
from adascale_loops import micro_batch, model_and_groups

FAST = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0)
BATCHES = 4  # per epoch


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        return micro_batch(0, i)


def adam(params):
    return fused_optim.FusedAdam(params, lr=1e-2, weight_decay=1e-2, master_weights=True, fused=True)


def sr_adam(params):
    """Pure bf16 training: stochastically rounded params, 8-bit moments, no master weights."""
    return fused_optim.AdamW(params, lr=1e-2, stochastic_rounding=True, state_dtype="8bit", fused=True)


class Regressor(pl.LightningModule):
    def __init__(self, make_optimizer=adam):
        super().__init__()
        self.net = model_and_groups(two_groups=False)[0]
        self.make_optimizer = make_optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.net.parameters())


def _fit(epochs, precision, ckpt_path=None, make_optimizer=adam, **kw):
    module = Regressor(make_optimizer)
    plugins = [lightning_optim.ScaledHalfPrecision(device="cpu", init_scale=2.0**10, growth_interval=3)] \
        if precision == "16-true-scaled" else []
    trainer = pl.Trainer(max_epochs=epochs, plugins=plugins, **{**FAST, **kw},
                         **({} if plugins else {"precision": precision}))
    trainer.fit(module, torch.utils.data.DataLoader(Batches(), batch_size=None), ckpt_path=ckpt_path)
    return module, trainer


def _hand_loop(epochs, dtype, scaled, make_optimizer=adam):
    """The same training written out: the model cast to ``dtype``, inputs cast, and with
    ``scaled`` GradScaler's loss scaling with its step and update."""
    model = model_and_groups(two_groups=False)[0].to(dtype)
    opt = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) if scaled else None
    for _ in range(epochs):
        for i in range(BATCHES):
            x, y = micro_batch(0, i)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y.to(dtype))  # Lightning casts the batch
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    return model, opt, scaler


@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("16-true-scaled", torch.float16)])
def test_half_training_with_master_weights_equals_the_hand_loop_and_resumes(precision, dtype, tmp_path):
    whole, trainer = _fit(2, precision)
    model, opt, scaler = _hand_loop(2, dtype, precision == "16-true-scaled")
    ours = trainer.optimizers[0]
    for p, q in zip(whole.net.parameters(), model.parameters()):
        assert p.dtype == dtype
        assert torch.equal(p, q)  # the same ops in the same order: bit for bit
        assert torch.equal(ours.state[p]["master_param"], opt.state[q]["master_param"])
        assert torch.equal(p, ours.state[p]["master_param"].to(dtype))
    if scaler is not None:
        assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale() > 2.0**10  # it grew
    _fit(1, precision, enable_checkpointing=True, default_root_dir=tmp_path)
    (ckpt,) = tmp_path.rglob("*.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    assert all(s["master_param"].dtype == torch.float32 for s in saved["optimizer_states"][0]["state"].values())
    resumed, resumed_trainer = _fit(2, precision, ckpt_path=str(ckpt))
    for p, q in zip(resumed.net.parameters(), whole.net.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(resumed_trainer.optimizers[0].state[p]["master_param"], ours.state[q]["master_param"])


def test_pure_bf16_training_with_stochastic_rounding_equals_the_hand_loop_and_resumes(tmp_path):
    """bf16-true with AdamW(stochastic_rounding=True, state_dtype="8bit"): the same steps as the
    hand loop bit for bit (the random bits come from the rounding keys in the state), and a run
    resumed from a checkpoint (uint8 codes, absmaxes and keys in it) continues exactly."""
    whole, trainer = _fit(2, "bf16-true", make_optimizer=sr_adam)
    model, _, _ = _hand_loop(2, torch.bfloat16, False, make_optimizer=sr_adam)
    for p, q in zip(whole.net.parameters(), model.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    _fit(1, "bf16-true", make_optimizer=sr_adam, enable_checkpointing=True, default_root_dir=tmp_path)
    (ckpt,) = tmp_path.rglob("*.ckpt")
    states = torch.load(ckpt, weights_only=True)["optimizer_states"][0]["state"].values()
    assert all(s["exp_avg"].dtype == torch.uint8 and s["rounding_key"].dtype == torch.int64 for s in states)
    resumed, resumed_trainer = _fit(2, "bf16-true", make_optimizer=sr_adam, ckpt_path=str(ckpt))
    for p, q in zip(resumed.net.parameters(), whole.net.parameters()):
        assert torch.equal(p, q)
        for key, value in trainer.optimizers[0].state[q].items():
            assert torch.equal(resumed_trainer.optimizers[0].state[p][key], value), key


def test_scaled_half_precision_refuses_an_optimizer_that_cannot_unscale_fp16_grads():
    class WithTorchSGD(Regressor):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(max_steps=1, plugins=[lightning_optim.ScaledHalfPrecision(device="cpu")], **FAST)
    with pytest.raises(TypeError, match="SGD does not unscale inside its step"):
        trainer.fit(WithTorchSGD(), torch.utils.data.DataLoader(Batches(), batch_size=None))
