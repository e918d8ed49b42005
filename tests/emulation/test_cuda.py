"""The CUDA code, on a GPU (tests marked ``cuda``: without one they skip with the reason) and
emulated on the CPU (``fused_optim.testing.emulated_cuda``: the same binding, launcher and
kernels compiled for the host, every block run with its real threads; runs everywhere).

On both backends: CUDA kernel == reference == CPU kernel for every op, in fp32, fp64, bf16 and
fp16, on odd sizes (1, 33, 4097, a chunk boundary ± 1), more tensors and chunks than one launch
holds and misaligned storage offsets; fp16/bf16 stores rounded as torch rounds; the overflow skip
(step counters included); the norms; every registered optimizer's trajectory. On a GPU only:
GradScaler end to end; a state_dict moving between CPU and CUDA; a step captured and replayed in a
CUDA graph; a param list spanning CPU and CUDA; AdaScale's C++ gradient hooks on CUDA params
(tests/build/test_cuda_compile.py compiles the CUDA code wherever nvcc is; tests/emulation/test_cuda_emulation.py
checks the emulation itself)."""

import contextlib
import copy
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_optim
from fused_optim import _build
from fused_optim.specs import SPECS
from fused_optim.registry import create_optimizer, list_optimizers
from test_ops import SCALARS, assert_stores_round_like_torch, sample_args, same_draws
from utils import (assert_state_close, clone_groups, cpu_kernels_fuse_multiply_adds, make_groups, optimizer_kwargs,
                   set_grads)

CUDA = torch.device("cuda")


@dataclass(frozen=True)
class Backend:
    """Where the CUDA code runs: its ops' namespace, the device of their tensors, and the context
    the optimizers and norms reach it in."""

    namespace: str
    device: torch.device
    emulated: bool

    def op(self, name: str):
        return getattr(getattr(torch.ops, self.namespace), name)

    def context(self):
        return fused_optim.testing.emulated_cuda() if self.emulated else contextlib.nullcontext()


GPU = Backend("fused_optim", CUDA, emulated=False)
EMULATED = Backend("fused_optim_emulated_cuda", torch.device("cpu"), emulated=True)


@pytest.fixture(params=[pytest.param(GPU, marks=pytest.mark.cuda, id="gpu"), pytest.param(EMULATED, id="emulated")])
def backend(request) -> Backend:
    """Each backend, its library loaded (a test may name its own by indirect parametrization)."""
    if request.param.emulated:
        _build.load_emulated_cuda()
    else:
        _build.load("cuda")  # the op tests call the CUDA ops before any optimizer has loaded them
    return request.param


# Per dtype: (rtol, atol) between two implementations of one update (ulps of the storage type:
# fused multiply-adds and sum orders differ; results are rounded to the storage type once). fp64:
# the math is fp64 in both, a few ulps over the update's ~20 operations.
TOLERANCE = {torch.float32: (2e-5, 1e-6), torch.float64: (1e-12, 1e-14), torch.bfloat16: (1.6e-2, 1e-3),
             torch.float16: (2e-3, 1e-4)}
# Empty, 1, 33, 4097 and a 64K-element chunk boundary ± 1 (65537 is two chunks, one of 1 element).
SIZES = (0, 1, 33, 4097, 65535, 65537)


def _to(args, device, offset=False):
    """A copy of the op's arguments on ``device`` (a copy on the CPU too: the implementations under
    test update their own); with ``offset`` every tensor starts one element into its storage
    (contiguous, but not 16-byte aligned: the kernels' scalar path)."""
    def move(x):
        if not isinstance(x, torch.Tensor):
            return x
        if offset and x.dim() == 1 and x.is_floating_point() and x.numel() > 1:
            buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=device)
            buf[1:].copy_(x)
            return buf[1:]
        return x.to(device, copy=True)
    return tuple([move(x) for x in a] if isinstance(a, list) else move(a) for a in args)


def _kwargs_on(kwargs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in same_draws(kwargs).items()}


