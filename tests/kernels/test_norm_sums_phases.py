"""The layer-wise ops' two calls for sharded params (``norm_sums`` / ``sums_only``): the first
writes each tensor's local sums (Σv², Σx²) and nothing else, the second updates with the sums it
is given. Given the sums the first call wrote, the two calls leave every tensor bit-identical to
one plain call, for every op, format, trust-ratio setting and thread count; the sums are the
squares summed in float64, and the reference agrees with the kernel in both calls."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

import fused_optim
from fused_optim import state_formats as sf
from fused_optim.specs import SPECS

# More than kWhole = 2^18 elements (all threads take it alone), one split at the two threads' part
# boundary (the other tensors add up to more than the launcher's serial threshold, 32768), an empty
# one, and tensors a thread holds whole: every Placement of the two-pass launcher.
SIZES = (270_001, 20_003, 0, 16_000, 7)
# The other checks: shared between two threads, a SIMD tail, an empty tensor, and a tiny one.
SMALL = (40_000, 0, 4097, 7)


@dataclass(frozen=True)
class Format:
    """How a call holds its params and state: the params' dtype, fp32 master weights, compact
    state ("bf16" / "8bit": the compact twin) and stochastic rounding of the state / params."""

    id: str
    dtype: torch.dtype
    masters: bool = False
    state: str | None = None
    sr_state: bool = False
    sr_params: bool = False


FORMATS = [
    Format("fp32", torch.float32), Format("fp64", torch.float64),
    Format("fp16", torch.float16), Format("bf16", torch.bfloat16),
    Format("fp16-master", torch.float16, masters=True), Format("bf16-master", torch.bfloat16, masters=True),
    Format("bf16state", torch.float32, state="bf16"), Format("8bit", torch.float32, state="8bit"),
    Format("bf16state-sr", torch.float32, state="bf16", sr_state=True),
    Format("8bit-bf16-srparams", torch.bfloat16, state="8bit", sr_params=True),
    Format("pure-bf16-sr", torch.bfloat16, state="bf16", sr_state=True, sr_params=True),
]

# (op, id, scalars over the op's samples): with and without the trust ratio, for each op.
CONFIGS = [
    ("lars_", "off", dict(weight_decay=0.0, always_adapt=False)),
    ("lars_", "wd-clip", dict(weight_decay=0.01, trust_clip=True)),
    ("lars_", "always-adapt", dict(weight_decay=0.0, always_adapt=True, trust_clip=False)),
    ("colossal_lars_", "lars", dict(lars=True)),
    ("colossal_lars_", "off", dict(lars=False)),
    ("lamb_", "off", dict(weight_decay=0.0, use_nvlamb=False, max_grad_norm=0.0, global_grad_norm=None)),
    ("lamb_", "wd-clip-global-norm", dict(weight_decay=0.01, trust_clip=True)),  # samples: clips with 30.0
    ("lamb_", "nvlamb-l2-own-norm", dict(weight_decay=0.01, use_nvlamb=True, adam_w_mode=False,
                                         global_grad_norm=None)),
    ("colossal_lamb_", "lamb", dict(adam=False)),
    ("colossal_lamb_", "adam", dict(adam=True)),
]
CONFIG_IDS = [f"{op}{cid}" for op, cid, _ in CONFIGS]
LAMB_OPS = ("lamb_", "colossal_lamb_")


def _moments(gen, n: int, nonnegative: bool, state: str | None, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A state tensor of n elements in its format, and for 8-bit its absmax: random codes under
    random scales (any code is a valid state; cheaper than encoding values)."""
    if state == "8bit":
        blocks = (n + sf.BLOCK - 1) // sf.BLOCK
        return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8), torch.rand(blocks, generator=gen) + 0.5
    values = torch.rand(n, generator=gen) if nonnegative else torch.randn(n, generator=gen)
    return values.to(torch.bfloat16 if state == "bf16" else dtype), None


