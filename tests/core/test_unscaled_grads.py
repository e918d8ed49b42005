"""GradScaler's contract after a scaled step: ``p.grad`` holds the unscaled grads.

torch's optimizers (fused and unfused) and apex's leave in ``p.grad`` what ``scaler.unscale_``
makes of the scaled grads, ``g * (1/scale)`` rounded to the grads' dtype, so code that logs,
clips or accumulates grads after ``scaler.step(opt)`` sees true values. Our ops take the scale
into the update and write the grads back in the same pass (the kernels' last pass over them,
csrc/cpu/update_args.h, csrc/cuda/multi_tensor_apply.cuh; the reference after its update). The
expected values here are torch's own unscale (``torch._amp_foreach_non_finite_check_and_unscale_``,
the op ``GradScaler.unscale_`` runs), compared bit for bit: both compute one product of the
grad and the fp32 (fp64 for fp64 grads) inverse of the scale, rounded once to the grads' dtype.
"""

import pytest
import torch

import fused_optim
from fused_optim import _build
from fused_optim.specs import SPECS
from cases import STATEFUL_AND_LAYERWISE, ids
from test_ops import SCALARS, same_draws, sample_args
from test_state_dtype import _args, _clone, _op_inputs

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# 3 is no power of two: its inverse is rounded, so a division (1/3 not rounded first) would differ.
SCALES = [3.0, 65536.0]
LAYERWISE = [op for op, spec in SPECS.items() if any(s.name == "sums_only" for s in spec.scalars)]


def torch_unscaled(grads: list, scale: float) -> list:
    """What GradScaler.unscale_ leaves in the grads: its inv_scale is the fp64 reciprocal of the
    fp32 scale, rounded to fp32. fp64 grads are the exception where the scale is not a power of
    two: unscale_ multiplies them by that fp32-rounded inverse, the kernels (in fp64) and the
    reference by the fp64 one, which they also update with; GradScaler's scales are powers of two
    (2^16 halved and doubled), whose inverses are exact either way."""
    out = [g.clone() for g in grads]
    if out and out[0].dtype == torch.float64 and not float(scale).hex().startswith("0x1.0000000000000p"):
        return [g * (1.0 / scale) for g in out]
    inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(out, torch.zeros(1), inv)
    return out


def run_op(op: str, implementation: str, args, kwargs) -> None:
    """``op`` (a list op or a compact twin) on CPU tensors, by one implementation; "gpu" runs the
    CUDA kernels on copies on the GPU and copies every result back into the CPU tensors."""
    kwargs = same_draws(kwargs)
    if implementation == "reference":
        spec = SPECS[op.replace("compact_", "")]
        (spec.run_compact_reference if op.endswith("compact_") else spec.run_reference)(*args, **kwargs)
    elif implementation == "cpu":
        _build.load("cpu")
        getattr(torch.ops.fused_optim, op)(*args, **kwargs)
    elif implementation == "emulated_cuda":
        _build.load_emulated_cuda()
        getattr(torch.ops.fused_optim_emulated_cuda, op)(*args, **kwargs)
    else:
        _build.load("cuda")
        to = lambda x: x.cuda() if isinstance(x, torch.Tensor) and x.dtype != torch.int64 else x  # noqa: E731
        on_gpu = [[to(x) for x in a] if isinstance(a, list) else to(a) for a in args]
        gpu_kwargs = {k: to(v) for k, v in kwargs.items()}
        getattr(torch.ops.fused_optim, op)(*on_gpu, **gpu_kwargs)
        for a, b in [*zip(args, on_gpu), *((kwargs[k], gpu_kwargs[k]) for k in kwargs)]:
            for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                if isinstance(x, torch.Tensor) and x is not y:
                    x.copy_(y.cpu())


# The CPU kernels, the CUDA kernels (emulated on the CPU; on a GPU where there is one: make
# check-gpu runs this file's cuda tests) and the reference.
IMPLEMENTATIONS = ["cpu", "emulated_cuda", pytest.param("gpu", marks=pytest.mark.cuda), "reference"]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", list(SCALARS))
def test_a_scaled_step_leaves_the_grads_unscaled(op, implementation, dtype, scale):
    args, kwargs = sample_args(op, dtype, amp=True, sizes=(1, 33, 4097, 70001))
    kwargs["grad_scale"] = torch.tensor(scale)
    expected = torch_unscaled(args[1], scale)
    run_op(op, implementation, args, kwargs)
    for i, (g, e) in enumerate(zip(args[1], expected)):
        assert torch.equal(g, e), f"{op} {implementation} grads[{i}]"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", list(SCALARS))
