"""AdaScale in real training loops: each case works with ours and fails with fairscale 0.4.13
(closures, short windows, frozen params, params without grads, GradScaler, zero_grad, checkpoints
mid-window, weights_only loading, scale changes across a checkpoint, Lightning's optimizer wrapper),
and steps and loads that raise, which leave everything as it was."""

import copy
import gc
import io
import pickle

import pytest
import torch
from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

import fused_optim
from adascale_loops import backward_window, micro_batch, model_and_groups, step_windows
from fused_optim import AdaScale


def ours(inner, accum=2, **kw):
    return AdaScale(inner, world_size=1, num_gradients_to_accumulate=accum, **kw)


def fairscale(inner, accum=2):
    return FairscaleAdaScale(inner, world_size=1, num_gradients_to_accumulate=accum)


def sgd(groups):
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def closure_loop(wrap, steps=4, accum=2):
    """Lightning's pattern: the window's last backward runs inside step(closure)."""
    model, groups = model_and_groups(two_groups=False)
    opt = wrap(torch.optim.SGD(groups, lr=0.1))
    for step in range(steps):
        backward_window(model, step, accum, accum - 1)

        def closure(step=step):
            x, y = micro_batch(step, accum - 1)
            loss = torch.nn.functional.mse_loss(model(x), y) / accum
            loss.backward()
            return loss

        opt.step(closure)
        opt.zero_grad()
    return opt


def test_step_with_closure_runs_it_first():
    opt = closure_loop(ours)
    assert opt.gain() > 1.0 and opt.scale_invariant_steps > 4.0
    with pytest.raises(AssertionError, match="Don't step without finishing backward phase"):
        closure_loop(fairscale)


def test_short_last_window_uses_the_backward_passes_seen():
    model, groups = model_and_groups(two_groups=False)
    opt = ours(sgd(groups), accum=4)
    for step, micro in enumerate([4, 4, 3, 4, 1]):  # an epoch ending with 3, then with 1 backward
        backward_window(model, step, 4, micro)
        before = opt.state_dict()["adascale"]
        opt.step()
        opt.zero_grad()
        after = opt.state_dict()["adascale"]
        assert after["backwards"] == 0
        if micro == 1:  # one micro-batch on one rank: no variance estimate, averages kept
            assert torch.equal(before["grad_var_avg"], after["grad_var_avg"])
        else:
            assert not torch.equal(before["grad_var_avg"], after["grad_var_avg"])
    assert all(torch.isfinite(p).all() for p in model.parameters()) and opt.gain(scale=4) > 1.0
    # the last step's window held one micro-batch (S = 1): it applied gain 1, and gain() says so
    assert opt.gain() == 1.0 and opt.gain(pg_idx=0) == 1.0
    model, groups = model_and_groups(two_groups=False)
    ref = fairscale(sgd(groups), accum=4)
    with pytest.raises(AssertionError):  # on the short window's next backward
        for step, micro in enumerate([3, 4]):
            backward_window(model, step, 4, micro)
            ref.step()
            ref.zero_grad()


def test_gain_after_a_step_is_the_gain_that_step_applied():
    """After a short window (3 of 4 micro-batches) the step multiplied the lr by the gain at S = 3:
    gain() then returns that, not the gain at S = 4; a full window's step, the gain at S = 4."""
    model, groups = model_and_groups(two_groups=False)
    opt = ours(sgd(groups), accum=4)
    for step, micro in enumerate([4, 4, 3]):
        backward_window(model, step, 4, micro)
        lr = opt.param_groups[0]["lr"]
        tau = opt.scale_invariant_steps
        opt.step()
        applied = opt.scale_invariant_steps - tau  # τ grows by the gain the step applied
        assert opt.gain() == pytest.approx(applied, rel=1e-12) and opt.param_groups[0]["lr"] == lr
        assert opt.gain() == opt.gain(scale=micro)
        opt.zero_grad()
    assert opt.gain() != opt.gain(scale=4)
    _, groups = model_and_groups(two_groups=False)
    fresh = ours(sgd(groups), accum=4)
    fresh.load_state_dict(opt.state_dict())  # the applied gain survives a checkpoint
    assert fresh.gain() == opt.gain()
    opt.set_scale(4.0)  # a new S: gain() answers for it
    assert opt.gain() == opt.gain(scale=4)