@functools.cache
def _base_inputs(op: str, fmt: Format, sizes: tuple[int, ...]) -> list:
    """The list arguments of one call: made once per op, format and sizes, cloned for each call
    (:func:`inputs`)."""
    spec = SPECS[op]
    gen = torch.Generator().manual_seed(7)
    values = [torch.randn(n, generator=gen) for n in sizes]  # fp32 masters, or the params' values
    params = [v.to(fmt.dtype) for v in values]
    grads = [torch.randn(n, generator=gen).to(fmt.dtype) for n in sizes]
    state_dtype = torch.float32 if fmt.masters else fmt.dtype
    lists, absmaxes = [], []
    for st in spec.state[:-1]:
        if st.sample == "counter":
            lists.append([torch.tensor(float(k % 3)) for k in range(len(sizes))])
            continue
        made = [_moments(gen, n, st.sample == "nonnegative", fmt.state, state_dtype) for n in sizes]
        lists.append([m for m, _ in made])
        absmaxes += [absmax for _, absmax in made if absmax is not None]
    lists.append(values if fmt.masters else [])
    if fmt.state is not None:
        keys = [torch.tensor(12345678901 + 7 * i) for i in range(len(sizes))] if fmt.sr_state or fmt.sr_params else []
        lists += [absmaxes, keys]
    per_step = [[k % 3 == 0 for k in range(len(sizes))]] if spec.per_step else []
    return [params, grads, *lists, *per_step]


def inputs(op: str, fmt: Format, sizes=SIZES) -> list:
    """A fresh copy of the call's arguments (tensor lists and per-step lists)."""
    args = _base_inputs(op, fmt, tuple(sizes))
    return [[x.clone() if isinstance(x, torch.Tensor) else x for x in lst] for lst in args]


def scalars(op: str, overrides: dict, fmt: Format) -> dict:
    """The op's samples with the overrides (None: left out), and the compact twin's flags."""
    spec = SPECS[op]
    flags = dict(stochastic_state=fmt.sr_state, stochastic_params=fmt.sr_params) if fmt.state else {}
    kwargs = {**spec.sample_scalars, **spec.sample_extra(), **overrides, **flags}
    return {k: v for k, v in kwargs.items() if v is not None}


def kernel(op: str, fmt: Format):
    fused_optim._build.load("cpu")
    return getattr(torch.ops.fused_optim, SPECS[op].compact_name if fmt.state else op)


def reference(op: str, fmt: Format):
    spec = SPECS[op]
    return spec.run_compact_reference if fmt.state else spec.run_reference


def tensors(args: list) -> list[torch.Tensor]:
    return [x for lst in args for x in lst if isinstance(x, torch.Tensor)]


