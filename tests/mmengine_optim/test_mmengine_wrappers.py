"""mmengine_optim's OptimWrappers without a Runner: AdaScale equivalence, fused clipping, loss
scaling, state, errors."""

import copy

import pytest
import torch
from mmengine.logging import MessageHub
from mmengine.optim import OptimWrapper

from fused_optim import AdaScale, FusedAdam, FusedSGD
from fused_optim.metrics import GAIN, LR, TAU
from mmengine_optim import AdaScaleOptimWrapper, FusedOptimWrapper, LossScaler
from adascale_loops import backward_window, micro_batch, model_and_groups

STEPS = 10


def _mse(model, step, micro):
    x, y = micro_batch(step, micro)
    return torch.nn.functional.mse_loss(model(x), y)


def _run_wrapper(wrapper, model, accum, steps=STEPS):
    """mmengine's train step: update_params per micro-batch (loss ÷ accum, step + zero_grad when due)."""
    for step in range(steps):
        for m in range(accum):
            wrapper.update_params(_mse(model, step, m))


@pytest.mark.parametrize("two_groups", [False, True])
def test_adascale_wrapper_equals_adascale_with_accumulation_2(two_groups):
    model_w, groups_w = model_and_groups(two_groups)
    wrapper = AdaScaleOptimWrapper(FusedSGD(groups_w, lr=0.1, momentum=0.9), accumulative_counts=2)
    model_a, groups_a = model_and_groups(two_groups)
    ada = AdaScale(FusedSGD(groups_a, lr=0.1, momentum=0.9), num_gradients_to_accumulate=2, global_gain=True)
    gains_w, gains_a = [], []
    for step in range(STEPS):
        for m in range(2):
            wrapper.update_params(_mse(model_w, step, m))
        gains_w.append(wrapper.gain)
        backward_window(model_a, step, 2)
        ada.step()
        ada.zero_grad()
        gains_a.append(ada.gain())
    assert gains_w == gains_a and len(set(gains_w)) > 1
    assert wrapper.scale_invariant_iter == ada.scale_invariant_steps > STEPS
    for pw, pa in zip(model_w.parameters(), model_a.parameters()):
        torch.testing.assert_close(pw, pa, rtol=0, atol=0)


def test_adascale_wrapper_has_one_gain_for_all_groups_and_logs_it():
    model, groups = model_and_groups(two_groups=True)
    wrapper = AdaScaleOptimWrapper(FusedSGD(groups, lr=0.1), accumulative_counts=2)
    seen = []
    inner_step = wrapper.optimizer._optimizer.step
    wrapper.optimizer._optimizer.step = lambda: (seen.append([g["lr"] for g in groups]), inner_step())[1]
    _run_wrapper(wrapper, model, 2, steps=3)
    hub = MessageHub.get_current_instance()
    gain = hub.get_scalar(f"train/{GAIN}").current()
    assert seen[-1] == pytest.approx([0.1 * gain, 0.05 * gain], rel=1e-12)  # one gain, both groups
    assert hub.get_scalar(f"train/{TAU}").current() == wrapper.scale_invariant_iter
    assert hub.get_scalar(f"train/{LR}").current() == pytest.approx(0.1 * gain)
    assert [g["lr"] for g in groups] == [0.1, 0.05]  # restored after the step


def test_adascale_wrapper_state_round_trip_starts_a_new_window():
    model, groups = model_and_groups(two_groups=False)
    wrapper = AdaScaleOptimWrapper(FusedSGD(groups, lr=0.1, momentum=0.9), accumulative_counts=2)
    _run_wrapper(wrapper, model, 2, steps=3)
    wrapper.backward(_mse(model, 3, 0) / 2)  # mid-window: mmengine does not save grads
    state = copy.deepcopy(wrapper.state_dict())
    model2, groups2 = model_and_groups(two_groups=False)
    fresh = AdaScaleOptimWrapper(FusedSGD(groups2, lr=0.1, momentum=0.9), accumulative_counts=2)
    fresh.load_state_dict(state)
    assert fresh.scale_invariant_iter == wrapper.scale_invariant_iter and fresh.gain == wrapper.gain
    assert fresh.optimizer._backwards == 0 and float(fresh.optimizer._local.sum()) == 0.0


def test_adascale_wrapper_needs_more_than_one_micro_batch():
    _, groups = model_and_groups(two_groups=False)
    with pytest.raises(RuntimeError, match="accumulative_counts=4"):
        AdaScaleOptimWrapper(FusedSGD(groups, lr=0.1), accumulative_counts=1)