def test_frozen_params_and_params_without_grads():
    def setup():
        model, _ = model_and_groups(two_groups=False)
        model[0].weight.requires_grad_(False)
        extra = torch.nn.Parameter(torch.ones(3))  # in the optimizer, never in the graph
        return model, extra, fused_optim.FusedSGD([*model.parameters(), extra], lr=0.1, momentum=0.9)

    model, extra, inner = setup()
    opt = ours(inner)
    frozen = model[0].weight.detach().clone()
    step_windows(model, opt, range(3))
    assert torch.equal(model[0].weight, frozen) and torch.equal(extra.detach(), torch.ones(3))
    assert opt.gain() > 1.0
    with pytest.raises(RuntimeError, match="doesn't require gradient"):  # fairscale hooks every param
        fairscale(setup()[2])
    model, extra, inner = setup()
    model[0].weight.requires_grad_(True)
    ref = fairscale(inner)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'pow'"):  # extra.grad is None
        backward_window(model, 0, 2)
    assert ref.gain() == 1.0  # no statistics


def scaler_run(wrap, use_scaler, overflow_at=None, steps=6):
    """A GradScaler loop (scaler.step: no unscale_ by the loop); `overflow_at`: that step's second
    micro-batch loss is inf. Returns the final params and (gain, τ or None) after every step."""
    model, groups = model_and_groups(two_groups=False)
    opt = wrap(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000) if use_scaler else None
    gains = []
    for step in range(steps):
        for m in range(2):
            x, y = micro_batch(step, m)
            loss = torch.nn.functional.mse_loss(model(x), y) / 2
            if step == overflow_at and m == 1:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        gains.append((opt.gain(), getattr(opt, "scale_invariant_steps", None)))
    return params_of(model), gains


def test_grad_scaler_divides_norms_by_the_scale_and_skips_overflow_windows():
    plain, plain_gains = scaler_run(ours, False)
    scaled, scaled_gains = scaler_run(ours, True)
    for p, q in zip(plain, scaled):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [g for g, _ in scaled_gains] == pytest.approx([g for g, _ in plain_gains], rel=1e-6)
    _, overflow_gains = scaler_run(ours, True, overflow_at=3)
    assert overflow_gains[3] == overflow_gains[2]  # nothing changed: no statistics, no τ
    assert all(torch.isfinite(torch.tensor(g)) for g, _ in overflow_gains)
    # fairscale takes the overflow window's statistics: its gain is NaN from then on
    _, ref_gains = scaler_run(fairscale, True, overflow_at=3)
    assert all(g == g for g, _ in ref_gains[:3]) and all(g != g for g, _ in ref_gains[3:])


def test_unscale_before_step_takes_the_scale_from_the_grad_scaler():
    """The loop unscales to clip: ``scaler.unscale_(opt)``; then only the scaler knows the scale."""

    def run(wrap, scaler_kw: bool, steps=4):
        model, groups = model_and_groups(two_groups=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        opt = wrap(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9), **({"grad_scaler": scaler} if scaler_kw else {}))
        for step in range(steps):
            for m in range(2):
                x, y = micro_batch(step, m)
                scaler.scale(torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # (no-op clip: same math as plain)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return params_of(model), opt.gain()

    plain, plain_gains = scaler_run(ours, False, steps=4)
    params, gain = run(ours, scaler_kw=True)
    assert gain == pytest.approx(plain_gains[-1][0], rel=1e-6)
    for p, q in zip(plain, params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        run(ours, scaler_kw=False)


@pytest.mark.parametrize("give_scaler", [True, False], ids=["grad_scaler-given", "grad_scaler-not-given"])
def test_gain_before_step_under_a_grad_scaler(give_scaler):
    """gain() between the last backward and scaler.step() is the gain step() applies when AdaScale
    knows the scaler; without it, it warns that it assumes the last step's loss scale."""
    model, groups = model_and_groups(two_groups=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)  # the scale changes every 2 steps
    opt = ours(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9), **({"grad_scaler": scaler} if give_scaler else {}))
    mismatches = 0
    for step in range(6):
        for m in range(2):
            x, y = micro_batch(step, m)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        if give_scaler or step != 1:
            before = opt.gain()
        else:  # once, at the first gain() after an AMP step
            with pytest.warns(UserWarning, match="grad_scaler=scaler"):
                before = opt.gain()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        mismatches += before != opt.gain()
    assert scaler.get_scale() > 1024.0  # the scale grew during the run
    assert mismatches == 0 if give_scaler else mismatches > 0


def test_zero_grad_drops_an_abandoned_window():
    """A loop that gives up a window (say a bad batch): zero_grad() without step()."""

    def run(wrap, abandon: bool):
        model, groups = model_and_groups(two_groups=False)
        opt = wrap(sgd(groups))
        for step in range(4):
            if abandon and step == 2:
                backward_window(model, 99, 2, passes=1)
                opt.zero_grad()
            backward_window(model, step, 2)
            opt.step()
            opt.zero_grad()
        return params_of(model), opt.gain()

    (plain, plain_gain), (params, gain) = run(ours, False), run(ours, True)
    assert gain == plain_gain and all(torch.equal(p, q) for p, q in zip(plain, params))
    with pytest.raises(AssertionError, match="Don't zero_grad in backward"):
        run(fairscale, True)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none(set_to_none):
    model, groups = model_and_groups(two_groups=False)
    opt = ours(sgd(groups))
    backward_window(model, 0, 2)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    grads = [p.grad for p in model.parameters()]
    assert all(g is None for g in grads) if set_to_none else all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    model, groups = model_and_groups(two_groups=False)
    with pytest.raises(TypeError, match="set_to_none"):
        fairscale(sgd(groups)).zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("saved_after", [1, 2], ids=["mid-window", "after-the-last-backward"])
def test_state_dict_mid_window_loads_with_weights_only_and_continues_identically(saved_after):
    """Saved after the window's first backward, or after its last (its statistics are taken then,
    and step() has not consumed them yet)."""

    def start():
        model, groups = model_and_groups(two_groups=True)
        return model, ours(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9))

    def backward(model, step, m):
        x, y = micro_batch(step, m)
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()

    model, opt = start()
    step_windows(model, opt, range(4))
    for m in range(saved_after):
        backward(model, 4, m)
    gain_before_save = opt.gain()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "grads": [p.grad.clone() for p in model.parameters()]}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = start()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for p, g in zip(model2.parameters(), ckpt["grads"]):
        p.grad = g
    assert opt2.gain() == gain_before_save
    for m, o in ((model, opt), (model2, opt2)):
        if saved_after == 1:
            backward(m, 4, 1)
        o.step()
        o.zero_grad()
        step_windows(m, o, range(5, 8))
    assert opt.gain() == opt2.gain() and opt.scale_invariant_steps == opt2.scale_invariant_steps
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def trained_three_windows():
    """A two-group model and our AdaScale over FusedSGD after three full windows of 2."""
    model, groups = model_and_groups(two_groups=True)
    opt = ours(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9))
    step_windows(model, opt, range(3))
    return model, opt