def _assert_same(a_args, b_args, dtype, what):
    """|a - b| <= atol + rtol*|b| for every element of every tensor argument (TOLERANCE; NaN never
    passes), in fp32 (exact for fp16/bf16) or fp64."""
    rtol, atol = TOLERANCE[dtype]
    for k, (a, b) in enumerate(zip(a_args, b_args)):
        for t, (x, y) in enumerate(zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b])):
            if not isinstance(x, torch.Tensor):
                continue
            x, y = (v.cpu().to(torch.promote_types(v.dtype, torch.float32)) for v in (x, y))
            bad = (~((x - y).abs() <= atol + rtol * y.abs())).nonzero()
            if len(bad):
                i = tuple(bad[0].tolist())
                raise AssertionError(f"{what}: argument {k}, tensor {t}: {len(bad)} of {x.numel()} elements differ, "
                                     f"at {i}: {x[i].item()!r} vs {y[i].item()!r} (rtol {rtol}, atol {atol})")


def _sign_ties(args, ref_args) -> list[torch.Tensor]:
    """Per param of a sign_sgd_ call, where its direction (the new momentum buffer, here in the
    reference's result) is within fp32 rounding of 0: the sign of cancelling terms (exactly 0 is
    common with bf16/fp16 inputs) is rounding's choice, so two correct implementations (fused
    multiply-adds or not) may step such an element by ±lr or 0. Rounding error: a few fp32 ulps of
    the terms' size, bounded by |p| + |g| + |old buffer|."""
    params, grads, bufs = args[:3]
    eps = torch.finfo(torch.float32).eps
    return [b.cpu().float().abs() <= 8 * eps * (p.float().abs() + g.float().abs() + old.float().abs())
            for b, p, g, old in zip(ref_args[2], params, grads, bufs)]


@pytest.mark.parametrize("offset", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=["fp32", "fp64", "bf16", "fp16"])
@pytest.mark.parametrize("op", list(SCALARS))
def test_cuda_kernel_equals_reference_and_cpu_kernel(backend, op, dtype, offset):
    args, kwargs = sample_args(op, dtype, amp=True, sizes=SIZES)
    cpu_args = _to(args, "cpu")
    cuda_args = _to(args, backend.device, offset)
    ref_args = _to(args, backend.device)
    getattr(torch.ops.fused_optim, op)(*cpu_args, **same_draws(kwargs))
    backend.op(op)(*cuda_args, **_kwargs_on(kwargs, backend.device))
    SPECS[op].run_reference(*ref_args, **_kwargs_on(kwargs, backend.device))
    assert cuda_args[0][1].device.type == backend.device.type
    if SPECS[op].settles:
        # The update reads the moments back as stored: an implementation's params are compared
        # with the reference's update from that implementation's stored moments, which are
        # compared with each other's and the reference's. (Two implementations may round a new
        # moment to storage on either side of a tie, one ulp apart, both correct; that ulp of v
        # moves u by half its relative size, and an element that dominates ||u|| steps by up to
        # lr·||p||: a difference of a few ulps of p, not the one rounding the tolerance allows.)
        for impl, name in ((cuda_args, "CUDA kernel"), (cpu_args, "CPU kernel")):
            _assert_same(impl[:1], _reference_from_stored_moments(op, args, kwargs, impl, backend.device)[:1], dtype,
                         f"{op}: {name} vs the reference from its moments")
        cuda_args, cpu_args, ref_args = cuda_args[1:], cpu_args[1:], ref_args[1:]
    _assert_same(cuda_args, cpu_args, dtype, f"{op}: CUDA vs CPU kernel")
    if op == "sign_sgd_":
        for p, r, tie in zip(cuda_args[0], ref_args[0], _sign_ties(args, ref_args)):
            r[tie.to(r.device)] = p[tie.to(p.device)]  # left out of the comparison
    _assert_same(cuda_args, ref_args, dtype, f"{op}: CUDA kernel vs reference")


def _reference_from_stored_moments(op, args, kwargs, impl, device):
    """The reference run on a copy of ``args`` whose update reads back (``settle``) the moments as
    ``impl`` (an implementation's arguments after its call) stored them, in place of its own."""
    ref_args = _to(args, device)
    stored = {id(r): x for r_list, x_list in zip(ref_args[2:], impl[2:]) if isinstance(r_list, list)
              for r, x in zip(r_list, x_list) if isinstance(r, torch.Tensor)}
    SPECS[op].run_reference(*ref_args, **_kwargs_on(kwargs, device), settle=lambda t: t.copy_(stored[id(t)]))
    return ref_args


