"""Master weights (``master_weights=True``): fp16/bf16 params stepped through fp32 masters kept in
the optimizer state, by the CPU kernels in one pass, by the emulated CUDA code, and by the
reference implementation. The contract: a step with master weights is the fp32 step of the
masters (from the half grads, cast to fp32), then each param written as its master rounded to
nearest even."""

import io

import pytest
import torch

import fused_optim
from fused_optim.registry import create_optimizer, list_optimizers
from utils import cpu_kernels_fuse_multiply_adds, optimizer_kwargs

HALF = [torch.float16, torch.bfloat16]
# Ops whose update reads per-tensor norms (LAMB's trust ratio and clipping, LARS): the norms of
# fp16/bf16 grads are summed in fp32 lanes of another block width than those of the fp32 grads
# (twice as many elements per block: 32 instead of 16 on AVX-512, 16 instead of 8 on AVX2), so they
# may differ in the last bits: each step's update then differs by at most ~2 ulps of the param's
# scale.
NORM_OPS = {"lamb_", "colossal_lamb_", "lars_", "colossal_lars_"}
STEPS = 6


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in (1, 33, 4097)] + [torch.randn(33, 65, generator=g).to(dtype)]


def _grads(params, step, dtype=None):
    """Step ``step``'s grads, random values rounded to ``dtype`` (default: the params')."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(dtype or p.dtype) for p in params]


def _run(name, params, fused, steps=STEPS, grad_dtype=None, **extra):
    """``steps`` steps of registry entry ``name`` over ``params`` (updated in place), with grads
    rounded to ``grad_dtype`` (default: the params' dtype)."""
    opt = create_optimizer(name, params, fused=fused, **optimizer_kwargs(name), **extra)
    for step in range(steps):
        for p, g in zip(params, _grads(params, step, grad_dtype)):
            p.grad = g.to(p.dtype)
        opt.step()
    return opt


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list_optimizers())
def test_a_master_weights_step_is_the_fp32_step_then_a_cast(name, dtype, fused):
    half = [torch.nn.Parameter(p) for p in _params(dtype)]
    fp32 = [torch.nn.Parameter(p.float()) for p in _params(dtype)]
    ours = _run(name, half, fused, master_weights=True)
    theirs = _run(name, fp32, True, grad_dtype=dtype)  # the fp32 kernels, tested against torch and the reference elsewhere
    assert ours.implementation == ("fused" if fused else "reference")
    exact = ours.op_name not in NORM_OPS and fused
    for i, (p, q) in enumerate(zip(half, fp32)):
        state, expected = ours.state[p], theirs.state[q]
        master = state["master_param"]
        assert master.dtype == torch.float32 and p.dtype == dtype
        assert torch.equal(p, master.to(dtype)), f"param {i} is not its master rounded"
        for key, value in expected.items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert state[key].dtype == torch.float32, f"state {key} of param {i} is not fp32"
        # Elementwise kernels: bit for bit. The reference: torch ops instead of fused multiply-adds,
        # ~1 ulp per operation of the ~10 of an update, per step; norm ops: see NORM_OPS.
        rtol = 0.0 if exact else STEPS * 10 * torch.finfo(torch.float32).eps
        for key in ("master_param", *(k for k, v in expected.items() if isinstance(v, torch.Tensor) and k != "step")):
            actual = state[key]
            wanted = q.detach() if key == "master_param" else expected[key]
            scale = max(wanted.abs().max().item(), 1.0)
            assert (actual - wanted).abs().max().item() <= rtol * scale, f"{key} of param {i}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list_optimizers())
