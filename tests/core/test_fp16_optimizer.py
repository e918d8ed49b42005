"""FP16Optimizer: the replay of mlbench's FP16Optimizer (tests/golden/mlbench_fp16_optimizer.pt),
the loss-scale schedule, overflow steps, per-param vs flat masters, state dicts, errors, and 2
gloo ranks (the subprocess side is tests/workers/fp16_worker.py)."""

from __future__ import annotations

import copy
import importlib.util
import io

import pytest
import torch

import fused_optim
from fused_optim import DynamicLossScaler, FP16Optimizer
from processes import run_ranks
from utils import GOLDEN, WORKERS

U = 2.0**-24  # fp32 unit roundoff
# torch's CPU kernels fuse the multiply-adds of its vectorized loops (AVX2 and AVX-512 dispatch).
TORCH_FUSES = torch.backends.cpu.get_cpu_capability() in {"AVX2", "AVX512"}

_spec = importlib.util.spec_from_file_location("fp16_worker", WORKERS / "fp16_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
tiny_model, batch = worker.tiny_model, worker.batch


def golden_cases():
    data = torch.load(GOLDEN / "mlbench_fp16_optimizer.pt", weights_only=True)
    assert data["reference"].startswith("mlbench-core 3.0.0")
    return [pytest.param(c, id=c["id"]) for c in data["cases"]]


@pytest.mark.parametrize("case", golden_cases())
def test_replays_mlbench_fp16_optimizer(case):
    """Fed the recorded fp16 grads, our flat-master FP16Optimizer over the same torch.optim optimizer
    follows mlbench's: the same updated/skipped steps and loss scales, exactly.

    Without clipping (grad_clip=inf) the masters and fp16 params are bitwise mlbench's: both take
    fp32(g) / (scale·multiplier·denom) with one correctly rounded division, the clip factor is
    exactly 1 on both sides, and the inner step is the same torch SGD code on the same 39-element
    flat tensor. (torch's elementwise CPU loops take 2 vectors per iteration, 16 floats with AVX2 and
    32 with AVX-512, and the rest in scalar code: both vectorize elements [0, 32) and run [32, 39)
    scalar, and SGD's ops (mul, and adds with alpha as explicit fused multiply-adds) are correctly
    rounded per lane, so AVX2 and AVX-512 machines give the same bits. torch's kernels for CPUs
    without AVX2 round the product of an add with alpha before the add: there the recorded masters
    are not torch's own bits, so those cases check everything but the values.)

    With clipping the two clip factors grad_clip / (N + 1e-6) differ in the last bits: N is a
    39-term fp32 sum of squares, summed in another order (mlbench: torch's norm of the fp32 grads;
    ours: the norm kernel over the fp16 grads, then / q), so each N has relative error ≤ 39·u/2 + u,
    and the factors (ours rounded once from double, mlbench's twice in fp32) differ by δ ≤ (39 + 4)·u
    relative. Plain SGD (p ← p − lr·c·ĝ, ĝ identical) turns that into at most (δ + 4u)·|step| per
    step (δ, the product c·ĝ and the fma rounded on both sides), plus 2u·|p| for the rounding of p:
    summed over the steps, elementwise, from the recorded trajectory."""
    init = case["init"]
    model = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in init])
    opt = FP16Optimizer(model, flatten=True, **case["options"])
    opt.set_optimizer(getattr(torch.optim, case["inner"]["name"])([opt.fp32_params], **case["inner"]["kwargs"]))
    sizes = [t.numel() for t in init]
    exact = case["options"].get("grad_clip", float("inf")) == float("inf")
    previous = torch.cat([t.reshape(-1).float() for t in init])
    path = torch.zeros_like(previous)  # Σ |step| so far, elementwise
    mass = torch.zeros_like(previous)  # Σ |p| so far
    clipped = 0
    for t in range(len(case["updated"])):
        for p, g in zip(model, case["grads"][t].split(sizes)):
            p.grad = g.view(p.shape).clone()
        scale = opt.loss_scaler.loss_scale
        assert opt.step(**case["step_kwargs"]) == case["updated"][t], f"step {t}"
        assert opt.loss_scaler.loss_scale == case["scale"][t], f"step {t}"
        masters, params = opt.fp32_params.detach(), torch.cat([p.detach().reshape(-1) for p in model])
        assert torch.equal(params, masters.half()), f"step {t}: the fp16 params are the masters rounded"
        expected = case["masters"][t]
        if exact:
            if TORCH_FUSES:
                assert torch.equal(masters, expected), f"step {t}"
                assert torch.equal(params, case["params"][t]), f"step {t}"
            continue
        path += (expected - previous).abs()
        mass += expected.abs()
        previous = expected
        tol = ((39 + 4) * U + 4 * U) * path + 2 * U * mass
        assert ((masters - expected).abs() <= tol).all(), f"step {t}: {(masters - expected).abs().max()}"
        # a master that moved by less than an fp16 spacing rounds to the same fp16 value or a neighbour
        torch.testing.assert_close(params, case["params"][t], rtol=2.0**-10, atol=2.0**-24, msg=f"step {t}")
        m = case["step_kwargs"].get("multiplier", 1.0) * case["step_kwargs"].get("denom", 1.0)
        clipped += bool(case["grads"][t].float().norm() / (scale * m) > case["options"]["grad_clip"])
    assert exact or clipped >= 5  # the case clips at some steps
    assert not all(case["updated"]) and len(set(case["scale"])) >= 3  # overflows, growth and shrinking


