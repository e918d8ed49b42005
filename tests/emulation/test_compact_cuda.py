"""Compact optimizer state (bf16 / 8-bit moments, fp32 moments of 16-bit params, stochastic rounding)
in the CUDA functors, run through the CUDA emulation (csrc/cuda/compact_state.cuh; docs/design.md
"Compact optimizer state").

The chain of truth: the compact reference -> the CPU kernels (tests/core/test_state_dtype.py) -> the
CUDA functors, which must reproduce the CPU kernels' codes, absmaxes, random bits and keys. Both
run the same per-element rules and formats (csrc/shared), one fused multiply-add per x*y + z (on a
CPU with FMA), so the elementwise ops agree bit for bit. The layer-wise ops (LARS, ColossalAI's
Lars, LAMB with the trust ratio) sum ||p||² and ||g||² or ||u||² in another order on each device,
so their per-tensor ratios differ in the last bits: see _assert_close."""

import contextlib
import io

import pytest
import torch

import fused_optim
from fused_optim.specs import SPECS
from test_state_dtype import SIZES, _adjacent, _args, _clone, _op_inputs
from utils import cpu_kernels_fuse_multiply_adds

EPS = torch.finfo(torch.float32).eps
# Without FMA (x86-64 before AVX2) the CPU kernels round each x*y + z twice, so a value, a code or
# a random rounding may land on the other side of a boundary than the CUDA code's: the CPU and
# CUDA kernels agree bit for bit only where both fuse.
BOTH_FUSE = pytest.mark.skipif(not cpu_kernels_fuse_multiply_adds(),
                               reason="the CPU kernels are built without FMA: they round x*y + z twice, CUDA once")

# (op, state format, param dtype, stochastic_state, stochastic_params, amsgrad, masters); the sizes
# (SIZES) give one-element, partial, whole and multi-block tensors and one of two CUDA chunks, six
# tensors per launch.
CASES = [
    ("adam_", "bf16", torch.float32, True, False, True, False),
    ("adam_", "8bit", torch.float32, False, False, True, False),
    ("adam_", "8bit", torch.float16, False, False, False, False),
    ("adam_", "8bit", torch.bfloat16, False, True, False, False),
    ("adam_", "bf16", torch.bfloat16, True, True, False, False),
    ("adam_", "bf16", torch.bfloat16, True, False, False, False),  # stochastic state, params to nearest
    ("adam_", "8bit", torch.bfloat16, False, False, False, True),
    ("sgd_", "bf16", torch.float32, False, False, False, False),
    ("sgd_", "8bit", torch.float32, False, False, False, False),
    ("sgd_", "bf16", torch.float16, False, False, False, False),
    ("sgd_", "bf16", torch.bfloat16, False, True, False, False),  # bf16 params' own bf16 buffers
    ("sgd_", "8bit", torch.bfloat16, False, True, False, False),
    ("sgd_", "bf16", torch.bfloat16, True, False, False, True),
    ("sign_sgd_", "8bit", torch.float32, False, False, False, False),
    ("sign_sgd_", "bf16", torch.bfloat16, True, True, False, False),
    ("colossal_lamb_", "8bit", torch.float32, False, False, False, False),  # (adam=True: one pass)
    ("colossal_lamb_", "bf16", torch.bfloat16, True, True, False, False),
    # layer-wise: the ratios from sums in another order (_assert_close)
    ("lars_", "bf16", torch.float32, True, False, False, False),
    ("lars_", "8bit", torch.float32, False, False, False, False),
    ("lars_", "8bit", torch.bfloat16, False, False, False, True),
    ("colossal_lars_", "8bit", torch.bfloat16, False, True, False, False),
    ("lamb_", "8bit", torch.float32, False, False, False, False),
    ("lamb_", "bf16", torch.float32, True, False, False, False),
    ("lamb_", "bf16", torch.bfloat16, True, True, False, False),
    ("lamb_", "8bit", torch.bfloat16, False, True, False, False),
    ("lamb_", "8bit", torch.bfloat16, False, False, False, True),
    ("lion_", "8bit", torch.float32, False, False, False, False),
    ("lion_", "bf16", torch.bfloat16, True, True, False, False),
    ("lion_", "8bit", torch.bfloat16, False, False, False, True),
    ("adagrad_", "8bit", torch.float32, False, False, False, False),
    ("adagrad_", "bf16", torch.bfloat16, True, True, False, False),
    ("adagrad_", "8bit", torch.float16, False, False, False, True),
    # fp32 state of 16-bit params (state_dtype=torch.float32)
    ("adam_", "fp32", torch.bfloat16, False, False, True, False),
    ("adam_", "fp32", torch.bfloat16, False, True, False, False),
    ("sgd_", "fp32", torch.float16, False, False, False, False),
    ("lamb_", "fp32", torch.bfloat16, False, False, False, False),
    ("lion_", "fp32", torch.bfloat16, False, False, False, False),
    ("adagrad_", "fp32", torch.float16, False, False, False, False),
]
LAYERWISE = {"lars_", "colossal_lars_", "lamb_"}