def test_lamb_clips_by_the_norm_of_its_own_grads(backend):
    """Without global_grad_norm, lamb_ clips with the norm of the grads it was given (the
    binding's sum over all chunks of all tensors as one): max_grad_norm below that norm clips."""
    args, kwargs = sample_args("lamb_", torch.float32, amp=True, sizes=SIZES)
    kwargs.update(global_grad_norm=None, max_grad_norm=10.0)
    cpu_args, cuda_args = _to(args, "cpu"), _to(args, backend.device)
    torch.ops.fused_optim.lamb_(*cpu_args, **kwargs)
    backend.op("lamb_")(*cuda_args, **_kwargs_on(kwargs, backend.device))
    assert torch.cat(args[1]).norm() / 8.0 > 10.0  # grads over grad_scale: this call clips
    _assert_same(cuda_args, cpu_args, torch.float32, "lamb_ clipping by its own grads' norm")


@pytest.mark.parametrize("lr", [1e-10, 0.3, 1.0, 3e5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp16_and_bf16_stores_round_like_torch(backend, dtype, lr):
    assert_stores_round_like_torch(backend.op("sgd_"), dtype, lr, backend.device)


@pytest.mark.parametrize("backend, op", [
    *(pytest.param(GPU, op, marks=pytest.mark.cuda, id=f"gpu-{op}") for op in ("sgd_", "adam_", "lamb_", "lars_")),
    # emulated, the slowest test: the launcher alone, and with per-tensor sums and step counters
    *(pytest.param(EMULATED, op, id=f"emulated-{op}") for op in ("sgd_", "lamb_"))], indirect=["backend"])
def test_more_tensors_and_chunks_than_one_launch_holds(backend, op):
    """200 odd-sized tensors (a launch holds at most 96) and one of 320 * 65536 + 5 elements (a
    launch holds 320 chunks), with a Tensor lr on the device."""
    g = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 3000, (200,), generator=g)] + [320 * 65536 + 5]
    args, kwargs = sample_args(op, torch.float32, amp=True)
    n_lists = len(args)
    new = []
    for k in range(n_lists):
        lst = args[k]
        if not lst:  # master_params
            new.append([])
        elif isinstance(lst[0], bool):
            new.append([False] * len(sizes))
        elif lst[0].dim() == 0:  # step counters
            new.append([torch.tensor(3.0) for _ in sizes])
        else:  # in [0.5, 1.5): valid second moments too
            new.append([torch.rand(n, generator=g).add_(0.5) for n in sizes])
    args = tuple(new)
    kwargs["lr_tensor"] = torch.tensor(kwargs["lr"])
    cpu_args, cuda_args = _to(args, "cpu"), _to(args, backend.device)
    getattr(torch.ops.fused_optim, op)(*cpu_args, **same_draws(kwargs))
    backend.op(op)(*cuda_args, **_kwargs_on(kwargs, backend.device))
    _assert_same(cuda_args, cpu_args, torch.float32, f"{op} over {len(sizes)} tensors")


@pytest.mark.parametrize("offset", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("op", list(SCALARS))
def test_master_weights_over_more_tensors_than_one_launch_holds(backend, op, offset):
    """bf16 params with fp32 masters and state over 40 tensors (a launch of adam_'s 7 lists with
    amsgrad and masters holds 24) and one of two chunks: the one-pass kernels (bf16 grads read,
    masters and state updated, params written) give the CPU kernels' masters and state, bit for
    bit emulated (same rules, fused multiply-adds on both) except the norm ops' sums (summation
    order) and on a CPU whose kernels do not fuse (x86-64 before AVX2: they round x*y + z twice),
    both within fp32's TOLERANCE, as on a GPU; and each param is its master rounded to nearest even."""
    sizes = [1 + 37 * k % 300 for k in range(40)] + [65537]
    args, kwargs = sample_args(op, torch.float32, amp=True, sizes=sizes)
    masters = 2 + [st.sample for st in SPECS[op].state].index("master")
    half = [p.bfloat16() for p in args[0]]
    args = (half, [g.bfloat16() for g in args[1]], *args[2:masters], [p.float() for p in half], *args[masters + 1:])
    cpu_args, cuda_args = _to(args, "cpu"), _to(args, backend.device, offset)
    getattr(torch.ops.fused_optim, op)(*cpu_args, **same_draws(kwargs))
    backend.op(op)(*cuda_args, **_kwargs_on(kwargs, backend.device))
    for p, m in zip(cuda_args[0], cuda_args[masters]):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
    fp32 = slice(2, None)  # the masters and state; the params follow the masters
    bitwise = cpu_kernels_fuse_multiply_adds() and op not in {"lamb_", "colossal_lamb_", "lars_", "colossal_lars_"}
    if backend.emulated and bitwise:
        for a, b in zip(cuda_args[fp32], cpu_args[fp32]):
            assert all(torch.equal(x, y) for x, y in zip(a, b) if isinstance(x, torch.Tensor)), op
    else:
        _assert_same(cuda_args[fp32], cpu_args[fp32], torch.float32, f"{op} with master weights")


@pytest.mark.parametrize("op", list(SCALARS))
def test_found_inf_on_the_device_changes_nothing(backend, op):
    args, kwargs = sample_args(op, torch.float32, amp=True)
    kwargs["found_inf"] = torch.tensor(1.0)
    cuda_args = _to(args, backend.device)
    before = copy.deepcopy(cuda_args)
    backend.op(op)(*cuda_args, **_kwargs_on(kwargs, backend.device))
    for a, b in zip(cuda_args, before):
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), op