class _Injected(Exception):
    pass


def _raise_injected(*args, **kwargs):
    raise _Injected()


@pytest.mark.parametrize("passes", [2, 1], ids=["full-window", "short-window"])
def test_an_inner_step_that_raises_leaves_the_statistics_and_the_window(passes):
    """The inner optimizer's step raises once (fault injection) at the third window, a full one or
    a short one (ended by step()): the state dict (averages, window sums, τ) is as before the
    step, and stepping again continues exactly as an unbroken run."""
    runs = []
    for inject in (False, True):
        model, groups = model_and_groups(two_groups=True)
        opt = ours(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9))
        for step in range(5):
            backward_window(model, step, 2, passes if step == 2 else None)
            if inject and step == 2:
                before = opt.state_dict()
                inner_step = opt._optimizer.step
                opt._optimizer.step = _raise_injected
                with pytest.raises(_Injected):
                    opt.step()
                opt._optimizer.step = inner_step
                after = opt.state_dict()
                assert before.keys() == after.keys() and before["adascale"].keys() == after["adascale"].keys()
                for key, value in before["adascale"].items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["adascale"][key])), key
            opt.step()
            opt.zero_grad()
        runs.append((params_of(model), opt.scale_invariant_steps, opt.gain()))
    assert runs[0][1:] == runs[1][1:]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0], runs[1][0]))


def test_a_state_dict_that_does_not_load_leaves_tau():
    """An optimizer state with another number of groups raises (torch's check) before τ, the
    averages or the inner optimizer change."""
    model, opt = trained_three_windows()
    before = opt.state_dict()
    bad = {**before, "param_groups": before["param_groups"][:1],
           "adascale": {**before["adascale"], "scale_invariant_steps": 99.0}}
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(bad)
    assert opt.scale_invariant_steps == before["adascale"]["scale_invariant_steps"] != 99.0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_made_mid_window_continues_as_the_original(how):
    """``copy.deepcopy`` / pickle of (model, AdaScale) after the window's first backward (and the
    grads so far): the copy hooks its own params (the original keeps its hooks), and both, fed the
    same micro-batches, end with the same params and τ, bit for bit."""
    model, opt = trained_three_windows()
    backward_window(model, 3, 2, passes=1)
    copied = copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
    for p, q in zip(copied[0].parameters(), model.parameters()):
        p.grad = q.grad.clone()  # (a copied Parameter has no grad)
    for m, o in ((model, opt), copied):
        x, y = micro_batch(3, 1)
        (torch.nn.functional.mse_loss(m(x), y) / 2).backward()
        o.step()
        o.zero_grad()
        step_windows(m, o, range(4, 7))
    assert copied[1].scale_invariant_steps == opt.scale_invariant_steps
    assert all(torch.equal(p, q) for p, q in zip(copied[0].parameters(), model.parameters()))