def assert_bits_equal(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    """Same dtypes, shapes and bytes (-0.0 and 0.0 differ; NaNs of the same bits match)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: tensor {i}"
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{what}: tensor {i}"


def with_threads(threads: int, run):
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(2)  # the session's setting (conftest)


AMP = dict(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(0.0))
# Sums of a whole tensor unlike the local ones: ||v|| halved, ||x|| doubled (a trust ratio ||v||/||x||
# a quarter of the local one: not clipped to 1 where the local one is).
WHOLE = torch.tensor([0.25, 4.0], dtype=torch.float64)


@pytest.mark.parametrize("threads", [1, 2])  # two threads take every Placement; one, kThread and kAll
@pytest.mark.parametrize("fmt", FORMATS, ids=[f.id for f in FORMATS])
@pytest.mark.parametrize("op, cid, overrides", CONFIGS, ids=CONFIG_IDS)
def test_the_two_calls_are_one_call_bit_for_bit(op, cid, overrides, fmt, threads):
    """sums_only then the update with those sums == one plain call, every tensor to the bit (the
    step counters and rounding keys included); the first call changes nothing but the sums."""
    fn, kwargs = kernel(op, fmt), {**scalars(op, overrides, fmt), **AMP}
    plain, phased = inputs(op, fmt), inputs(op, fmt)
    before = [t.clone() for t in tensors(phased)]
    sums = torch.full((len(SIZES), 2), -1.0, dtype=torch.float64)

    def run():
        fn(*plain, **kwargs)
        fn(*phased, **kwargs, norm_sums=sums, sums_only=True)
        assert_bits_equal(tensors(phased), before, "the sums-only call changed a tensor")
        assert bool((sums >= 0).all()), sums  # every row written, the empty tensor's too
        fn(*phased, **kwargs, norm_sums=sums)

    with_threads(threads, run)
    assert_bits_equal(tensors(phased), tensors(plain), f"{op} {cid} {fmt.id}: two calls differ from one")
    assert sums[SIZES.index(0)].tolist() == [0.0, 0.0]


def _lane_bound(fmt: Format) -> float:
    """The relative error of a kernel sum against the float64 one. The kernels add squares in
    the math type (fp32; fp64 for fp64 params) in fixed per-lane chains over 16384-element items
    (at least 8 lanes, AVX2: at most 2048 terms a chain), then add the chains and items in
    float64. Non-negative terms: each chain is within 2048 ulps (relative) of its exact sum, and
    so is the total."""
    eps = torch.finfo(torch.float64 if fmt.dtype == torch.float64 else torch.float32).eps
    return 2048 * eps


# The LARS ops' sums-only call is the same whatever the trust ratio's settings: their settings
# without it (the sums are written all the same), in every format. LAMB's u depends on every
# setting: each op's first setting in every format, the others in fp32 and fp64.
SUMS_CASES = [pytest.param(op, cid, overrides, fmt, id=f"{op}{cid}-{fmt.id}")
              for op, cid, overrides in CONFIGS for fmt in FORMATS
              if (cid == "off" and op not in LAMB_OPS) or cid in ("wd-clip-global-norm", "lamb")
              or (op in LAMB_OPS and fmt.id in ("fp32", "fp64"))]


@pytest.mark.parametrize("op, cid, overrides, fmt", SUMS_CASES)
def test_the_sums_are_the_squares_summed_in_float64(op, cid, overrides, fmt):
    """S_p = Σv² of the values updated (the fp32 masters if any) before the update; LARS's
    S_x = Σg² of the grads as stored (not unscaled), LAMB's Σu² of the update direction: the
    reference's u (math type, from the new moments), whose sums-only call also changes nothing."""
    fn, kwargs = kernel(op, fmt), {**scalars(op, overrides, fmt), **AMP}
    args = inputs(op, fmt, SMALL)
    sums = torch.zeros(len(SMALL), 2, dtype=torch.float64)
    fn(*args, **kwargs, norm_sums=sums, sums_only=True)
    masters = args[len(SPECS[op].state) + 1]
    values = masters or args[0]
    rtol = _lane_bound(fmt)
    expected_p = torch.stack([v.double().square().sum() for v in values])
    torch.testing.assert_close(sums[:, 0], expected_p, rtol=rtol, atol=0.0)
    if op in LAMB_OPS:
        ref_args, ref_sums = inputs(op, fmt, SMALL), torch.zeros_like(sums)
        reference(op, fmt)(*ref_args, **kwargs, norm_sums=ref_sums, sums_only=True)
        assert_bits_equal(tensors(ref_args), tensors(inputs(op, fmt, SMALL)), "the reference's sums-only call wrote")
        # u is computed elementwise in fp32 by both (the kernel with fused multiply-adds): a few
        # ulps apart, within the chains' bound
        torch.testing.assert_close(sums[:, 1], ref_sums[:, 1], rtol=rtol, atol=0.0)
    else:
        expected_g = torch.stack([g.double().square().sum() for g in args[1]])
        torch.testing.assert_close(sums[:, 1], expected_g, rtol=rtol, atol=0.0)


@pytest.mark.parametrize("op", ["lamb_", "colossal_lamb_"])
def test_lamb_sums_u_of_a_first_step_in_closed_form(op):
    """From zero moments with bias correction, u = g/(|g| + eps) + wd·p (ĝ's scale cancels):
    the oracle of the LAMB sums without the reference's math."""
    gen = torch.Generator().manual_seed(3)
    sizes = (5, 40_000, 0)
    p = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]
    g = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]
    zeros = lambda: [torch.zeros(n, dtype=torch.float64) for n in sizes]  # noqa: E731
    steps = [torch.tensor(0.0) for _ in sizes]
    eps, wd = 1e-6, 0.01
    kw = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=eps, weight_decay=wd)
    if op == "lamb_":
        kw.update(bias_correction=True, grad_averaging=True, adam_w_mode=True, max_grad_norm=0.0, use_nvlamb=False,
                  trust_clip=False)
    else:
        kw.update(adam=False, bias_correction=False)  # ColossalAI corrects the lr, not the moments: c1 = c2 = 1
    sums = torch.zeros(len(sizes), 2, dtype=torch.float64)
    fused_optim._build.load("cpu")
    getattr(torch.ops.fused_optim, op)(p, g, zeros(), zeros(), steps, [], **kw, grad_scale=torch.tensor(4.0),
                                       norm_sums=sums, sums_only=True)
    assert [s.item() for s in steps] == [0.0] * len(sizes)
    for t in range(len(sizes)):
        gh = g[t] / 4.0
        if op == "lamb_":
            u = gh / (gh.abs() + eps) + wd * p[t]
        else:  # m = 0.1·ĝ, v = 0.01·ĝ²: u = 0.1·ĝ/(0.1·|ĝ| + eps)
            u = 0.1 * gh / (0.1 * gh.abs() + eps) + wd * p[t]
        expected = torch.stack([p[t].square().sum(), u.square().sum()])
        torch.testing.assert_close(sums[t], expected, rtol=2048 * torch.finfo(torch.float64).eps, atol=0.0)