def test_l2norm_and_sum_squares_on_cuda_match_cpu_for_mixed_dtypes(backend):
    tensors = [torch.randn(n).to(dt) for n, dt in [(1, torch.float32), (70000, torch.bfloat16), (33, torch.float16),
                                                  (140000, torch.float32)]]
    g_cpu, per_cpu = fused_optim.multi_tensor_l2norm(tensors, per_tensor=True, fused=True)
    sums_cpu, sums_dev = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64, device=backend.device)
    fused_optim.sum_squares_(sums_cpu, tensors, [0, 0, 1, 1], fused=True)
    on_device = [t.to(backend.device) for t in tensors]
    with backend.context():
        g_dev, per_dev = fused_optim.multi_tensor_l2norm(on_device, per_tensor=True, fused=True)
        fused_optim.sum_squares_(sums_dev, on_device, [0, 0, 1, 1], fused=True)
    assert g_dev.device.type == backend.device.type and per_dev.dtype == torch.float32
    torch.testing.assert_close(per_dev.cpu(), per_cpu, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_dev.cpu(), g_cpu, rtol=1e-6, atol=0)
    torch.testing.assert_close(sums_dev.cpu(), sums_cpu, rtol=1e-6, atol=0)


class _OpsCalled(TorchDispatchMode):
    """Records the names of the ops called inside it (from Python or from C++)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list_optimizers())
def test_every_registered_optimizer_steps_on_cuda_like_on_the_cpu(backend, name):
    """20 steps over three groups (odd shapes, a second group with its own lr, an empty one; a param
    that never gets a grad, one whose first grad comes at step 5): params and every state tensor
    after each step equal the CPU kernels'. Tolerance: fp32
    updates differ in fused multiply-adds and, for the trust ratios, in the norms' summation order
    (~1 ulp per step); 20 steps accumulate at most ~20 ulps of the tensor's scale."""
    kwargs = optimizer_kwargs(name)
    layout = make_groups(small=12)
    on_cpu, on_device = clone_groups(layout, kwargs["lr"]), clone_groups(layout, kwargs["lr"])
    for group in on_device:
        group["params"] = [torch.nn.Parameter(p.detach().to(backend.device)) for p in group["params"]]
    ours, theirs = create_optimizer(name, on_device, fused=True, **kwargs), create_optimizer(name, on_cpu, fused=True,
                                                                                           **kwargs)
    for step in range(20):
        set_grads(on_cpu, on_cpu, step)
        for group_device, group_cpu in zip(on_device, on_cpu):
            for p, q in zip(group_device["params"], group_cpu["params"]):
                p.grad = None if q.grad is None else q.grad.to(backend.device, copy=True)
        with backend.context(), _OpsCalled() as called:
            ours.step()
        theirs.step()
        # the CUDA code ran: the list op, or from the second step its bucket twin (an eager
        # step's one call, csrc/cpu/bucket.h), which calls the list op in C++, out of the mode's sight
        assert called.names & {f"{backend.namespace}::{ours.op_name}", f"{backend.namespace}::{ours.op_name}bucket"}
        assert_state_close(ours, theirs, 20 * torch.finfo(torch.float32).eps, f"{name} step {step}")
    assert ours.implementation == "fused"