def test_loss_scale_schedule():
    """mlbench's schedule, by hand: growth every `window` steps counted from the last overflow, the
    max_scale cap, halving on each overflow."""
    scaler = DynamicLossScaler(init_scale=8, scale_factor=2, scale_window=3, max_scale=32)
    overflows = {3, 11, 12}
    scales = []
    for it in range(22):
        scaler.update_scale(it in overflows)
        scales.append(scaler.loss_scale)
    assert scales == [8, 8, 16, 8, 8, 8, 16, 16, 16, 32, 32, 16, 8, 8, 8, 16, 16, 16, 32, 32, 32, 32]
    assert scaler.state_dict() == {"loss_scale": 32.0, "iteration": 22, "last_overflow_iter": 12}


def backward(opt, model, gen, bad=None):
    """Forward and backward_loss on a fresh batch; ``bad``: then overwrite one grad element with it."""
    x, y = batch(gen)
    opt.backward_loss(torch.nn.functional.mse_loss(model(x).float(), y))
    if bad is not None:
        next(iter(model.parameters())).grad.view(-1)[0] = bad


def step_with(opt, model, gen, bad=None):
    """One training step: zero_grad, backward (see there), step."""
    opt.zero_grad()
    backward(opt, model, gen, bad)
    return opt.step()


def snapshot(opt, model):
    return copy.deepcopy({"params": [p.detach() for p in model.parameters()],
                          "masters": [m.detach() for m in opt._masters],
                          "grads": [m.grad for m in opt._masters],
                          "inner": opt.optimizer.state_dict()["state"]})


