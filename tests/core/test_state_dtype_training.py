"""200 steps of two small real tasks with compact optimizer state, against the same run with
fp32 state: the digits CNN (scikit-learn's 8x8 digits, examples.digits) and a small
transformer language model on generated text (a fixed random Markov chain over 12 tokens).

Tolerance: the loss over the whole training set after 200 steps may differ from the fp32-state
run's by LOSS_TOL = 0.01. Compact state perturbs each step by the rounding of the moments (bf16:
2^-9 relative; 8-bit: up to 0.7% of a block's largest moment), after which two runs follow
different but equally good trajectories; what matters is that they train as well. The scale of
"equally good": the fp32-state digits run itself ends between 0.077 and 0.097 over five batch
orders (a spread of 0.02, measured); 0.01 is half of that. Measured differences: <= 0.0013
(digits), <= 0.0005 (language model). LAMB (lr 1e-2) on the digits: its fp32-state run ends
between 0.092 and 0.118 over five batch orders (spread 0.026); bf16 / 8-bit / stochastic bf16
state differ from it by 0.0035 / 0.0030 / 0.0021 (measured). The kernels and the reference implementation of one format
follow the same rule against each other (their fp32 arithmetic differs in fused multiply-adds,
which moves a value across a rounding boundary now and then)."""

import pytest
import torch
from torch.nn import functional as F

import fused_optim

pytest.importorskip("sklearn")
from examples.digits import DigitsCNN, load_digits  # noqa: E402
from examples.tiny_lm import TinyLM, lm_loss, markov_text  # noqa: E402

# Each test trains a model for 200 steps (seconds each).
pytestmark = pytest.mark.slow

STEPS = 200
LOSS_TOL = 0.01
FORMATS = {
    "bf16": dict(state_dtype=torch.bfloat16),
    "bf16-stochastic": dict(state_dtype=torch.bfloat16, state_rounding="stochastic"),
    "8bit": dict(state_dtype="8bit"),
}


def _digits_run(cls, hyper, fused, dtype=torch.float32, **kwargs) -> float:
    images, labels = load_digits("train")
    images = images.to(dtype)
    torch.manual_seed(0)
    model = DigitsCNN(8).to(dtype)
    opt = cls(model.parameters(), fused=fused, **hyper, **kwargs)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        index = torch.randint(0, len(labels), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(images[index]).float(), labels[index]).backward()
        opt.step()
    assert opt.implementation == ("fused" if fused else "reference")
    with torch.no_grad():
        return F.cross_entropy(model(images).float(), labels).item()


def _lm_run(fused, **kwargs) -> float:
    data = markov_text(1024)
    torch.manual_seed(0)
    model = TinyLM()
    opt = fused_optim.AdamW(model.parameters(), lr=3e-3, fused=fused, **kwargs)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        opt.zero_grad()
        lm_loss(model, data[torch.randint(0, len(data), (16,), generator=g)]).backward()
        opt.step()
    assert opt.implementation == ("fused" if fused else "reference")
    with torch.no_grad():
        return lm_loss(model, data[:256]).item()


LAMB = dict(lr=1e-2)  # FusedLAMB's defaults otherwise: weight decay 0.01 (the trust ratio), clipping at 1


@pytest.fixture(scope="module")
def fp32_state_losses():
    return {"digits": _digits_run(fused_optim.AdamW, dict(lr=3e-3), True),
            "digits-sgd": _digits_run(fused_optim.SGD, dict(lr=0.05, momentum=0.9), True),
            "digits-lamb": _digits_run(fused_optim.FusedLAMB, LAMB, True),
            "lm": _lm_run(True)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_digits_cnn_trains_as_with_fp32_state(fmt, fp32_state_losses):
    kernel = _digits_run(fused_optim.AdamW, dict(lr=3e-3), True, **FORMATS[fmt])
    reference = _digits_run(fused_optim.AdamW, dict(lr=3e-3), False, **FORMATS[fmt])
    assert abs(kernel - fp32_state_losses["digits"]) <= LOSS_TOL
    assert abs(kernel - reference) <= LOSS_TOL
    assert kernel < 0.2  # it learned: ln(10) = 2.3 at the start


def test_digits_cnn_with_8bit_sgd_momentum_trains_as_with_fp32_state(fp32_state_losses):
    hyper = dict(lr=0.05, momentum=0.9)
    kernel = _digits_run(fused_optim.SGD, hyper, True, state_dtype="8bit")
    reference = _digits_run(fused_optim.SGD, hyper, False, state_dtype="8bit")
    assert abs(kernel - fp32_state_losses["digits-sgd"]) <= LOSS_TOL
    assert abs(kernel - reference) <= LOSS_TOL


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_digits_cnn_with_compact_lamb_state_trains_as_with_fp32_state(fmt, fp32_state_losses):
    """LAMB's two passes: the update from the moments as stored (encoded), ||u|| from the new ones.
    The kernels only (their steps equal the reference's code for code: test_state_dtype.py)."""
    kernel = _digits_run(fused_optim.FusedLAMB, LAMB, True, **FORMATS[fmt])
    assert abs(kernel - fp32_state_losses["digits-lamb"]) <= LOSS_TOL
    assert kernel < 0.2


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformer_lm_trains_as_with_fp32_state(fmt, fp32_state_losses):
    kernel = _lm_run(True, **FORMATS[fmt])
    reference = _lm_run(False, **FORMATS[fmt])
    assert abs(kernel - fp32_state_losses["lm"]) <= LOSS_TOL
    assert abs(kernel - reference) <= LOSS_TOL
    assert kernel < 1.5  # it learned the chain: ln(12) = 2.48 at the start


def test_pure_bf16_digits_cnn_with_stochastic_rounding_trains_as_fp32(fp32_state_losses):
    """bf16 params, grads and state, no master weights: stochastic rounding of the params (and
    the state) keeps the updates smaller than half a bf16 ulp that rounding to nearest drops."""
    kwargs = dict(stochastic_rounding=True, state_rounding="stochastic")
    kernel = _digits_run(fused_optim.AdamW, dict(lr=3e-3), True, dtype=torch.bfloat16, **kwargs)
    reference = _digits_run(fused_optim.AdamW, dict(lr=3e-3), False, dtype=torch.bfloat16, **kwargs)
    assert abs(kernel - fp32_state_losses["digits"]) <= LOSS_TOL
    assert abs(kernel - reference) <= LOSS_TOL