OPTIMIZERS = [
    (lambda ps: fused_optim.FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False)),
    (lambda ps: fused_optim.FusedAdam(ps, lr=1e-2, weight_decay=1e-2, fused=True),
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2, foreach=False)),
]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


@pytest.mark.cuda
@pytest.mark.parametrize("ours, torch_opt", OPTIMIZERS, ids=["sgd", "adamw"])
def test_grad_scaler_end_to_end_matches_torch(ours, torch_opt):
    """fp16 autocast + GradScaler, a step with an overflow included (skipped on the device)."""
    models = [_model().cuda(), _model().cuda()]
    opts = [ours(list(models[0].parameters())), torch_opt(list(models[1].parameters()))]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2) for _ in models]
    for step in range(8):
        torch.manual_seed(100 + step)
        x, y = torch.randn(16, 32, device=CUDA), torch.randn(16, 4, device=CUDA)
        if step == 3:
            x[0, 0] = float("inf")  # this step overflows: nothing may change
        for model, opt, scaler in zip(models, opts, scalers):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert opts[0].implementation == "fused"
    assert scalers[0].get_scale() == scalers[1].get_scale()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _train(opt, params, steps, seed):
    for k in range(steps):
        g = torch.Generator().manual_seed(seed + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        opt.step()


@pytest.mark.cuda
def test_state_dict_moves_between_cpu_and_cuda_and_into_torch():
    """Adam state saved on CUDA (step counters on the device) continues on the CPU, in
    torch.optim.AdamW on CUDA, and back on CUDA from a CPU save, exactly as an unbroken run."""
    torch.manual_seed(0)
    init = [torch.randn(n) for n in (5, 4097, 70000)]
    make = lambda device: [torch.nn.Parameter(t.clone().to(device)) for t in init]  # noqa: E731
    unbroken = make(CUDA)
    opt = fused_optim.FusedAdam(unbroken, lr=1e-2, weight_decay=1e-2, fused=True)
    _train(opt, unbroken, 6, seed=10)
    first = make(CUDA)
    opt_first = fused_optim.FusedAdam(first, lr=1e-2, weight_decay=1e-2, fused=True)
    _train(opt_first, first, 3, seed=10)
    saved = opt_first.state_dict()
    assert all(s["step"].is_cuda and s["step"].dtype == torch.float32 for s in saved["state"].values())
    # CUDA -> CPU
    on_cpu = [torch.nn.Parameter(p.detach().cpu()) for p in first]
    opt_cpu = fused_optim.FusedAdam(on_cpu, lr=1e-2, weight_decay=1e-2, fused=True)
    opt_cpu.load_state_dict(copy.deepcopy(saved))
    _train(opt_cpu, on_cpu, 3, seed=13)
    assert all(not s["step"].is_cuda for s in opt_cpu.state.values())
    # CUDA -> torch.optim.AdamW on CUDA
    in_torch = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt_torch = torch.optim.AdamW(in_torch, lr=1e-2, weight_decay=1e-2)
    opt_torch.load_state_dict(copy.deepcopy(saved))
    _train(opt_torch, in_torch, 3, seed=13)
    # CPU save -> CUDA
    back = [torch.nn.Parameter(p.detach().cuda()) for p in on_cpu]
    cpu_saved = opt_cpu.state_dict()
    opt_back = fused_optim.FusedAdam(back, lr=1e-2, weight_decay=1e-2, fused=True)
    opt_back.load_state_dict(copy.deepcopy(cpu_saved))
    _train(opt_back, back, 1, seed=16)
    _train(opt, unbroken, 1, seed=16)
    for u, c, t, b in zip(unbroken, on_cpu, in_torch, back):
        torch.testing.assert_close(c, t.detach().cpu(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, u, rtol=1e-5, atol=1e-6)
    assert opt_back.implementation == "fused" and opt_cpu.implementation == "fused"


@pytest.mark.cuda
@pytest.mark.parametrize("cls, kw", [(fused_optim.FusedSGD, dict(momentum=0.9, weight_decay=1e-4)),
                                     (fused_optim.FusedAdam, dict(weight_decay=1e-2)),
                                     (fused_optim.FusedLAMB, dict(weight_decay=1e-2, max_grad_norm=1.0)),
                                     (fused_optim.LARS, dict(momentum=0.9, weight_decay=1e-4))],
                         ids=["sgd", "adamw", "lamb", "lars"])
def test_step_captured_in_a_cuda_graph_replays_like_eager(cls, kw):
    """lr is a device tensor changed in place between replays (a scheduler's fill_), grads are
    copied into static tensors; the replayed steps equal eager steps of a twin optimizer."""
    torch.manual_seed(0)
    init = [torch.randn(n, device=CUDA) for n in (3, 4097, 70000)]
    graphed = [torch.nn.Parameter(t.clone()) for t in init]
    eager = [torch.nn.Parameter(t.clone()) for t in init]
    lr = torch.tensor(0.01, device=CUDA)
    opt_g = cls(graphed, lr=lr, fused=True, **kw)
    opt_e = cls(eager, lr=0.01, fused=True, **kw)
    grads = [torch.randn_like(p) for p in graphed]
    for p, g in zip(graphed, grads):
        p.grad = g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: state, plans and kernels exist before capture
            opt_g.step()
    torch.cuda.current_stream().wait_stream(side)
    for p, g in zip(eager, grads):
        p.grad = g.clone()
    for _ in range(3):
        opt_e.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_g.step()
    for k in range(5):
        value = 0.01 * (k + 2)
        lr.fill_(value)
        for group in opt_e.param_groups:
            group["lr"] = value
        new = [torch.randn_like(p) for p in graphed]
        for g, n, p in zip(grads, new, eager):
            g.copy_(n)
            p.grad = n.clone()
        graph.replay()
        opt_e.step()
    torch.cuda.synchronize()
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_a_param_list_spanning_cpu_and_cuda_steps_each_bucket_on_its_device():
    """ColossalAI HybridAdam's layout: offloaded params on the CPU next to GPU params, one group."""
    torch.manual_seed(0)
    init = [torch.randn(n) for n in (7, 4097, 300, 65537)]
    devices = ["cpu", CUDA, "cpu", CUDA]
    mixed = [torch.nn.Parameter(t.clone().to(d)) for t, d in zip(init, devices)]
    alone = [torch.nn.Parameter(t.clone()) for t in init]
    opt_m = fused_optim.FusedAdam(mixed, lr=1e-2, weight_decay=1e-2, fused=True)
    opt_a = fused_optim.FusedAdam(alone, lr=1e-2, weight_decay=1e-2, fused=True)
    for k in range(4):
        _train(opt_m, mixed, 1, seed=k)
        _train(opt_a, alone, 1, seed=k)
    assert opt_m.implementation == "fused"
    for p, q, d in zip(mixed, alone, devices):
        assert p.device.type == torch.device(d).type and opt_m.state[p]["step"].device == p.device
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_adascale_cpp_hooks_on_cuda_match_the_cpu_run():
    """AdaScale's C++ hooks on CUDA params (sum_squares_ through the dispatcher, from autograd's
    device thread) give the CPU run's statistics, gains and params."""
    from adascale_loops import backward_window, model_and_groups

    def run(device):
        model, groups = model_and_groups(two_groups=True)
        model.to(device)
        opt = fused_optim.AdaScale(torch.optim.SGD(groups, lr=0.1, momentum=0.9), world_size=1,
                                   num_gradients_to_accumulate=3)
        for step in range(4):
            backward_window(model, step, 3, passes=2 if step == 2 else 3)
            opt.step()
            opt.zero_grad()
        return type(opt._hooks[0]).__name__, opt.state_dict()["adascale"], [p.cpu() for p in model.parameters()]

    cpu, cuda = run("cpu"), run(CUDA)
    assert cuda[0] == "_NativeHook" and cuda[1]["backwards"] == 0
    for k in ("grad_sqr_avg", "grad_var_avg"):
        torch.testing.assert_close(cuda[1][k], cpu[1][k], rtol=1e-5, atol=0)
    assert cuda[1]["scale_invariant_steps"] == pytest.approx(cpu[1]["scale_invariant_steps"], rel=1e-6)
    for p, q in zip(cuda[2], cpu[2]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