def test_with_master_weights_the_16_bit_grads_are_unscaled(op, dtype, implementation):
    """fp16 / bf16 params with fp32 masters: the op reads the 16-bit grads, updates the masters
    and the fp32 state, writes the rounded params, and the unscaled 16-bit grads (on CUDA the
    launch with a model list)."""
    args, kwargs = sample_args(op, torch.float32, amp=True, sizes=(1, 33, 4097))
    count = len(SPECS[op].state)
    masters = [p.clone() for p in args[0]]
    args = ([p.to(dtype) for p in args[0]], [g.to(dtype) for g in args[1]], *args[2:count + 1], masters,
            *args[count + 2:])
    kwargs["grad_scale"] = torch.tensor(3.0)
    expected = torch_unscaled(args[1], 3.0)
    run_op(op, implementation, args, kwargs)
    assert all(torch.equal(g, e) for g, e in zip(args[1], expected))
    assert all(torch.equal(p, m.to(dtype)) for p, m in zip(args[0], masters))  # (the masters were used)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("amp", [dict(), dict(grad_scale=1.0), dict(grad_scale=1024.0, found_inf=1.0)],
                         ids=["no-scaler", "scale-1", "overflow"])
@pytest.mark.parametrize("op", list(SCALARS))
def test_unscaled_and_skipped_steps_leave_the_grads_as_they_were(op, amp, implementation):
    """Without a scale, with a scale of 1, and on an overflow step (found_inf: nothing changes, as
    torch leaves a skipped step's grads scaled) the grads keep their bits."""
    args, kwargs = sample_args(op, torch.float32, amp=False)
    kwargs.update({k: torch.tensor(v) for k, v in amp.items()})
    before = [g.clone() for g in args[1]]
    run_op(op, implementation, args, kwargs)
    assert all(torch.equal(g, b) for g, b in zip(args[1], before))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", LAYERWISE)
def test_the_sums_only_call_leaves_the_grads_and_the_update_unscales_them(op, implementation):
    """A sharded layer-wise step is two calls (fused_optim/sharding.py): the first only sums, and
    must read the grads as stored; the second updates and writes them back."""
    args, kwargs = sample_args(op, torch.float32, amp=True)
    kwargs["grad_scale"] = torch.tensor(8.0)
    before = [g.clone() for g in args[1]]
    rows = torch.zeros(len(args[0]), 2, dtype=torch.float64)
    run_op(op, implementation, args, {**kwargs, "norm_sums": rows, "sums_only": True})
    assert all(torch.equal(g, b) for g, b in zip(args[1], before))
    run_op(op, implementation, args, {**kwargs, "norm_sums": rows, "sums_only": False})
    assert all(torch.equal(g, e) for g, e in zip(args[1], torch_unscaled(before, 8.0)))


@pytest.mark.parametrize("implementation", ["cpu", "emulated_cuda"])
@pytest.mark.parametrize("op", ["adam_", "sgd_", "lamb_"])
def test_non_contiguous_grads_are_written_back(op, implementation):
    """A kernel reads a non-contiguous grad through a contiguous copy; the unscaled values still
    reach the caller's tensor (strided: every other column of a wider one). The copy and its
    return are the CUDA binding's host code, which the emulation runs as it is."""
    args, kwargs = sample_args(op, torch.float32, amp=True)
    wide = [torch.randn(g.numel(), 2) for g in args[1]]
    grads = [w[:, 0] for w in wide]
    assert not any(g.is_contiguous() for g in grads if g.numel() > 1)
    expected = torch_unscaled(grads, 8.0)
    others = [w[:, 1].clone() for w in wide]
    run_op(op, implementation, (args[0], grads, *args[2:]), {**kwargs, "grad_scale": torch.tensor(8.0)})
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert all(torch.equal(w[:, 1], o) for w, o in zip(wide, others))  # the copy went where it came from


COMPACT = [("adam_", "8bit", torch.bfloat16), ("lamb_", "bf16", torch.float32), ("sgd_", "8bit", torch.float16),
           ("lion_", "fp32", torch.bfloat16), ("adagrad_", "bf16", torch.float32)]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op,fmt,dtype", COMPACT, ids=[f"{o}{f}-{str(d)[6:]}" for o, f, d in COMPACT])
