"""The op layer: torch.library.opcheck for every op, torch.compile(fullgraph=True) of a step."""

import math

import pytest
import torch

import fused_optim
from fused_optim.spec import StateList
from fused_optim.specs import SPECS
from utils import compiled_step_matches_eager

# Every declared op, with its declared sample values: each joins every op-level test below.
SCALARS = {op: dict(spec.sample_scalars) for op, spec in SPECS.items()}
# How a per-step list of each schema type is filled for params 0, 1, …
PER_STEP_SAMPLES = {"bool[]": lambda count: [k % 3 == 0 for k in range(count)]}  # first_step: some True


def sample_state_list(state: StateList, dtype, sizes) -> list:
    """One state list: step counters 0, 1, 2, 0, …; moments that must be >= 0 uniform in [0, 1);
    master weights none (tests/core/test_master_weights.py has them); others (momentum buffers,
    memories) normal."""
    if state.sample == "master":
        return []
    if state.sample == "counter":
        return [torch.tensor(float(k % 3)) for k in range(len(sizes))]
    make = torch.rand if state.sample == "nonnegative" else torch.randn
    return [make(n, dtype=dtype) for n in sizes]


def sample_args(op: str, dtype, amp: bool, sizes=(1, 33, 4097)):
    """(params, grads, state lists..., per-step lists...), kwargs: split as the bucket twin wants
    them by ``state_and_per_step``."""
    spec = SPECS[op]
    params = [torch.randn(n, dtype=dtype) for n in sizes]
    grads = [torch.randn(n, dtype=dtype) for n in sizes]
    state = tuple(sample_state_list(st, dtype, sizes) for st in spec.state)
    per_step = tuple(PER_STEP_SAMPLES[kind](len(sizes)) for kind, _ in spec.per_step)
    kwargs = {**SCALARS[op], **spec.sample_extra()}
    if amp:
        kwargs.update(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(0.0))
    return (params, grads, *state, *per_step), kwargs


def same_draws(kwargs: dict) -> dict:
    """The kwargs with any generator replaced by a new one in its initial state (a second call
    of a random op then draws what the first drew)."""
    return {k: torch.Generator().manual_seed(v.initial_seed()) if isinstance(v, torch.Generator) else v
            for k, v in kwargs.items()}


def state_and_per_step(op: str, rest):
    """The op's list arguments after params and grads, split into (state lists, per-step lists)."""
    count = len(SPECS[op].state)
    return rest[:count], rest[count:]


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "amp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", list(SCALARS))
def test_opcheck(op, dtype, amp):
    args, kwargs = sample_args(op, dtype, amp)
    torch.library.opcheck(getattr(torch.ops.fused_optim, op).default, args, kwargs)


# Bucket layouts above the launcher's serial threshold (32768 elements), whose thread shares end
# inside a tensor (moved down to a multiple of 64 elements), inside a tensor smaller than that, on
# empty tensors and exactly on tensor boundaries, for 1, 2 and 3 threads.
LAUNCH_LAYOUTS = {"even": (1, 33, 4097), "tiny_at_split": (0, 40000, 0, 5, 0, 40000, 0),
                  "boundary": (32768, 0, 32768), "ragged": (70001, 3, 129, 64, 65, 0, 1)}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("layout", list(LAUNCH_LAYOUTS))
@pytest.mark.parametrize("op", list(SCALARS))
def test_kernel_equals_reference_on_the_op_level(op, layout, threads):
    """Every element updated once, whatever the layout and the number of threads sharing it."""
    args, kwargs = sample_args(op, torch.float64, amp=True, sizes=LAUNCH_LAYOUTS[layout])
    clone = lambda xs: [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]  # noqa: E731
    ref_args = tuple(clone(a) for a in args)
    torch.set_num_threads(threads)
    try:
        getattr(torch.ops.fused_optim, op)(*args, **kwargs)
    finally:
        torch.set_num_threads(2)  # the session's setting (conftest)
    SPECS[op].run_reference(*ref_args, **same_draws(kwargs))
    for a, b in zip(args, ref_args):
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls, kw", [(fused_optim.FusedSGD, dict(lr=0.1, momentum=0.9)),
                                     (fused_optim.FusedAdam, dict(lr=0.1, weight_decay=0.1))], ids=["sgd", "adam"])