def test_emulated_cuda_steps_with_master_weights_like_the_cpu_kernels(name, dtype):
    """The CUDA code with masters (one pass over the half grads, fp32 masters and state, the
    rounded params written; csrc/cuda/multi_tensor_apply.cuh): the CPU kernels' one pass, bit for
    bit for the elementwise ops (the same rules, one fused multiply-add per x*y + z on both; a CPU
    without FMA rounds twice), within the sums' last bits for the norm ops (other summation orders:
    ~1 ulp of the update per step, 4 ulps of the param's scale per step allowed)."""
    fused_optim._build.load_emulated_cuda()
    on_cpu = [torch.nn.Parameter(p) for p in _params(dtype)]
    emulated = [torch.nn.Parameter(p) for p in _params(dtype)]
    ours = create_optimizer(name, emulated, fused=True, master_weights=True, **optimizer_kwargs(name))
    with fused_optim.testing.emulated_cuda():
        for step in range(3):
            for p, g in zip(emulated, _grads(emulated, step)):
                p.grad = g
            ours.step()
    theirs = _run(name, on_cpu, True, steps=3, master_weights=True)
    eps = torch.finfo(torch.float32).eps
    if ours.op_name in NORM_OPS:
        rtol = 3 * 4 * eps
    elif cpu_kernels_fuse_multiply_adds():
        rtol = 0.0
    else:  # the CPU kernels round each x*y + z twice: ~1 ulp per operation of the ~10 of an update, per step
        rtol = 3 * 10 * eps
    for p, q in zip(emulated, on_cpu):
        for key, b in theirs.state[q].items():
            if isinstance(b, torch.Tensor) and key != "step":
                a = ours.state[p][key]
                assert (a - b).abs().max().item() <= rtol * max(b.abs().max().item(), 1.0), key
        assert torch.equal(p, ours.state[p]["master_param"].to(dtype))


def _emulated_steps(name, dtype, masters, steps=3):
    """``steps`` emulated CUDA steps of registry entry ``name`` over _params(dtype) (with masters)
    or their fp32 copies (without, on the same grads cast to fp32); per step the kernel launches,
    and of the last step the aten ops and the bytes they allocated (profiled)."""
    params = [torch.nn.Parameter(p if masters else p.float()) for p in _params(dtype)]
    opt = create_optimizer(name, params, fused=True, master_weights=masters, **optimizer_kwargs(name))
    launches = torch.ops.fused_optim_emulated_cuda.emulated_launches
    counts = []
    with fused_optim.testing.emulated_cuda():
        for step in range(steps):
            for p, g in zip(params, _grads(params, step, dtype)):
                p.grad = g.to(p.dtype)
            before = launches()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                opt.step()
            counts.append(launches() - before)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in events)
    return opt, params, counts, {e.name for e in events}, allocated


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list_optimizers())
def test_emulated_cuda_master_weights_step_is_one_pass_without_fp32_grads(name, dtype):
    """With masters the CUDA step launches exactly the kernels of the fp32 step (each pass reads
    the half grads and writes the rounded params itself: no cast pass, no copy-back pass), calls
    no aten copy (the fp32 grads and the copy into the params are gone) and allocates less than
    one fp32 copy of its largest grad (only the per-tensor sums' scratch, a few doubles per
    tensor); the half params are their masters rounded to nearest even (torch's .to)."""
    fused_optim._build.load_emulated_cuda()
    opt, params, counts, ops, allocated = _emulated_steps(name, dtype, masters=True)
    _, _, fp32_counts, fp32_ops, _ = _emulated_steps(name, dtype, masters=False)
    assert counts == fp32_counts and min(counts) >= 1
    assert not ops & {"aten::copy_", "aten::_to_copy"} and ops <= fp32_ops, sorted(ops)
    assert allocated < 4 * max(p.numel() for p in params), allocated
    for p in params:
        master = opt.state[p]["master_param"]
        assert p.dtype == dtype and master.dtype == torch.float32
        assert torch.equal(p, master.to(dtype))


@pytest.mark.parametrize("name", ["fused_adam", "lamb", "sgd", "sparsified_sgd"])
def test_master_weights_survive_save_and_load_exactly(name):
    """torch's load_state_dict casts floating state to the param's dtype; the fp32 masters and
    moments must come back fp32 and bit-exact, and training continues as if never interrupted
    (state dict saved to bytes, loaded with weights_only=True)."""
    straight = [torch.nn.Parameter(p) for p in _params(torch.float16)]
    opt = _run(name, straight, True, steps=4, master_weights=True)
    resumed = [torch.nn.Parameter(p) for p in _params(torch.float16)]
    first = _run(name, resumed, True, steps=2, master_weights=True)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    again = create_optimizer(name, resumed, fused=True, master_weights=True, **optimizer_kwargs(name))
    again.load_state_dict(torch.load(buffer, weights_only=True))
    if hasattr(first, "generator"):
        again.generator.set_state(first.generator.get_state())
    assert again.state[resumed[1]]["master_param"].dtype == torch.float32
    for step in range(2, 4):
        for p, g in zip(resumed, _grads(resumed, step)):
            p.grad = g
        again.step()
    for p, q in zip(resumed, straight):
        assert torch.equal(p, q)
        for key, value in opt.state[q].items():
            assert torch.equal(again.state[p][key], value), key