def _case_id(c) -> str:
    flags = [name for name, on in (("srstate", c[3]), ("srparams", c[4]), ("amsgrad", c[5]), ("masters", c[6]))
             if on]
    return "-".join([c[0] + c[1], str(c[2])[6:], *flags])


def _call(op, emulated, inputs, masters, **flags):
    """The compact twin on the CPU kernels or on the emulated CUDA functors. The SGD family's
    first-step flags alternate, so its tensors go to two launches (the binding's split)."""
    spec = SPECS[op]
    args, scalars = _args(op, inputs, masters)
    if spec.per_step:
        args = (*args[:-1], [i % 2 == 0 for i in range(len(SIZES))])
    if op == "colossal_lamb_":
        scalars["adam"] = True
    library = torch.ops.fused_optim_emulated_cuda if emulated else torch.ops.fused_optim
    getattr(library, spec.compact_name)(*args, **scalars, **flags)


def _tensors(inputs, masters):
    """Every tensor a call may write, by name."""
    params, _, lists, steps, absmaxes, keys = inputs
    named = {"params": params, "masters": masters, "absmaxes": absmaxes, "keys": keys}
    named.update({f"state{k}": lst for k, lst in enumerate(lists)})
    named.update({f"steps{k}": lst for k, lst in enumerate(steps)})
    return named


def _assert_close(name, ours, theirs):
    """A layer-wise op: its ratio r (LARS: of the gradient multiplier and the decay; LAMB: of the
    step) comes from per-tensor sums of squares of fp32 products, accumulated per SIMD lane on the
    CPU and per thread on CUDA, then added in another order: a few fp32 ulps of relative error in
    r. An fp32 value then differs by a few ulps of its scale (4 allowed, as tests/core/test_master_weights.py
    allows the norm ops per step); a stored code or bf16 value may take its neighbour where the fp32
    value lies on a rounding boundary (or a stochastic threshold): never further, and rarely (1%)."""
    if ours.dtype == torch.float32:
        assert (ours - theirs).abs().max().item() <= 4 * EPS * max(theirs.abs().max().item(), 1.0), name
        return
    assert _adjacent(ours, theirs), name
    assert int((ours != theirs).sum()) <= max(1, ours.numel() // 100), name


@BOTH_FUSE
@pytest.mark.parametrize("op,fmt,dtype,sr_state,sr_params,amsgrad,masters", CASES, ids=[_case_id(c) for c in CASES])
def test_emulated_cuda_compact_twin_is_the_cpu_kernel(op, fmt, dtype, sr_state, sr_params, amsgrad, masters):
    """Every tensor the call writes (params, masters, codes or bf16 state, absmaxes, step counters,
    rounding keys): bit for bit for the elementwise ops; for the layer-wise ones the moments of
    LAMB's first pass bit for bit (they do not depend on r), the rest as _assert_close says."""
    fused_optim._build.load("cpu")
    fused_optim._build.load_emulated_cuda()
    inputs = _op_inputs(op, fmt, dtype, amsgrad)
    master_list = [p.float() for p in inputs[0]] if masters else []
    ours, theirs = _clone(list(inputs)), _clone(list(inputs))
    ours_m, theirs_m = _clone(master_list), _clone(master_list)
    flags = dict(stochastic_state=sr_state, stochastic_params=sr_params)
    _call(op, True, ours, ours_m, **flags)
    _call(op, False, theirs, theirs_m, **flags)
    exact = {"keys", "steps0"} | ({"state0", "state1", "absmaxes"} if op == "lamb_" else set())
    for (name, a_list), b_list in zip(_tensors(ours, ours_m).items(), _tensors(theirs, theirs_m).values()):
        assert len(a_list) == len(b_list)
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if op in LAYERWISE and name not in exact:
                _assert_close(f"{name}[{i}]", a, b)
            else:
                assert torch.equal(a, b), f"{name}[{i}]"
    assert [int(k) for k in ours[5]] == [12345678901 + 7 * i + (sr_state or sr_params) for i in range(len(SIZES))]
    assert any(not torch.equal(a, b) for a, b in zip(ours[2][0], inputs[2][0]))  # the step did something


def test_an_overflow_step_changes_nothing_and_keeps_the_keys():
    """found_inf set: no element, absmax, step counter or rounding key changes (the binding reads
    found_inf on the host before it advances the keys)."""
    fused_optim._build.load_emulated_cuda()
    inputs = _op_inputs("adam_", "bf16", torch.bfloat16, amsgrad=False)
    ours = _clone(list(inputs))
    args, scalars = _args("adam_", ours)
    torch.ops.fused_optim_emulated_cuda.adam_compact_(*args, **scalars, stochastic_state=True,
                                                      stochastic_params=True, found_inf=torch.ones(1))
    for a_list, b_list in zip(_tensors(ours, []).values(), _tensors(inputs, []).values()):
        assert all(torch.equal(a, b) for a, b in zip(a_list, b_list))


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3)).to(dtype)


