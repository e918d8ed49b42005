"""The CUDA kernels on a GPU (every test is marked ``cuda``; without a GPU they skip with the
reason, and tests/test_cuda_compile.py still compiles the CUDA code): CUDA kernel == reference ==
CPU kernel for every op, in fp32, bf16 and fp16, on odd sizes, more tensors and chunks than one
launch holds and misaligned storage offsets; the overflow skip on the device; GradScaler end to
end; a state_dict moving between CPU and CUDA; a step captured and replayed in a CUDA graph; a param
list spanning CPU and CUDA; and AdaScale's C++ gradient hooks on CUDA params."""

import copy

import pytest
import torch

import fused_optim
from fused_optim import _reference
from test_ops import SCALARS, sample_args, same_draws

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")

# Per dtype: (rtol, atol) between two implementations of one update (ulps of the storage type:
# fused multiply-adds and sum orders differ; results are rounded to the storage type once).
TOLERANCE = {torch.float32: (2e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (2e-3, 1e-4)}


def _to(args, device, offset=False):
    """The op's arguments on ``device``; with ``offset`` every tensor starts one element into its
    storage (contiguous, but not 16-byte aligned: the kernels' scalar path)."""
    def move(x):
        if not isinstance(x, torch.Tensor):
            return x
        if offset and x.dim() == 1 and x.is_floating_point() and x.numel() > 1:
            buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=device)
            buf[1:].copy_(x)
            return buf[1:]
        return x.to(device)
    return tuple([move(x) for x in a] if isinstance(a, list) else move(a) for a in args)


def _kwargs_on(kwargs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in same_draws(kwargs).items()}


def _assert_same(a_args, b_args, dtype, what):
    rtol, atol = TOLERANCE[dtype]
    for a, b in zip(a_args, b_args):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x.cpu().double(), y.cpu().double(), rtol=rtol, atol=atol, msg=what)


@pytest.mark.parametrize("offset", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("op", list(SCALARS))
def test_cuda_kernel_equals_reference_and_cpu_kernel(op, dtype, offset):
    args, kwargs = sample_args(op, dtype, amp=True)
    cpu_args = _to(args, "cpu")
    cuda_args = _to(args, CUDA, offset)
    ref_args = _to(args, CUDA)
    getattr(torch.ops.fused_optim, op)(*cpu_args, **same_draws(kwargs))
    getattr(torch.ops.fused_optim, op)(*cuda_args, **_kwargs_on(kwargs, CUDA))
    getattr(_reference, op)(*ref_args, **_kwargs_on(kwargs, CUDA))
    assert cuda_args[0][1].is_cuda
    _assert_same(cuda_args, cpu_args, dtype, f"{op}: CUDA vs CPU kernel")
    _assert_same(cuda_args, ref_args, dtype, f"{op}: CUDA kernel vs reference")


@pytest.mark.parametrize("op", ["sgd_", "adam_", "lamb_", "lars_"])
def test_more_tensors_and_chunks_than_one_launch_holds(op):
    """200 odd-sized tensors (a launch holds at most 96) and one of 320 * 65536 + 5 elements (a
    launch holds 320 chunks), with a Tensor lr on the device."""
    g = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 3000, (200,), generator=g)] + [320 * 65536 + 5]
    args, kwargs = sample_args(op, torch.float32, amp=True)
    n_lists = len(args)
    new = []
    for k in range(n_lists):
        lst = args[k]
        if isinstance(lst[0], bool):
            new.append([False] * len(sizes))
        elif lst[0].dim() == 0:  # step counters
            new.append([torch.tensor(3.0) for _ in sizes])
        else:
            new.append([torch.randn(n, generator=g).abs_() for n in sizes])
    args = tuple(new)
    kwargs["lr_tensor"] = torch.tensor(kwargs["lr"])
    cpu_args, cuda_args = _to(args, "cpu"), _to(args, CUDA)
    getattr(torch.ops.fused_optim, op)(*cpu_args, **same_draws(kwargs))
    getattr(torch.ops.fused_optim, op)(*cuda_args, **_kwargs_on(kwargs, CUDA))
    _assert_same(cuda_args, cpu_args, torch.float32, f"{op} over {len(sizes)} tensors")


@pytest.mark.parametrize("op", list(SCALARS))
def test_found_inf_on_the_device_changes_nothing(op):
    args, kwargs = sample_args(op, torch.float32, amp=True)
    kwargs["found_inf"] = torch.tensor(1.0)
    cuda_args = _to(args, CUDA)
    before = copy.deepcopy(cuda_args)
    getattr(torch.ops.fused_optim, op)(*cuda_args, **_kwargs_on(kwargs, CUDA))
    for a, b in zip(cuda_args, before):
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), op


def test_l2norm_and_sum_squares_on_cuda_match_cpu_for_mixed_dtypes():
    tensors = [torch.randn(n).to(dt) for n, dt in [(1, torch.float32), (70000, torch.bfloat16), (33, torch.float16),
                                                  (140000, torch.float32)]]
    g_cpu, per_cpu = fused_optim.multi_tensor_l2norm(tensors, per_tensor=True, fused=True)
    g_cuda, per_cuda = fused_optim.multi_tensor_l2norm([t.cuda() for t in tensors], per_tensor=True, fused=True)
    assert g_cuda.is_cuda and per_cuda.dtype == torch.float32
    torch.testing.assert_close(per_cuda.cpu(), per_cpu, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_cuda.cpu(), g_cpu, rtol=1e-6, atol=0)
    sums_cpu, sums_cuda = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64, device=CUDA)
    fused_optim.sum_squares_(sums_cpu, tensors, [0, 0, 1, 1], fused=True)
    fused_optim.sum_squares_(sums_cuda, [t.cuda() for t in tensors], [0, 0, 1, 1], fused=True)
    torch.testing.assert_close(sums_cuda.cpu(), sums_cpu, rtol=1e-6, atol=0)


OPTIMIZERS = [
    (lambda ps: fused_optim.FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False)),
    (lambda ps: fused_optim.FusedAdam(ps, lr=1e-2, weight_decay=1e-2, fused=True),
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2, foreach=False)),
]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


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