def _clip_twins(clip_grad, loss_scale=None):
    model_f, groups_f = model_and_groups(two_groups=True)
    fused = FusedOptimWrapper(FusedAdam(groups_f, lr=0.01, weight_decay=0.01), 2, clip_grad=dict(clip_grad),
                              loss_scale=loss_scale)
    model_t, groups_t = model_and_groups(two_groups=True)
    stock = OptimWrapper(torch.optim.AdamW(groups_t, lr=0.01, weight_decay=0.01), 2, clip_grad=dict(clip_grad))
    return (model_f, fused), (model_t, stock)


@pytest.mark.parametrize("loss_scale", [None, 1024.0, "dynamic"])
@pytest.mark.parametrize("clip_grad", [dict(max_norm=0.05), dict(type="value", clip_value=0.01)])
def test_fused_wrapper_clips_like_mmengine(clip_grad, loss_scale):
    """Clipping folded into the kernels' divisor (by norm) or on the scaled grads (by value) equals
    mmengine's OptimWrapper clipping the unscaled grads; the clip is active at these thresholds."""
    (model_f, fused), (model_t, stock) = _clip_twins(clip_grad, loss_scale)
    hub = MessageHub.get_current_instance()
    for step in range(STEPS):
        for m in range(2):
            fused.update_params(_mse(model_f, step, m))
            if "max_norm" in clip_grad and m == 1:
                norm_f = hub.get_scalar("train/grad_norm").current()
            stock.update_params(_mse(model_t, step, m))
        if "max_norm" in clip_grad:
            norm_t = hub.get_scalar("train/grad_norm").current()
            assert norm_f == pytest.approx(norm_t, rel=1e-5) and norm_t > clip_grad["max_norm"]
    for pf, pt in zip(model_f.parameters(), model_t.parameters()):
        torch.testing.assert_close(pf, pt, rtol=1e-5, atol=1e-6)