# fp64 (the reference is the oracle: test_ops' tolerance), fp32 and bf16 params with fp32 masters
# (test_layerwise's tolerances: fp32 within 1e-5, a bf16 param its master rounded, which may land
# one ulp away); the compact formats' comparison, with its tolerance, is test_state_dtype's.
REFERENCE_FORMATS = ("fp64", "fp32", "bf16-master")
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: torch.finfo(torch.bfloat16).eps}


@pytest.mark.parametrize("fmt_id", REFERENCE_FORMATS)
@pytest.mark.parametrize("op, cid, overrides", CONFIGS, ids=CONFIG_IDS)
def test_the_reference_is_the_kernel_in_both_calls(op, cid, overrides, fmt_id):
    """The same sums (to the chains' bound), and the same update from the same given sums."""
    fmt = next(f for f in FORMATS if f.id == fmt_id)
    kwargs = {**scalars(op, overrides, fmt), **AMP}
    ours, ref = inputs(op, fmt, SMALL), inputs(op, fmt, SMALL)
    sums, ref_sums = (torch.zeros(len(SMALL), 2, dtype=torch.float64) for _ in range(2))
    kernel(op, fmt)(*ours, **kwargs, norm_sums=sums, sums_only=True)
    reference(op, fmt)(*ref, **kwargs, norm_sums=ref_sums, sums_only=True)
    torch.testing.assert_close(sums, ref_sums, rtol=_lane_bound(fmt), atol=0.0)
    scaled = sums * WHOLE  # other totals, as a sharded tensor's
    kernel(op, fmt)(*ours, **kwargs, norm_sums=scaled)
    reference(op, fmt)(*ref, **kwargs, norm_sums=scaled.clone())
    for a, b in zip(tensors(ours), tensors(ref)):
        torch.testing.assert_close(a, b, rtol=RTOL[a.dtype], atol=RTOL[a.dtype] * 0.1)