def test_a_pickle_from_before_fsdp2_support_unpickles_and_steps(monkeypatch):
    """A pickle made before AdaScale watched FSDP2's params lacks their attributes (``_fsdp2``,
    ``_unseen``): unpickled, it steps as the original does, bit for bit."""
    model, opt = trained_three_windows()
    getstate = type(opt).__getstate__
    newer = ("_fsdp2", "_unseen")
    monkeypatch.setattr(type(opt), "__getstate__", lambda self: {k: v for k, v in getstate(self).items()
                                                                 if k not in newer})
    copied = pickle.loads(pickle.dumps((model, opt)))
    monkeypatch.undo()
    for m, o in ((model, opt), copied):
        step_windows(m, o, range(3, 5))
    assert copied[1].scale_invariant_steps == opt.scale_invariant_steps
    assert all(torch.equal(p, q) for p, q in zip(copied[0].parameters(), model.parameters()))


def test_fairscale_cannot_checkpoint_mid_window_nor_load_weights_only():
    model, groups = model_and_groups(two_groups=False)
    ref = fairscale(sgd(groups))
    backward_window(model, 0, 2)
    ref.step()
    ref.zero_grad()
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    # its statistics are numpy arrays, which torch's weights-only loader refuses unless they are
    # allowed process-wide (importing mmengine_optim allows them, for mmengine's checkpoints)
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(Exception, match="Weights only load failed"):
            torch.load(buf, weights_only=True)
    finally:
        torch.serialization.add_safe_globals(allowed)
    backward_window(model, 1, 2, passes=1)
    with pytest.raises(AssertionError, match="Don't checkpoint in backward"):
        ref.state_dict()


def test_scale_accumulation_and_smoothing_changes_survive_a_checkpoint():
    def changed(wrap):
        model, groups = model_and_groups(two_groups=False)
        opt = wrap(sgd(groups))
        backward_window(model, 0, 2)
        opt.step()
        opt.zero_grad()
        opt.set_scale(3.0)
        opt.set_num_gradients_to_accumulate(4)
        state = opt.state_dict()
        _, groups = model_and_groups(two_groups=False)
        fresh = wrap(sgd(groups))
        fresh.load_state_dict(state)
        return opt, fresh

    opt, fresh = changed(ours)
    assert (fresh.scale, fresh.smoothing, fresh.gain()) == (3.0, opt.smoothing, opt.gain())
    assert fresh.state_dict()["adascale"]["num_gradients_to_accumulate"] == 4
    opt, fresh = changed(fairscale)
    assert opt.scale == 3.0 and fresh.scale == 2.0  # fairscale's checkpoint forgets the change


def test_survives_lightnings_optimizer_wrapper_being_discarded():
    """Lightning wraps the optimizer in a LightningOptimizer whose class derives from the
    optimizer's and discards it; an inherited ``__del__`` then removes the live hooks."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    def gain_after_wrapper_discarded(wrap):
        model, groups = model_and_groups(two_groups=False)
        opt = wrap(sgd(groups))
        wrapper = LightningOptimizer(opt)
        del wrapper
        gc.collect()
        step_windows(model, opt, range(3))
        return opt.gain()

    assert "__del__" not in vars(AdaScale)
    assert gain_after_wrapper_discarded(ours) > 1.0
    assert gain_after_wrapper_discarded(fairscale) == 1.0  # its hooks are gone: no statistics


def test_unhook_removes_the_hooks():
    model, groups = model_and_groups(two_groups=False)
    opt = ours(sgd(groups))
    opt.unhook()
    backward_window(model, 0, 2)
    assert opt.state_dict()["adascale"]["backwards"] == 0


def test_cpp_hooks_equal_the_python_hooks(monkeypatch):
    """The C++ hooks (where the kernels build) and their Python twin (other devices, failed
    builds) take the same statistics and count the same backward passes, short windows and
    closures included."""

    def run():
        model, groups = model_and_groups(two_groups=True)
        opt = ours(sgd(groups), accum=3)
        for step in range(4):
            backward_window(model, step, 3, passes=2 if step == 2 else 3)  # a short window
            opt.step(lambda: None)
            opt.zero_grad()
        backward_window(model, 4, 3, passes=2)  # a window in progress
        return type(opt._hooks[0]).__name__, opt.state_dict()["adascale"], params_of(model)

    native = run()
    monkeypatch.setattr(fused_optim.adascale, "_native_hooks_work", lambda params: False)
    python = run()
    assert (native[0], python[0]) == ("_NativeHook", "RemovableHandle")
    assert native[1]["backwards"] == python[1]["backwards"] == 2
    assert all(torch.equal(native[1][k], python[1][k]) if isinstance(native[1][k], torch.Tensor)
               else native[1][k] == python[1][k] for k in native[1])
    assert all(torch.equal(p, q) for p, q in zip(native[2], python[2]))