def test_compact_state_steps_unscale_the_grads_too(op, fmt, dtype, implementation):
    """The compact twins (8-bit, bf16 and fp32 moments) walk their own loops (whole 8-bit blocks;
    on CUDA one warp per block): they write the grads back all the same."""
    inputs = _op_inputs(op, fmt, dtype, amsgrad=False)
    args, scalars = _args(op, _clone(list(inputs)))
    expected = torch_unscaled(args[1], 3.0)
    run_op(SPECS[op].compact_name, implementation, args, {**scalars, "grad_scale": torch.tensor(3.0)})
    assert all(torch.equal(g, e) for g, e in zip(args[1], expected))


def _scaled_steps(make_opt, steps=3, init_scale=3.0 * 2.0**10):
    """A small model trained with autocast and GradScaler; after each step, the scale, the grads
    the scaler produced before it (scaled) and those left after it. The default scale is no power
    of two (its inverse is rounded)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    gen = torch.Generator().manual_seed(1)
    pairs = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaled = [p.grad.clone() for p in model.parameters()]
        scaler.step(opt)
        pairs.append((scale, scaled, [p.grad.clone() for p in model.parameters()]))
        scaler.update()
    return pairs


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("case", STATEFUL_AND_LAYERWISE, ids=ids(STATEFUL_AND_LAYERWISE))
def test_after_scaler_step_the_grads_are_those_torch_leaves(case, fused):
    """torch's own optimizer (its unfused step: GradScaler unscales first) leaves exactly the
    expected grads, and so does ours, which GradScaler hands the scale instead."""
    for make in (case.make_torch, lambda ps: case.make_ours(ps, fused=fused)):
        for scale, scaled, after in _scaled_steps(make):
            assert all(torch.equal(a, e) for a, e in zip(after, torch_unscaled(scaled, scale)))


def test_torch_fused_adamw_leaves_the_grads_so_too():
    """The contract is torch's fused optimizers' too: their kernels write the unscaled grads back.
    They divide by the scale where unscale_ multiplies by its rounded inverse, the same for
    GradScaler's power-of-two scales (the only ones it makes from its default 2^16)."""
    for scale, scaled, after in _scaled_steps(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                                              init_scale=2.0**12):
        assert all(torch.equal(a, e) for a, e in zip(after, torch_unscaled(scaled, scale)))


def test_an_eager_step_unscales_the_grads_and_bumps_their_versions():
    """An optimizer's eager steady-state step (its bucket twin, which reads .grad itself;
    tests/kernels/test_ops.py checks the twin op) writes the grads back and marks them modified."""
    p = torch.nn.Parameter(torch.randn(1000))
    opt = fused_optim.FusedAdam([p], lr=1e-3, fused=True)
    p.grad = torch.randn(1000)
    opt.step()  # the first step makes the state (and the plan, whose bucket the next step uses)
    p.grad = torch.randn(1000) * 3.0
    expected = torch_unscaled([p.grad], 3.0)[0]
    version = p.grad._version
    opt.grad_scale, opt.found_inf = torch.tensor(3.0), torch.tensor(0.0)
    opt.step()
    assert opt.implementation == "fused"
    assert torch.equal(p.grad, expected) and p.grad._version > version


@pytest.mark.parametrize("implementation", ["cpu", "emulated_cuda"])
def test_a_grad_sharing_memory_is_refused_before_anything_is_written(implementation):
    """An expanded grad cannot hold its unscaled values (its elements share memory): a scaled
    step refuses it, naming it, with params, state and grads as they were; an unscaled step,
    which only reads it, takes it."""
    args, kwargs = sample_args("adam_", torch.float32, amp=True)
    args[1][2] = torch.randn(1).expand(args[0][2].numel())
    before = [[x.clone() for x in a] if isinstance(a, list) else a for a in args]
    with pytest.raises(RuntimeError, match=r"grads\[2\] has elements that share memory .*p.grad = p.grad.clone"):
        run_op("adam_", implementation, args, {**kwargs, "grad_scale": torch.tensor(8.0)})
    for a, b in zip(args, before):
        assert all(torch.equal(x, y) for x, y in zip(a, b) if isinstance(x, torch.Tensor))
    run_op("adam_", implementation, args, {**kwargs, "grad_scale": None})
    assert not torch.equal(args[0][2], before[0][2])