@pytest.mark.parametrize("op, cid, overrides", [c for c in CONFIGS if c[1] not in ("off", "adam")],
                         ids=[i for i, c in zip(CONFIG_IDS, CONFIGS) if c[1] not in ("off", "adam")])
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_the_update_takes_the_sums_it_is_given(op, cid, overrides, fused):
    """With the trust ratio, other sums give another update (the whole tensor's norms do count),
    and the sums of the call's own tensors give the plain call's (within fp32 for the reference,
    whose own norms are taken by vector_norm)."""
    fmt = FORMATS[0]
    run = kernel(op, fmt) if fused else reference(op, fmt)
    kwargs = {**scalars(op, overrides, fmt), **AMP}
    plain, own, other = (inputs(op, fmt, SMALL) for _ in range(3))
    sums = torch.zeros(len(SMALL), 2, dtype=torch.float64)
    run(*plain, **kwargs)
    run(*inputs(op, fmt, SMALL), **kwargs, norm_sums=sums, sums_only=True)
    run(*own, **kwargs, norm_sums=sums.clone())
    run(*other, **kwargs, norm_sums=sums * WHOLE)
    for a, b in zip(own[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    moved = [not torch.allclose(a, b, rtol=1e-4, atol=0) for a, b in zip(other[0], plain[0]) if a.numel()]
    assert any(moved)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("op", ["lars_", "colossal_lars_", "lamb_", "colossal_lamb_"])
def test_an_overflowed_step_writes_nothing_in_either_call(op, fused):
    """found_inf set (AMP overflow): the sums-only call leaves even norm_sums as it was, and the
    update changes nothing."""
    fmt = FORMATS[0]
    run = kernel(op, fmt) if fused else reference(op, fmt)
    kwargs = {**scalars(op, {}, fmt), "grad_scale": torch.tensor(8.0), "found_inf": torch.tensor(1.0)}
    args = inputs(op, fmt, SMALL)
    sums = torch.full((len(SMALL), 2), -1.0, dtype=torch.float64)
    run(*args, **kwargs, norm_sums=sums, sums_only=True)
    run(*args, **kwargs, norm_sums=sums)
    assert bool((sums == -1.0).all())
    assert_bits_equal(tensors(args), tensors(inputs(op, fmt, SMALL)), "an overflowed step wrote")


BAD_NORM_SUMS = {
    "float32": lambda n: torch.zeros(n, 2),
    "rows": lambda n: torch.zeros(n + 1, 2, dtype=torch.float64),
    "columns": lambda n: torch.zeros(n, 3, dtype=torch.float64),
    "flat": lambda n: torch.zeros(2 * n, dtype=torch.float64),
    "strided": lambda n: torch.zeros(2, n, dtype=torch.float64).t(),
}


@pytest.mark.parametrize("sums_only", [True, False], ids=["sums_only", "update"])
@pytest.mark.parametrize("bad", list(BAD_NORM_SUMS))
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("op", ["lars_", "colossal_lars_", "lamb_", "colossal_lamb_"])
def test_a_bad_norm_sums_is_refused_before_anything_is_written(op, fused, bad, sums_only):
    fmt = FORMATS[0]
    run = kernel(op, fmt) if fused else reference(op, fmt)
    args = inputs(op, fmt, sizes=(7, 0, 33))
    norm_sums = BAD_NORM_SUMS[bad](3)
    with pytest.raises((RuntimeError, ValueError), match=r"norm_sums must be a contiguous float64 tensor of "
                                                         r"shape \[3, 2\] \(one row per param\)"):
        run(*args, **scalars(op, {}, fmt), **AMP, norm_sums=norm_sums, sums_only=sums_only)
    assert_bits_equal(tensors(args), tensors(inputs(op, fmt, sizes=(7, 0, 33))), "a refused call wrote")
    assert not norm_sums.any()


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("op", ["lars_", "colossal_lars_", "lamb_", "colossal_lamb_"])
def test_sums_only_without_norm_sums_is_refused(op, fused):
    fmt = FORMATS[0]
    run = kernel(op, fmt) if fused else reference(op, fmt)
    args = inputs(op, fmt, sizes=(7, 0, 33))
    with pytest.raises((RuntimeError, ValueError), match="sums_only=True needs norm_sums"):
        run(*args, **scalars(op, {}, fmt), **AMP, sums_only=True)
    assert_bits_equal(tensors(args), tensors(inputs(op, fmt, sizes=(7, 0, 33))), "a refused call wrote")


@pytest.mark.parametrize("op", ["lars_", "lamb_"])
def test_the_bucket_twin_takes_the_two_calls(op):
    """The eager fast path forwards norm_sums and sums_only: the same sums and the same update."""
    fmt = FORMATS[0]
    kwargs = {**scalars(op, {}, fmt), **AMP}
    ours, twin_args = inputs(op, fmt, sizes=(7, 0, 4097)), inputs(op, fmt, sizes=(7, 0, 4097))
    params, grads, *rest = twin_args
    count = len(SPECS[op].state)
    lists, per_step = [params, *rest[:count]], rest[count:]
    for p, g in zip(params, grads):
        p.grad = g
    sums, twin_sums = (torch.zeros(3, 2, dtype=torch.float64) for _ in range(2))
    fn = kernel(op, fmt)
    twin = getattr(torch.ops.fused_optim, op + "bucket")
    bucket = torch.ops.fused_optim.bucket_new([t for lst in lists for t in lst], [len(lst) for lst in lists])
    try:
        for call in ({"sums_only": True}, {}):
            fn(*ours, **kwargs, norm_sums=sums, **call)
            assert twin(bucket, *per_step, **kwargs, norm_sums=twin_sums, **call) == 0
    finally:
        torch.ops.fused_optim.bucket_free(bucket)
    assert torch.equal(sums, twin_sums) and bool((sums[[0, 2]] > 0).all())
    assert_bits_equal(tensors(twin_args), tensors(ours), "the bucket twin's two calls")