@pytest.mark.parametrize("flatten", [False, True], ids=["per-param", "flat"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_overflow_step_changes_nothing_but_the_scaler(flatten, bad):
    """Params, masters, the masters' grads (mlbench overwrites them) and the inner optimizer's state
    stay as they were; the scale halves and the overflow is counted."""
    model = tiny_model(0)
    opt = FP16Optimizer(model, init_scale=64, scale_window=1000, flatten=flatten)
    opt.set_optimizer(fused_optim.Adam([opt.fp32_params] if flatten else opt.fp32_params, lr=1e-2, weight_decay=1e-2))
    gen = torch.Generator().manual_seed(0)
    assert step_with(opt, model, gen) and step_with(opt, model, gen)
    before = snapshot(opt, model)
    model.zero_grad()  # (not opt.zero_grad(): the masters' grads of the last step stay, to be compared)
    backward(opt, model, gen, bad)
    assert opt.step() is False
    after = snapshot(opt, model)
    for key in ("params", "masters", "grads"):
        assert all(torch.equal(a, b) for a, b in zip(before[key], after[key])), key
    assert before["inner"].keys() == after["inner"].keys()
    for k, state in before["inner"].items():
        assert all(torch.equal(state[name], after["inner"][k][name]) for name in state), "inner optimizer state"
    assert opt.loss_scaler.state_dict() == {"loss_scale": 32.0, "iteration": 3, "last_overflow_iter": 2}
    assert step_with(opt, model, gen)  # the next finite step updates again
    assert not torch.equal(opt._masters[0], before["masters"][0])


def test_scale_falling_to_min_scale_raises():
    model = tiny_model(0)
    opt = FP16Optimizer(model, init_scale=1.0, min_scale=0.25)
    opt.set_optimizer(torch.optim.SGD(opt.fp32_params, lr=0.1))
    gen = torch.Generator().manual_seed(0)
    assert step_with(opt, model, gen, bad=float("inf")) is False  # 1 → 0.5
    with pytest.raises(RuntimeError, match=r"loss scale fell to 0.25 <= min_scale=0.25.*lower min_scale"):
        step_with(opt, model, gen, bad=float("inf"))


class _FailsOnce(torch.optim.SGD):
    """SGD whose next step raises while ``fail`` is set (fault injection into the inner step)."""
    fail = False

    def step(self, closure=None):
        if self.fail:
            self.fail = False
            raise RuntimeError("injected")
        return super().step(closure)


def test_an_inner_step_that_raises_leaves_the_loss_scale():
    """The scaler counts only steps that happened: after an inner step that raised, the same batch
    stepped again gives what an unbroken run gives (scale, iteration, masters), scale growth
    included (scale_window=2 grows at the second step)."""
    runs = []
    for inject in (False, True):
        model = tiny_model(0)
        opt = FP16Optimizer(model, init_scale=8, scale_window=2)
        opt.set_optimizer(_FailsOnce(opt.fp32_params, lr=0.1, momentum=0.9))
        gen = torch.Generator().manual_seed(0)
        for t in range(3):
            if inject and t == 1:
                state = torch.Generator().set_state(gen.get_state())
                opt.optimizer.fail = True
                with pytest.raises(RuntimeError, match="injected"):
                    step_with(opt, model, gen)
                assert opt.loss_scaler.state_dict() == {"loss_scale": 8.0, "iteration": 1, "last_overflow_iter": -1}
                gen = state  # the same batch again
            assert step_with(opt, model, gen)
        runs.append((opt.loss_scaler.state_dict(), [m.detach().clone() for m in opt._masters]))
    assert runs[0][0] == runs[1][0] == {"loss_scale": 16.0, "iteration": 3, "last_overflow_iter": -1}
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.parametrize("broken", ["inner optimizer", "loss scaler"])
def test_a_state_that_does_not_load_changes_nothing(broken):
    """A state whose inner optimizer state has other groups, or whose scaler state lacks a key,
    raises before the masters, the fp16 params, the scaler or the inner optimizer change."""
    model = tiny_model(0)
    opt = FP16Optimizer(model, init_scale=8, scale_window=2)
    opt.set_optimizer(fused_optim.FusedSGD(opt.fp32_params, lr=0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(0)
    step_with(opt, model, gen)
    good = copy.deepcopy(opt.state_dict())
    step_with(opt, model, gen)
    before = snapshot(opt, model), opt.loss_scaler.state_dict()
    bad = copy.deepcopy(good)
    if broken == "inner optimizer":
        bad["optimizer"]["param_groups"][0]["params"].pop()
    else:
        del bad["loss_scaler"]["iteration"]
    with pytest.raises((ValueError, KeyError)):
        opt.load_state_dict(bad)
    after = snapshot(opt, model), opt.loss_scaler.state_dict()
    assert after[1] == before[1]
    for key in ("params", "masters"):
        assert all(torch.equal(a, b) for a, b in zip(before[0][key], after[0][key])), key
    for k, state in before[0]["inner"].items():
        assert all(torch.equal(state[name], after[0]["inner"][k][name]) for name in state), "inner optimizer state"


@pytest.mark.parametrize("inner", ["Adam", "AdamW", "SGD"])
def test_per_param_and_flat_masters_step_alike_for_elementwise_optimizers(inner):
    """Elementwise updates do not care how the masters are laid out: our kernels compute every
    element with the same vector code (tails go through a padded vector), so the two layouts give
    the same bits, overflow steps and clipping included."""
    kwargs = {"SGD": dict(lr=0.1, momentum=0.9, weight_decay=1e-3)}.get(inner, dict(lr=1e-2, weight_decay=1e-2))
    runs = []
    for flatten in (False, True):
        model = tiny_model(0)
        opt = FP16Optimizer(model, grad_clip=0.3, init_scale=256, scale_window=3, flatten=flatten)
        opt.set_optimizer(getattr(fused_optim, inner)([opt.fp32_params] if flatten else opt.fp32_params, **kwargs,
                                                      fused=True))
        gen = torch.Generator().manual_seed(1)
        runs.append([(step_with(opt, model, gen, bad=float("inf") if t == 4 else None),
                      torch.cat([m.reshape(-1) for m in opt._master_views])) for t in range(8)])
    for t, ((upd_a, a), (upd_b, b)) in enumerate(zip(*runs)):
        assert upd_a == upd_b == (t != 4) and torch.equal(a, b), f"step {t}"


@pytest.mark.parametrize("inner", ["LARS", "FusedLAMB"])
def test_layerwise_optimizers_take_one_trust_ratio_per_master(inner):
    """Per-param masters give LARS/LAMB their per-layer trust ratios (the same as the optimizer on
    fp32 copies of the params); a flat master is one tensor, so one ratio for the whole model."""
    kwargs = dict(lr=0.1, momentum=0.9, weight_decay=1e-3) if inner == "LARS" else dict(lr=1e-2, weight_decay=1e-2)
    results = {}
    for flatten in (False, True):
        model = tiny_model(0)
        with torch.no_grad():
            model[0].weight.mul_(8)  # layers of different scales: different trust ratios
        start = [p.detach().float() for p in model.parameters()]
        opt = FP16Optimizer(model, init_scale=1024, flatten=flatten)
        opt.set_optimizer(getattr(fused_optim, inner)([opt.fp32_params] if flatten else opt.fp32_params, **kwargs))
        # the same optimizer directly on fp32 tensors laid out like the masters, fed the unscaled grads
        direct = [torch.nn.Parameter(torch.cat([s.reshape(-1) for s in start]))] if flatten else \
                 [torch.nn.Parameter(s.clone()) for s in start]
        direct_opt = getattr(fused_optim, inner)(direct, **kwargs)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            scale = opt.loss_scaler.loss_scale
            assert step_with(opt, model, gen)
            grads = [p.grad.float() / scale for p in model.parameters()]
            for d, g in zip(direct, [torch.cat([g.reshape(-1) for g in grads])] if flatten else grads):
                d.grad = g
            direct_opt.step()
            for m, d in zip(opt._masters, direct):
                assert torch.equal(m, d)
        results[flatten] = torch.cat([m.reshape(-1) for m in opt._master_views])
    assert (results[False] - results[True]).abs().max() > 1e-3  # not the same update


@pytest.mark.parametrize("flatten", [False, True], ids=["per-param", "flat"])
def test_state_dict_round_trips_exactly(flatten):
    """Save after 4 steps (one of them an overflow), load into a fresh model and optimizer with
    torch.load(weights_only=True), continue: the same trajectory, bit for bit."""
    def make(seed):
        model = tiny_model(seed)
        opt = FP16Optimizer(model, init_scale=128, scale_window=2, max_scale=256, flatten=flatten)
        opt.set_optimizer(fused_optim.FusedLAMB([opt.fp32_params] if flatten else opt.fp32_params, lr=1e-2))
        return model, opt

    model, opt = make(0)
    gen = torch.Generator().manual_seed(3)
    for t in range(4):
        step_with(opt, model, gen, bad=float("inf") if t == 1 else None)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["loss_scaler"] == {"loss_scale": 128.0, "iteration": 4, "last_overflow_iter": 1}
    model2, opt2 = make(1)  # other initial weights: the masters must come from the state
    opt2.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    gen2 = torch.Generator()
    gen2.set_state(gen.get_state())
    for t in range(4):
        assert step_with(opt, model, gen, bad=float("inf") if t == 2 else None) == \
               step_with(opt2, model2, gen2, bad=float("inf") if t == 2 else None)
        assert opt.loss_scaler.state_dict() == opt2.loss_scaler.state_dict()
        for a, b in zip(opt._masters, opt2._masters):
            assert torch.equal(a, b), f"step {t}"
    with pytest.raises(ValueError, match="build it on the same model with the same flatten"):
        make(0)[1].load_state_dict({**state, "flatten": not flatten})


def test_backward_loss_scales_the_grads_not_the_loss():
    model = tiny_model(0)
    opt = FP16Optimizer(model, init_scale=2.0**10)
    x, y = batch(torch.Generator().manual_seed(0))
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    value = loss.item()
    opt.backward_loss(loss)
    assert loss.item() == value  # mlbench's `loss *= scale` changes it
    scaled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    # a power-of-two scale scales every rounding step exactly (no fp16 overflow or subnormal here)
    assert all(torch.equal(s, p.grad * 2.0**10) for s, p in zip(scaled, model.parameters()))


def test_closure_runs_first_and_its_grads_are_used():
    runs = []
    for use_closure in (False, True):
        model = tiny_model(0)
        opt = FP16Optimizer(model)
        opt.set_optimizer(torch.optim.SGD(opt.fp32_params, lr=0.1))
        x, y = batch(torch.Generator().manual_seed(0))

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            opt.backward_loss(loss)
            return loss

        if use_closure:
            with torch.no_grad():
                assert opt.step(closure)
        else:
            closure()
            assert opt.step()
        runs.append([m.detach().clone() for m in opt.fp32_params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("flatten", [False, True], ids=["per-param", "flat"])
def test_frozen_unused_and_non_contiguous_params(flatten):
    """A frozen param gets no master; a param without a grad keeps its master (per-param: its
    master's grad is None; flat: its slice of the flat grad is zero); a non-contiguous grad is
    read by its shape (mlbench's .view(-1) raises there)."""
    model = tiny_model(0)
    model[0].bias.requires_grad_(False)
    opt = FP16Optimizer(model, flatten=flatten)
    assert [m.numel() for m in opt._master_views] == [20, 12, 3]
    opt.set_optimizer(torch.optim.SGD([opt.fp32_params] if flatten else opt.fp32_params, lr=0.5))
    before = [m.clone() for m in opt._master_views]
    w0, w2, b2 = model[0].weight, model[2].weight, model[2].bias
    gen = torch.Generator().manual_seed(0)
    w0.grad = torch.randn(5, 4, generator=gen).half().t()  # non-contiguous
    b2.grad = torch.randn(3, generator=gen).half()  # w2 has no grad
    scale = opt.loss_scaler.loss_scale
    assert opt.step()
    assert torch.equal(opt._master_views[0], before[0] - 0.5 * (w0.grad.float() / scale))
    assert torch.equal(opt._master_views[1], before[1])  # no grad: unchanged
    assert torch.equal(w2.detach(), before[1].half())
    if not flatten:
        assert opt.fp32_params[1].grad is None
    else:
        assert torch.equal(opt.fp32_params.grad[20:32], torch.zeros(12))
    assert model[0].bias.grad is None


def test_errors_name_the_argument_and_the_fix():
    model = tiny_model(0)
    bad = [(dict(scale_window=0), "scale_window=0 .an int >= 1"), (dict(scale_factor=1), "scale_factor=1 "),
           (dict(grad_clip=True), "grad_clip=True .*use_cuda"), (dict(init_scale=0), "init_scale=0 "),
           (dict(average_world=False), "exactly one of them True"),
           (dict(average_custom=True), "exactly one of them True"), (dict(world_size=0), "world_size=0 "),
           (dict(flatten="yes"), "flatten='yes'"),
           (dict(world_size=2), "torch.distributed initialized|the process group has")]
    for kwargs, message in bad:
        with pytest.raises((ValueError, RuntimeError), match=message):
            FP16Optimizer(model, **kwargs)
    opt = FP16Optimizer(model)
    with pytest.raises(RuntimeError, match=r"call set_optimizer\(optimizer\)"):
        opt.step()
    with pytest.raises(ValueError, match="param 0 of group 0 .* not over the fp16 model's params"):
        opt.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    custom = FP16Optimizer(model, average_world=False, average_custom=True)
    custom.set_optimizer(torch.optim.SGD(custom.fp32_params, lr=0.1))
    with pytest.raises(ValueError, match="average_custom=True needs denom="):
        custom.step()
    for denom in (torch.tensor([1.0, 2.0]), "2", 0.0):
        with pytest.raises(ValueError, match=r"invalid denom .*a finite number ≠ 0, or a one-element tensor"):
            custom.step(denom=denom)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        FP16Optimizer(torch.nn.Linear(2, 2).requires_grad_(False))


@pytest.mark.slow
def test_two_gloo_ranks_average_their_grads(tmp_path):
    """2 ranks (gloo on loopback) with different grads: both ranks end with the same masters,
    equal to one process fed the fp16 all-reduce sum (gloo adds two fp16 values with one rounding,
    as torch's fp16 add does) with the same divisor: bitwise. An inf on one rank makes both skip."""
    run_ranks(WORKERS / "fp16_worker.py", lambda r: (r, tmp_path), 2, tmp_path, env=dict(GLOO_SOCKET_IFNAME="lo"))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for mode, options in worker.MODES.items():
        a, b = ranks[0][mode], ranks[1][mode]
        assert a["updated"] == b["updated"] == [t not in worker.BAD for t in range(worker.STEPS)], mode
        assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"])), mode
        # one process: the summed fp16 grads, divided by the same D
        model = tiny_model(0)
        one = FP16Optimizer(model, average_world=False, average_custom=True)
        one.set_optimizer(torch.optim.SGD(one.fp32_params, lr=0.1, momentum=0.9))
        for t in range(worker.STEPS):
            g0, g1 = worker.rank_grads(0, t), worker.rank_grads(1, t)
            d = options.get("denom", 2.0)
            for p, x, y in zip(model.parameters(), g0, g1):
                p.grad = x / d + y / d if options.get("divide_before") else x + y
            assert one.step(denom=1.0 if options.get("divide_before") else d) == a["updated"][t]
            assert torch.equal(torch.cat([m.reshape(-1) for m in one.fp32_params]), a["masters"][t]), (mode, t)