def test_an_overflow_step_changes_nothing_and_makes_no_state():
    """GradScaler's found_inf skips the step: params, masters and the first step's state as before."""
    params = [torch.nn.Parameter(p) for p in _params(torch.float16)]
    opt = fused_optim.FusedAdam(params, lr=0.1, master_weights=True, fused=True)
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and len(opt.state) == 0
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert all(opt.state[p]["step"].item() == 1 for p in params)
    assert all(torch.equal(p, opt.state[p]["master_param"].half()) for p in params)


def test_fp32_params_of_a_master_weights_group_have_no_master():
    half, single = torch.nn.Parameter(torch.randn(5).half()), torch.nn.Parameter(torch.randn(5))
    opt = fused_optim.FusedSGD([half, single], lr=0.1, momentum=0.9, master_weights=True, fused=True)
    half.grad, single.grad = torch.randn(5).half(), torch.randn(5)
    opt.step()
    assert "master_param" in opt.state[half] and "master_param" not in opt.state[single]
    assert opt.state[single]["momentum_buffer"].dtype == torch.float32


def test_apex_materialize_master_grads_false_means_master_weights():
    p = torch.nn.Parameter(torch.randn(5).half())
    opt = fused_optim.FusedSGD([p], lr=0.1, materialize_master_grads=False)
    assert opt.defaults["master_weights"] is True
    with pytest.raises(ValueError, match="master_weights value: False contradicts materialize_master_grads=False"):
        fused_optim.FusedSGD([p], lr=0.1, materialize_master_grads=False, master_weights=False)
    with pytest.raises(ValueError, match="Invalid master_weights value: 'yes'"):
        fused_optim.FusedAdam([p], master_weights="yes")


def test_turning_master_weights_off_with_masters_in_the_state_is_refused():
    p = torch.nn.Parameter(torch.randn(5).half())
    opt = fused_optim.FusedAdam([p], master_weights=True)
    p.grad = torch.randn(5).half()
    opt.step()
    opt.param_groups[0]["master_weights"] = False
    with pytest.raises(RuntimeError, match="param 0 of group 0 has a master_param in its state"):
        opt.step()


def test_the_kernels_refuse_masters_they_cannot_use():
    p, g = torch.randn(4), torch.randn(4)
    with pytest.raises(RuntimeError, match=r"master_params are for float16/bfloat16 params, but params\[0\] is Float"):
        torch.ops.fused_optim.sgd_([p], [g], [], [p.clone()], [], lr=0.1, momentum=0.0, dampening=0.0,
                                   weight_decay=0.0, nesterov=False, maximize=False, wd_after_momentum=False)
    h = p.half()
    with pytest.raises(RuntimeError, match=r"master_params\[0\] must be a contiguous float32 tensor"):
        torch.ops.fused_optim.sgd_([h], [g.half()], [], [h.clone()], [], lr=0.1, momentum=0.0, dampening=0.0,
                                   weight_decay=0.0, nesterov=False, maximize=False, wd_after_momentum=False)


def test_cpu_adam_keeps_the_fp32_moments_of_half_params_in_its_offload_files(tmp_path):
    """ColossalAI's nvme_offload_fraction with master weights: the offloaded moments are the fp32
    ones, file-backed, and the step reads and writes them there."""
    params = [torch.nn.Parameter(p) for p in _params(torch.float16)]
    opt = fused_optim.CPUAdam(params, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), master_weights=True)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()
    for p in params:
        files = opt.state_files.files_of(p)
        assert files
        for path in files:
            key = path.stem.split("_", 2)[2]
            assert opt.state[p][key].dtype == torch.float32
            assert opt.state[p][key].untyped_storage().filename == str(path)
            assert torch.equal(torch.from_file(str(path), size=p.numel(), dtype=torch.float32),
                               opt.state[p][key].reshape(-1))