def test_fused_wrapper_loss_scale_overflow_skips_and_backs_off():
    model, groups = model_and_groups(two_groups=False)
    wrapper = FusedOptimWrapper(FusedSGD(groups, lr=0.1, momentum=0.9), loss_scale=dict(init_scale=256.0,
                                growth_interval=2))
    wrapper.update_params(_mse(model, 0, 0))
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [wrapper.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    loss = _mse(model, 1, 0)
    loss.register_hook(lambda g: g * float("inf"))
    wrapper.update_params(loss)
    assert wrapper.loss_scaler.get_scale() == 128.0
    for p, b, m in zip(model.parameters(), before, momentum):
        assert torch.equal(p, b) and torch.equal(wrapper.optimizer.state[p]["momentum_buffer"], m)
    for step in (2, 3):
        wrapper.update_params(_mse(model, step, 0))
    assert wrapper.loss_scaler.get_scale() == 256.0  # two clean steps: grown back
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_fused_wrapper_amp_on_cpu_matches_torch_grad_scaler_run():
    """float16 autocast + dynamic loss scale on the CPU: the same updates as torch's GradScaler
    driving the same optimizer (which unscales in its kernel), state dict compatible with it."""
    model_f, groups_f = model_and_groups(two_groups=False)
    wrapper = FusedOptimWrapper(FusedAdam(groups_f, lr=0.01), loss_scale="dynamic")
    model_t, groups_t = model_and_groups(two_groups=False)
    opt_t = FusedAdam(groups_t, lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(STEPS):
        with wrapper.optim_context(model_f):
            loss_f = _mse(model_f, step, 0)
        assert loss_f.dtype == torch.float32 and model_f(torch.zeros(1, 8)).dtype == torch.float32
        wrapper.update_params(loss_f)
        with torch.autocast("cpu", dtype=torch.float16):
            loss_t = _mse(model_t, step, 0)
        scaler.scale(loss_t).backward()
        scaler.step(opt_t)
        scaler.update()
        opt_t.zero_grad()
    for pf, pt in zip(model_f.parameters(), model_t.parameters()):
        torch.testing.assert_close(pf, pt, rtol=0, atol=0)
    assert wrapper.state_dict()["loss_scaler"] == scaler.state_dict()
    with wrapper.optim_context(model_f):
        assert torch.get_autocast_dtype("cpu") == torch.float16 and torch.is_autocast_enabled("cpu")


def test_loss_scaler_state_round_trip_and_grad_scaler_compat():
    scaler = LossScaler.from_config(dict(init_scale=512.0, growth_interval=3))
    scaler.update(torch.tensor(1.0))
    scaler.update(torch.tensor(0.0))
    state = scaler.state_dict()
    assert state == {"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
                     "_growth_tracker": 1}
    other = LossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    grad_scaler = torch.amp.GradScaler("cpu")
    grad_scaler.load_state_dict(state)  # the format torch (and mmengine's AmpOptimWrapper) saves
    assert grad_scaler.get_scale() == 256.0
    static = LossScaler.from_config(8.0)
    static.update(torch.tensor(1.0))
    assert static.get_scale() == 8.0


@pytest.mark.parametrize("broken", ["optimizer", "loss scaler"])
def test_fused_wrapper_state_that_does_not_load_changes_nothing(broken):
    """A checkpoint whose optimizer state has another number of groups, or whose loss scaler state
    lacks a key, raises before the loss scaler or the optimizer change."""
    model, groups = model_and_groups(two_groups=True)
    wrapper = FusedOptimWrapper(FusedSGD(groups, lr=0.1, momentum=0.9), loss_scale=dict(init_scale=256.0,
                                growth_interval=3))
    wrapper.update_params(_mse(model, 0, 0))
    good = copy.deepcopy(wrapper.state_dict())
    wrapper.update_params(_mse(model, 1, 0))
    before = copy.deepcopy(wrapper.state_dict())
    bad = copy.deepcopy(good)
    bad["loss_scaler"]["scale"] = 3.0
    if broken == "optimizer":
        bad["param_groups"].pop()
    else:
        del bad["loss_scaler"]["growth_interval"]
    with pytest.raises((ValueError, KeyError)):
        wrapper.load_state_dict(bad)
    after = wrapper.state_dict()
    assert after["loss_scaler"] == before["loss_scaler"] == {**good["loss_scaler"], "_growth_tracker": 2}
    for k, state in before["state"].items():
        assert torch.equal(state["momentum_buffer"], after["state"][k]["momentum_buffer"])


def test_fused_wrapper_non_finite_norm_without_loss_scale_skips():
    model, groups = model_and_groups(two_groups=False)
    wrapper = FusedOptimWrapper(FusedSGD(groups, lr=0.1), clip_grad=dict(max_norm=1.0))
    before = [p.detach().clone() for p in model.parameters()]
    loss = _mse(model, 0, 0)
    loss.register_hook(lambda g: g * float("nan"))
    wrapper.update_params(loss)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    strict = FusedOptimWrapper(FusedSGD(groups, lr=0.1), clip_grad=dict(max_norm=1.0, error_if_nonfinite=True))
    loss = _mse(model, 0, 0)
    loss.register_hook(lambda g: g * float("nan"))
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        strict.update_params(loss)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(clip_grad=dict(max_norm=1.0, norm_type=1)), ValueError, "norm_type=1"),
    (dict(clip_grad=dict(max_nrom=1.0)), TypeError, "max_norm"),
    (dict(loss_scale="static"), ValueError, "loss_scale"),
    (dict(loss_scale=-1.0), ValueError, "loss_scale"),
    (dict(loss_scale="dynamic", dtype="float32"), ValueError, "dtype"),
    (dict(clip_grad=dict(max_norm="1.0")), ValueError, "max_norm='1.0' is not a number > 0"),
    (dict(clip_grad=dict(max_norm=-1.0)), ValueError, "max_norm=-1.0 is not a number > 0"),
    (dict(loss_scale=dict(growth_interval=0)), ValueError, "growth_interval: 0 .*an int >= 1"),
    (dict(loss_scale=dict(growth_factor=0.5)), ValueError, "growth_factor: 0.5 .*> 1"),
    (dict(loss_scale=dict(backoff_factor=2.0)), ValueError, "backoff_factor: 2.0 .*in \\(0, 1\\)"),
])
def test_fused_wrapper_bad_arguments(kwargs, error, match):
    _, groups = model_and_groups(two_groups=False)
    with pytest.raises(error, match=match):
        FusedOptimWrapper(FusedSGD(groups, lr=0.1), **kwargs)


def test_fused_wrapper_refuses_an_optimizer_that_cannot_unscale():
    _, groups = model_and_groups(two_groups=False)
    with pytest.raises(TypeError, match="SGD does not"):
        FusedOptimWrapper(torch.optim.SGD(groups, lr=0.1), loss_scale="dynamic")
    FusedOptimWrapper(torch.optim.SGD(groups, lr=0.1), clip_grad=dict(type="value", clip_value=1.0))  # fine


def test_fused_wrapper_clip_config_is_not_consumed():
    """mmengine's OptimWrapper pops 'type' from clip_grad; a config dict reused must survive."""
    _, groups = model_and_groups(two_groups=False)
    clip = dict(type="value", clip_value=1.0)
    FusedOptimWrapper(FusedSGD(groups, lr=0.1), clip_grad=clip)
    assert clip == dict(type="value", clip_value=1.0)