@pytest.mark.slow
def test_compiled_step_with_fullgraph_matches_eager(cls, kw):
    """Works once the kernels are loaded (the build itself is not traceable): the first compiled
    step even creates the state inside the graph."""
    assert fused_optim.is_available()
    compiled_step_matches_eager(cls, kw, [torch.nn.Parameter(torch.randn(n)) for n in (7, 300)])


def step_bucket_twin(twin, lists, grads, per_step, kwargs) -> tuple[int, list[int]]:
    """One call of bucket twin ``twin`` over ``lists`` (params first) registered as a bucket: it
    must change nothing while the params have no .grad, then step with ``grads``. Returns the
    (freed) bucket's id and the tensors' versions before."""
    tensors = [t for lst in lists for t in lst]
    bucket = torch.ops.fused_optim.bucket_new(tensors, [len(lst) for lst in lists])
    versions = [t._version for t in tensors]
    try:
        assert twin(bucket, *per_step, **kwargs) == 1  # no .grad yet: nothing changes
        assert [t._version for t in tensors] == versions
        for p, g in zip(lists[0], grads):
            p.grad = g
        assert twin(bucket, *per_step, **kwargs) == 0
    finally:
        torch.ops.fused_optim.bucket_free(bucket)
    return bucket, versions


@pytest.mark.parametrize("op", list(SCALARS))
def test_bucket_twin_equals_the_list_op_and_bumps_versions(op):
    """The eager fast path: lists registered once, grads read from the params' .grad."""
    args, kwargs = sample_args(op, torch.float32, amp=True)
    twin_args = tuple([x.clone() if isinstance(x, torch.Tensor) else x for x in a] for a in args)
    params, grads, *rest = twin_args
    state, per_step = state_and_per_step(op, rest)
    lists = [params, *state]
    twin = getattr(torch.ops.fused_optim, op + "bucket")
    bucket, versions = step_bucket_twin(twin, lists, grads, per_step, kwargs)
    getattr(torch.ops.fused_optim, op)(*args, **same_draws(kwargs))
    for a, b in zip(args, twin_args):
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y)
    assert all(t._version == v + 1 for t, v in zip([t for lst in lists for t in lst], versions))
    assert all(g._version == 1 for g in grads)  # given a grad_scale, the step writes them back unscaled
    with pytest.raises(RuntimeError, match=f"bucket {bucket} does not exist"):
        twin(bucket, *per_step, **kwargs)


@pytest.mark.parametrize("op", list(SCALARS))
def test_bucket_twin_refuses_a_bucket_with_another_number_of_lists(op):
    """A twin takes as many lists as its list op has tensor lists, less the grads (params and
    state lists), and names itself and both counts otherwise, changing nothing."""
    args, kwargs = sample_args(op, torch.float32, amp=False)
    params, _, *rest = args
    state, per_step = state_and_per_step(op, rest)
    lists = [params, *state, params]  # one list too many
    before = [t.clone() for t in params]
    bucket = torch.ops.fused_optim.bucket_new([t for lst in lists for t in lst], [len(lst) for lst in lists])
    try:
        with pytest.raises(RuntimeError, match=rf"fused_optim::{op}bucket: bucket {bucket} holds {len(lists)} lists, "
                                               rf"the op needs {len(lists) - 1}"):
            getattr(torch.ops.fused_optim, op + "bucket")(bucket, *per_step, **kwargs)
    finally:
        torch.ops.fused_optim.bucket_free(bucket)
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_buckets_are_freed_with_their_optimizer():
    import gc

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = fused_optim.FusedSGD([p], lr=0.1, momentum=0.9, fused=True)
    opt.step()
    opt.step()
    bucket = next(iter(opt._plans.values())).buckets[0].bucket_id()
    del opt
    gc.collect()
    with pytest.raises(RuntimeError, match=f"bucket {bucket} does not exist"):
        torch.ops.fused_optim.sgd_bucket(bucket, [], **SCALARS["sgd_"])


