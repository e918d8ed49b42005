"""SGD-family state loaded into an optimizer of another state format or with master weights
switched on continues the saved trajectory: the converted momentum buffer is not a new one."""

import io
import itertools

import pytest
import torch

import fused_optim
from fused_optim import state_formats as sf

OPTIMIZERS = {
    "fused_sgd": (fused_optim.FusedSGD, {}),
    "sgd": (fused_optim.SGD, {}),
    "lars": (fused_optim.LARS, {}),
    "colossal_lars": (fused_optim.ColossalLars, {}),
    "sign_sgd": (fused_optim.SignSGD, {}),
}
FORMATS = [(state_dtype, master) for state_dtype in (None, "bfloat16", "8bit") for master in (False, True)]
PAIRS = list(itertools.product(FORMATS, FORMATS))
NUMEL = 600  # three 8-bit blocks, the last one partial
LR, MOMENTUM = 0.01, 0.9


def _unit_roundoff(state_dtype, master: bool) -> float:
    """The largest relative error of storing a momentum buffer element in a format, for the bf16
    params used here: fp32 (master weights, no state_dtype) 2^-24; bf16 (state_dtype bf16, or
    the param's own dtype without masters) half a unit in the last place of an 8-bit significand,
    2^-8; 8-bit
    codes of a signed moment (3 mantissa bits) half a gap of the entries, 2^-4, plus the
    subnormal entries' absolute error of at most 2^-19 · absmax / top, bounded here by 2^-18 of
    the largest magnitude (see fused_optim/state_formats.py)."""
    if state_dtype == "8bit":
        return 2.0 ** -4 + 2.0 ** -18
    if state_dtype == "bfloat16" or not master:
        return 2.0 ** -8
    return 2.0 ** -24


def _grads(n: int, mean: float, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(mean + 0.1 * torch.randn(NUMEL, generator=gen)).to(torch.bfloat16) for _ in range(n)]


def _make(cls, hyper, param, fmt):
    state_dtype, master = fmt
    return cls([param], lr=LR, momentum=MOMENTUM, master_weights=master, state_dtype=state_dtype, **hyper)


def _checkpoint(opt) -> dict:
    """The optimizer's state dict through torch.save and a weights_only torch.load (a state
    dict loaded as it is shares its tensors with the optimizer that made it, as torch's do)."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _buffer(opt, p) -> torch.Tensor:
    st = opt.state[p]
    buf = st["momentum_buffer"]
    if buf.dtype == torch.uint8:
        return sf.decode_8bit(buf, st[sf.absmax_key("momentum_buffer")], True)
    return buf.float()


def _step(opt, p, grad) -> None:
    p.grad = grad.clone()
    opt.step()


@pytest.mark.parametrize("saved,loaded", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_loaded_momentum_buffer_continues_in_every_format(name, saved, loaded):
    """Four steps with grads of mean 1 grow the buffer to about 3.4; the state is saved and
    loaded into an optimizer of the format ``loaded``, which steps next to the saved optimizer
    with grads of mean 0 (a buffer restarted from the grad would be about 0.1, not 3.1).

    Tolerance, for one step after the load (u_s, u_t: the unit roundoffs of the saved and the
    loaded format, M the largest buffer magnitude): the saved optimizer stores Q_s(μ·b + g), the
    loaded one Q_t(μ·Q_t(b) + g); their difference is at most u_s·M + u_t·M + μ·u_t·M <
    (u_s + 2·u_t)·M. The params (bf16, small) then differ by at most lr·(that) for the plain
    rules (LARS without weight decay is SGD; ColossalLars scales lr by at most 1 here; SignSGD's
    signs agree where the buffers are far from 0), plus the bf16 rounding of each side's param
    (half an ulp each) and the half ulp between a master and its bf16 param at the load: 1.5 ulp,
    2^-7 · 1.5 of the largest param magnitude."""
    cls, hyper = OPTIMIZERS[name]
    torch.manual_seed(0)
    p = torch.nn.Parameter((0.01 * torch.randn(NUMEL)).to(torch.bfloat16))
    q = torch.nn.Parameter(p.detach().clone())
    first = _make(cls, hyper, p, saved)
    for g in _grads(4, 1.0, seed=1):
        _step(first, p, g)
    with torch.no_grad():
        q.copy_(p)
    second = _make(cls, hyper, q, loaded)
    second.load_state_dict(_checkpoint(first))
    (g,) = _grads(1, 0.0, seed=2)
    # A group's options are the checkpoint's, as torch loads them, but for state_dtype (the
    # loading optimizer's choice) and master_weights, which a group without the key takes
    # from the loading optimizer's defaults: masters are on where either side has them.
    loaded = (loaded[0], saved[1] or loaded[1])
    assert second.param_groups[0].get("master_weights", False) == loaded[1]
    before = _buffer(first, p)
    _step(first, p, g)
    _step(second, q, g)
    a, b = _buffer(first, p), _buffer(second, q)
    largest = max(before.abs().max().item(), a.abs().max().item(), b.abs().max().item())
    assert largest > 3.0  # the buffer the load must keep
    tol = (_unit_roundoff(*saved) + 2 * _unit_roundoff(*loaded)) * largest
    assert (a - b).abs().max().item() <= tol
    param_tol = LR * tol + 1.5 * 2.0 ** -7 * max(p.abs().max().item(), q.abs().max().item())
    assert (p.float() - q.float()).abs().max().item() <= param_tol
    assert (p.float() - q.float()).abs().max().item() < LR * 0.5 or name == "colossal_lars"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_new_param_s_first_step_still_starts_its_buffer_from_the_grad(name):
    """The first-step rule (buffer = grad) still runs for a param whose buffer is made, also
    when a master is made with it."""
    cls, hyper = OPTIMIZERS[name]
    p = torch.nn.Parameter(torch.zeros(NUMEL, dtype=torch.bfloat16))
    opt = _make(cls, hyper, p, (None, True))
    (g,) = _grads(1, 1.0, seed=3)
    _step(opt, p, g)
    expected = g.float().clamp(-10, 10) if name == "colossal_lars" else g.float()
    assert torch.equal(_buffer(opt, p), expected)