def _steps(model, opt, n, seed=1):
    """n steps with grads drawn on the CPU: the same on every device (a backward on a GPU sums
    in another order than on the CPU, and the comparison is bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(device=p.device, dtype=p.dtype)
        opt.step()


OPTIMIZERS = [
    (fused_optim.AdamW, torch.float32, dict(lr=1e-2, state_dtype="8bit")),
    (fused_optim.AdamW, torch.bfloat16, dict(lr=1e-2, state_dtype=torch.bfloat16, state_rounding="stochastic",
                                             stochastic_rounding=True)),
    (fused_optim.SGD, torch.bfloat16, dict(lr=0.1, momentum=0.9, state_dtype="8bit", master_weights=True)),
]


def _steps_and_resumes_like_the_cpu_kernels(cls, dtype, kwargs, device: str, context) -> None:
    """3 steps on ``device`` (inside ``context``), a state dict through ``torch.save`` and a
    ``weights_only`` load into a fresh optimizer, 3 more steps; the params and every state tensor
    (codes, absmaxes, keys, masters) equal those of 6 uninterrupted CPU-kernel steps, bit for bit."""
    fused_optim._build.load("cpu")
    cpu_model = _model(dtype)
    cpu_opt = cls(cpu_model.parameters(), fused=True, **kwargs)
    _steps(cpu_model, cpu_opt, 3)
    _steps(cpu_model, cpu_opt, 3, seed=2)
    model = _model(dtype).to(device)
    opt = cls(model.parameters(), fused=True, **kwargs)
    with context():
        _steps(model, opt, 3)
        assert opt.implementation == "fused"
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        resumed_model = _model(dtype, seed=5).to(device)
        resumed_model.load_state_dict(saved["model"])
        resumed = cls(resumed_model.parameters(), fused=True, **kwargs)
        resumed.load_state_dict(saved["opt"])
        _steps(resumed_model, resumed, 3, seed=2)
        assert resumed.implementation == "fused"
    for p, q in zip(resumed_model.parameters(), cpu_model.parameters()):
        assert resumed.state[p].keys() == cpu_opt.state[q].keys()
        for key, b in [("param", q.detach()), *cpu_opt.state[q].items()]:
            a = p.detach() if key == "param" else resumed.state[p][key]
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), key


@BOTH_FUSE
@pytest.mark.parametrize("cls,dtype,kwargs", OPTIMIZERS, ids=["adamw-8bit", "adamw-bf16-sr", "sgd-8bit-masters"])
def test_emulated_cuda_steps_and_resumes_like_the_cpu_kernels(cls, dtype, kwargs):
    """Through the optimizer, under the CUDA emulation (see the helper)."""
    fused_optim._build.load_emulated_cuda()
    _steps_and_resumes_like_the_cpu_kernels(cls, dtype, kwargs, "cpu", fused_optim.testing.emulated_cuda)


@pytest.mark.cuda
@BOTH_FUSE
@pytest.mark.parametrize("cls,dtype,kwargs", OPTIMIZERS, ids=["adamw-8bit", "adamw-bf16-sr", "sgd-8bit-masters"])
def test_gpu_steps_and_resumes_like_the_cpu_kernels(cls, dtype, kwargs):
    """The same on a real GPU: both devices fuse x*y + z and draw the same rounding bits from the
    same keys."""
    _steps_and_resumes_like_the_cpu_kernels(cls, dtype, kwargs, "cuda", contextlib.nullcontext)