def assert_stores_round_like_torch(sgd, dtype, lr: float, device="cpu") -> torch.Tensor:
    """An fp32 -> ``dtype`` (fp16 or bf16) store of ``sgd`` (an ``sgd_`` op) gives torch's bits:
    round to nearest even, subnormals kept, inf/nan preserved. The same update on fp32 storage,
    rounded by torch, is the oracle (identical fp32 math: p - lr*g). Grads span the dtype's range, so
    ``lr`` sends results under its normal range (1e-10) and over its largest value (3e5). Returns
    the fp32 results."""
    finfo = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    n = 4096 + 5
    mags = torch.pow(10.0, torch.empty(n).uniform_(math.log10(finfo.tiny), math.log10(finfo.max), generator=gen))
    g = (mags * torch.randint(0, 2, (n,), generator=gen).mul(2).sub(1)).to(dtype)
    g[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), finfo.tiny])
    p = torch.randn(n, generator=gen).to(dtype) * (finfo.tiny * 1e8)
    p[::2] = 0  # there, lr * g alone decides
    kw = dict(lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
              wd_after_momentum=False)
    low, in_fp32 = p.to(device), p.float().to(device)
    sgd([low], [g.to(device)], [], [], [], **kw)
    sgd([in_fp32], [g.float().to(device)], [], [], [], **kw)
    low, in_fp32 = low.cpu(), in_fp32.cpu()
    expected = in_fp32.to(dtype)
    nan = expected.isnan()
    assert torch.equal(low.isnan(), nan)
    assert torch.equal(low[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    return in_fp32


@pytest.mark.parametrize("lr", [1e-10, 0.3, 1.0, 3e5])
def test_bf16_results_round_exactly_like_torch(lr):
    """The kernels' fp32 -> bf16 store (a one-instruction path where the CPU has AVX512-BF16)
    must give torch's bits (see assert_stores_round_like_torch)."""
    in_fp32 = assert_stores_round_like_torch(torch.ops.fused_optim.sgd_, torch.bfloat16, lr)
    if lr == 1e-10:  # fp32 denormals were produced and kept as bf16 denormals
        tiny = torch.finfo(torch.float32).tiny
        expected = in_fp32.to(torch.bfloat16)
        assert ((in_fp32.abs() < tiny) & (in_fp32 != 0)).any()
        assert ((expected.float().abs() < tiny) & (expected != 0)).any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("emulated cuda", marks=pytest.mark.slow)])
@pytest.mark.parametrize("op", [op for op, spec in SPECS.items() if spec.compact])
def test_a_list_op_refuses_state_in_another_dtype_and_names_its_compact_twin(op, device):
    """A list op's state is in its values' dtype: its kernel knows no compact format (the compact
    twin does), so bf16 moments of fp32 params are refused, naming the list and the twin, and
    nothing changes; the CUDA binding (run through the emulation) as the CPU kernel."""
    library = torch.ops.fused_optim
    if device == "emulated cuda":
        fused_optim._build.load_emulated_cuda()
        library = torch.ops.fused_optim_emulated_cuda
    args, kwargs = sample_args(op, torch.float32, amp=False)
    params, grads, *rest = args
    first = SPECS[op].compact_lists()[0][0]
    rest[first] = [t.to(torch.bfloat16) for t in rest[first]]
    before = [t.clone() for lst in (params, *rest) for t in lst if isinstance(t, torch.Tensor)]
    with pytest.raises(RuntimeError, match=rf"fused_optim::{op}: {SPECS[op].state[first].name}\[0\] has dtype "
                                           rf"BFloat16 but the value it belongs to \(param or master\) has Float; .*"
                                           rf"compact twin, {op}compact_"):
        getattr(library, op)(params, grads, *rest, **kwargs)
    after = [t for lst in (params, *rest) for t in lst if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
