"""The phased calls of the layer-wise ops on CUDA (``norm_sums`` / ``sums_only``: the per-tensor
sums of a sharded step, csrc/cuda/launch.h ``NormSums``) on both backends of
tests/emulation/test_cuda.py (the GPU, tests marked ``cuda``, and the CUDA emulation), for
``lars_``, ``colossal_lars_``, ``lamb_``, ``colossal_lamb_`` and their compact twins:

* ``op(..., norm_sums=sums, sums_only=True)`` then ``op(..., norm_sums=sums)`` leaves every tensor
  (params, masters, momentum buffers, moments, codes, absmaxes, step counters, rounding keys)
  bit for bit as one plain ``op(...)`` does, and the first call changes nothing but ``sums``;
* the sums are Σv² of the values updated and Σg² of the grads as stored (LARS) or Σu² of LAMB's
  update direction, as torch sums them in float64 (within the kernels' fp32 accumulation);
* the update takes its trust ratios from the given rows: two halves of a tensor stepped with the
  sums of the whole step as the whole tensor does;
* with found_inf set neither call writes anything; a bad ``norm_sums`` is refused, naming it,
  before anything is written;
* the sums-only call launches the summing pass and the reduction only, the update with the rows
  the one call's kernels less the reduction (counted by the emulation)."""

import pytest
import torch

from fused_optim import state_formats
from fused_optim.specs import SPECS
from test_cuda import EMULATED, GPU, Backend, backend  # noqa: F401  (the backend fixture: the GPU and the emulation)

# An empty tensor, a partial block, a partial chunk and three chunks (the kernels' chunks are 65536
# elements, each summed by one block of 512 threads; sum_chunks adds a tensor's chunk partials).
SIZES = (0, 1, 257, 4097, 140000)
CHUNK, BLOCK = 65536, 512


# Scalars overriding the op's samples (specs.py), with and without the trust ratio.
VARIANTS = {
    "lars_": {"trust": {}, "no_clip": dict(trust_clip=False), "always_adapt": dict(weight_decay=0.0, always_adapt=True),
              "no_trust": dict(weight_decay=0.0)},
    "colossal_lars_": {"trust": {}, "no_trust": dict(lars=False)},
    "lamb_": {"trust": {}, "nvlamb_trust_clip": dict(weight_decay=0.0, use_nvlamb=True, trust_clip=True),
              "own_grad_norm": dict(global_grad_norm=None), "l2": dict(adam_w_mode=False),
              "no_trust": dict(weight_decay=0.0)},
    "colossal_lamb_": {"trust": {}, "no_trust": dict(adam=True)},
}
LAMB = {"lamb_", "colossal_lamb_"}
# (param dtype, masters) of the list ops; (state format, param dtype, masters, stochastic_state,
# stochastic_params) of the compact twins.
DTYPES = [(torch.float32, False), (torch.float64, False), (torch.float16, False), (torch.bfloat16, False),
          (torch.float16, True), (torch.bfloat16, True)]
COMPACT = [("bf16", torch.float32, False, False, False), ("bf16", torch.float32, False, True, False),
           ("8bit", torch.float32, False, False, False), ("8bit", torch.bfloat16, True, False, False),
           ("bf16", torch.bfloat16, False, True, True), ("8bit", torch.bfloat16, False, False, True)]


def _cases(formats):
    return [pytest.param(op, variant, *f, id=f"{op}{variant}-" + "-".join(_id(x) for x in f))
            for op in VARIANTS for variant in VARIANTS[op] for f in formats]


def _id(x) -> str:
    return str(x)[6:] if isinstance(x, torch.dtype) else str(x)


class Call:
    """One call's arguments: the list op (fmt None) or its compact twin, on fresh inputs, made on
    the CPU; :meth:`on` gives a copy that calls a backend's op on its device."""

    def __init__(self, op, variant, dtype, masters, fmt=None, sr_state=False, sr_params=False, sizes=SIZES,
                 seed=0):
        spec = SPECS[op]
        self.op, self.spec, self.fmt, self.sizes, self.backend = op, spec, fmt, sizes, None
        g = torch.Generator().manual_seed(seed)
        self.params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        self.grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        self.masters = [p.float() for p in self.params] if masters else []
        values_dtype = torch.float32 if masters else dtype
        self.state, self.absmaxes = [], []
        for st in spec.state[:-1]:  # the masters are the last list
            if st.sample == "counter":
                self.state.append([torch.tensor(3.0) for _ in sizes])
                continue
            signed = st.sample != "nonnegative"
            values = [torch.randn(n, generator=g) if signed else torch.rand(n, generator=g) ** 2 for n in sizes]
            if fmt == "8bit":
                encoded = [state_formats.encode_8bit(v, signed) for v in values]
                self.state.append([c for c, _ in encoded])
                self.absmaxes += [a for _, a in encoded]
            else:
                self.state.append([v.to(torch.bfloat16 if fmt == "bf16" else values_dtype) for v in values])
        self.keys = [torch.tensor(12345678901 + 7 * i) for i in range(len(sizes))] if sr_state or sr_params else []
        # The SGD family's first-step flags alternate: its tensors go to two launches.
        self.per_step = [[i % 2 == 0 for i in range(len(sizes))]] if spec.per_step else []
        self.kwargs = {**spec.sample_scalars, **spec.sample_extra(), **VARIANTS[op][variant]}
        self.kwargs.update(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(0.0))  # AMP
        if fmt is not None:
            self.kwargs.update(stochastic_state=sr_state, stochastic_params=sr_params)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a call may write."""
        return [*self.params, *self.masters, *(t for lst in self.state for t in lst), *self.absmaxes, *self.keys]

    def clone(self) -> "Call":
        other = object.__new__(Call)
        other.__dict__ = {k: _mapped(v, torch.Tensor.clone) for k, v in self.__dict__.items()}
        return other

    def on(self, target: Backend) -> "Call":
        """A copy on the target backend's device (the rounding keys stay int64 CPU tensors, as ever)."""
        other = self.clone()
        for name in ("params", "grads", "masters", "state", "absmaxes", "kwargs"):
            setattr(other, name, _mapped(getattr(other, name), lambda t: t.to(target.device)))
        other.backend = target
        return other

    def __call__(self, **extra) -> None:
        lists = (self.params, self.grads, *self.state, self.masters)
        if self.fmt is None:
            self.backend.op(self.op)(*lists, *self.per_step, **self.kwargs, **extra)
        else:
            self.backend.op(self.spec.compact_name)(*lists, self.absmaxes, self.keys, *self.per_step, **self.kwargs,
                                                    **extra)

    def new_sums(self, fill: float = 0.0) -> torch.Tensor:
        return torch.full((len(self.sizes), 2), fill, dtype=torch.float64, device=self.params[0].device)


def _mapped(v, f):
    """v with f applied to every tensor in it (lists and dicts copied)."""
    if isinstance(v, torch.Tensor):
        return f(v)
    if isinstance(v, list):
        return [_mapped(x, f) for x in v]
    if isinstance(v, dict):
        return {k: _mapped(x, f) for k, x in v.items()}
    return v


def _assert_bitwise(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), \
            f"{what}: tensor {k} differs"


def _phased(call: Call) -> torch.Tensor:
    """The sharded step's two calls on ``call``; the sums after the first (on the CPU)."""
    before = call.clone().tensors()
    sums = call.new_sums()
    call(norm_sums=sums, sums_only=True)
    _assert_bitwise(call.tensors(), before, "the sums-only call wrote a tensor")
    written = sums.clone()
    call(norm_sums=sums)
    assert torch.equal(sums, written), "the update wrote norm_sums"
    return written.cpu()


def _accumulation_rtol(dtype) -> float:
    """The kernels square and add in opmath (fp32 for fp32/fp16/bf16 values, fp64 for fp64) per
    thread over its ≤ CHUNK/BLOCK elements of a chunk, one rounding per fused multiply-add, then
    in a tree of log2(BLOCK) levels, then the chunks' partials in double: a recursive sum of
    nonnegative terms, off by at most (terms added in a row) unit roundoffs, relative."""
    unit = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
    return (CHUNK // BLOCK + BLOCK.bit_length()) * unit


def _lamb_direction(call: Call, dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LAMB's u per tensor in float64 from the call's inputs (csrc/shared/lamb_math.h), and a bound
    on each element's error in the kernel's opmath: each operation rounds once (unit roundoff ε),
    so m's error is a few ε of |β1·m| + β3·|ĝ| (it may cancel), v's (no cancellation) a few ε of
    v, and u's a few ε of each of its terms; 8ε per term covers the ≤ 6 roundings on each path."""
    kw = call.kwargs
    colossal = call.op == "colossal_lamb_"
    beta1, beta2, eps, wd = kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"]
    beta3 = 1.0 - beta1 if colossal or kw["grad_averaging"] else 1.0
    decoupled = colossal or kw["adam_w_mode"]
    inv_scale = 1.0 / float(kw["grad_scale"]) if "grad_scale" in kw else 1.0
    grad_mul = inv_scale
    if not colossal and kw["max_grad_norm"] > 0:
        given = kw["global_grad_norm"]
        norm = (float(given) if given is not None else
                sum(float((g.double() ** 2).sum()) for g in call.grads) ** 0.5) * inv_scale
        if norm > kw["max_grad_norm"]:
            grad_mul = inv_scale * kw["max_grad_norm"] / norm
    step = float(call.state[2][0]) + 1.0
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if colossal or kw["bias_correction"] else (1.0, 1.0)
    c1, c2 = (1.0, 1.0) if colossal else (1 / bc1, 1 / bc2 ** 0.5)
    unit = 8 * torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
    us, errors = [], []
    values = call.masters or call.params
    for p, g, m, v in zip(values, call.grads, call.state[0], call.state[1]):
        p, g, m, v = (x.double() for x in (p, g, m, v))
        gh_terms = (g * grad_mul).abs()
        gh = g * grad_mul
        if wd != 0 and not decoupled:
            gh, gh_terms = gh + wd * p, gh_terms + (wd * p).abs()
        m_new = beta1 * m + beta3 * gh
        v_new = beta2 * v + (1 - beta2) * gh * gh
        m_err = unit * ((beta1 * m).abs() + beta3 * gh_terms)
        v_err = unit * (beta2 * v + (1 - beta2) * gh_terms ** 2)
        den = v_new.sqrt() * c2 + eps
        den_err = c2 * v_err / (2 * v_new.sqrt()).clamp_min(1e-300) + unit * den
        adam = m_new * c1 / den
        u_err = c1 * m_err / den + adam.abs() * den_err / den + unit * adam.abs()
        u = adam
        if wd != 0 and decoupled:
            u = adam + wd * p
            u_err = u_err + unit * (adam.abs() + (wd * p).abs())
        us.append(u)
        errors.append(u_err)
    return us, errors


def _assert_sums_within(sums: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    bad = ~((sums - expected).abs() <= bound)
    assert not bool(bad.any()), \
        f"{what}: {sums[bad].tolist()} vs {expected[bad].tolist()} (bound {bound[bad].tolist()})"


def _phased_is_the_one_call(inputs, backend, dtype):
    """The two calls on one copy of ``inputs``, the one call on another: bit for bit the same
    tensors, and the sums' Σv² as torch sums it in float64. Returns the sums and their rtol."""
    call, one = inputs.on(backend), inputs.on(backend)
    one()
    sums = _phased(call)
    _assert_bitwise(call.tensors(), one.tensors(), "phased vs one call")
    rtol = _accumulation_rtol(dtype)
    s_p = torch.stack([(v.double() ** 2).sum() for v in (inputs.masters or inputs.params)])
    _assert_sums_within(sums[:, 0], s_p, rtol * s_p, "S_p")
    return sums, rtol


def _assert_grad_sums(sums, inputs, rtol) -> None:
    """LARS's second column: Σg² of the grads as stored (not unscaled), as torch sums it in float64."""
    s_g = torch.stack([(g.double() ** 2).sum() for g in inputs.grads])
    _assert_sums_within(sums[:, 1], s_g, rtol * s_g, "S_g")


@pytest.mark.parametrize("op,variant,dtype,masters", _cases(DTYPES))
def test_sums_only_then_update_is_the_one_call_and_sums_the_squares(backend, op, variant, dtype, masters):
    """Bit for bit the one call; Σv², and Σg² (LARS) or Σu² (LAMB), as torch sums them in float64."""
    inputs = Call(op, variant, dtype, masters)
    sums, rtol = _phased_is_the_one_call(inputs, backend, dtype)
    if op in LAMB:
        us, errors = _lamb_direction(inputs, dtype)
        s_u = torch.stack([(u ** 2).sum() for u in us])
        # |Σ ũ² - Σ u²| <= Σ (2|u| + δ)·δ over the elements, plus the accumulation's rounding.
        bound = torch.stack([((2 * u.abs() + e) * e).sum() for u, e in zip(us, errors)]) + rtol * s_u
        _assert_sums_within(sums[:, 1], s_u, bound, "S_u")
    else:
        _assert_grad_sums(sums, inputs, rtol)
    assert sums[0].tolist() == [0.0, 0.0]  # the empty tensor


@pytest.mark.parametrize("op,variant,fmt,dtype,masters,sr_state,sr_params", _cases(COMPACT))
def test_compact_twin_sums_only_then_update_is_the_one_call(backend, op, variant, fmt, dtype, masters, sr_state,
                                                           sr_params):
    """Bit for bit the one call (codes, absmaxes and rounding keys included); Σv² (and LARS's Σg²)
    as torch sums them in float64. LAMB's Σu² of the decoded moments is bound to the list op's
    through the bit-identity with the one call, whose results tests/emulation/test_compact_cuda.py
    compares with the CPU kernels'."""
    inputs = Call(op, variant, dtype, masters, fmt, sr_state, sr_params)
    sums, rtol = _phased_is_the_one_call(inputs, backend, dtype)
    if op not in LAMB:
        _assert_grad_sums(sums, inputs, rtol)


@pytest.mark.parametrize("op", list(VARIANTS))
def test_two_halves_stepped_with_the_whole_sums_step_as_the_whole_tensor(backend, op):
    """The sharded step in one process: a tensor cut into two halves (two params of one call),
    the halves' rows added (the all-reduce) and given to both halves' update, steps each half as
    the whole tensor steps in one call. fp64: the sums differ from the whole tensor's only in
    their order of addition (≤ 2·_accumulation_rtol relative), so the trust ratio r and the step
    lr·r·u by some 1e-13 of themselves."""
    inputs = Call(op, "trust", torch.float64, False, sizes=(140000,), seed=3)
    inputs.per_step = [[False]] if inputs.per_step else []
    cut = inputs.clone()
    cut.sizes = (70001, 140000 - 70001)

    def split(t):
        return [t.clone(), t.clone()] if t.dim() == 0 else [x.clone() for x in t.split(cut.sizes)]
    cut.params, cut.grads = split(inputs.params[0]), split(inputs.grads[0])
    cut.state = [split(lst[0]) for lst in inputs.state]
    cut.per_step = [[False, False]] if cut.per_step else []
    whole, halves = inputs.on(backend), cut.on(backend)
    sums = halves.new_sums()
    halves(norm_sums=sums, sums_only=True)
    halves(norm_sums=sums.sum(0, keepdim=True).repeat(2, 1))
    whole()
    assert not torch.equal(whole.params[0].cpu(), inputs.params[0]), "the step changed nothing"
    for ours, theirs in ((halves.params, whole.params), *zip(halves.state, whole.state)):
        if theirs[0].dim() == 0:  # the step counters
            assert [float(t) for t in ours] == [float(theirs[0])] * 2
        else:
            torch.testing.assert_close(torch.cat(ours), theirs[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("compact", [False, True], ids=["list", "compact"])
@pytest.mark.parametrize("op", list(VARIANTS))
def test_with_found_inf_neither_call_writes_anything(backend, op, compact):
    inputs = (Call(op, "trust", torch.bfloat16, False, "8bit", False, True) if compact
              else Call(op, "trust", torch.float32, False))
    inputs.kwargs["found_inf"] = torch.tensor(1.0)
    call = inputs.on(backend)
    before = call.clone().tensors()
    sums = call.new_sums(-1.0)
    call(norm_sums=sums, sums_only=True)
    assert bool((sums == -1.0).all()), "the sums-only call wrote norm_sums despite found_inf"
    call(norm_sums=call.new_sums(1.0))
    _assert_bitwise(call.tensors(), before, "a call with found_inf wrote a tensor")


BAD_SUMS = {
    "rows": lambda n: torch.zeros(n + 1, 2, dtype=torch.float64),
    "columns": lambda n: torch.zeros(n, 3, dtype=torch.float64),
    "flat": lambda n: torch.zeros(2 * n, dtype=torch.float64),
    "float32": lambda n: torch.zeros(n, 2, dtype=torch.float32),
    "strided": lambda n: torch.zeros(2, n, dtype=torch.float64).t(),
}


@pytest.mark.parametrize("sums_only", [True, False], ids=["sums_only", "update"])
@pytest.mark.parametrize("bad", list(BAD_SUMS))
@pytest.mark.parametrize("op", list(VARIANTS))
def test_a_bad_norm_sums_is_refused_before_anything_is_written(backend, op, bad, sums_only):
    call = Call(op, "trust", torch.float32, False).on(backend)
    before = call.clone().tensors()
    sums = BAD_SUMS[bad](len(SIZES)).to(backend.device)
    with pytest.raises(RuntimeError, match=r"norm_sums must be a contiguous float64 tensor of shape \[5, 2\]"):
        call(norm_sums=sums, sums_only=sums_only)
    assert not bool(sums.any())
    _assert_bitwise(call.tensors(), before, "a refused call wrote a tensor")


@pytest.mark.parametrize("op", list(VARIANTS))
def test_sums_only_without_norm_sums_is_refused(backend, op):
    call = Call(op, "trust", torch.float32, False).on(backend)
    before = call.clone().tensors()
    with pytest.raises(RuntimeError, match="sums_only=True needs norm_sums"):
        call(sums_only=True)
    _assert_bitwise(call.tensors(), before, "a refused call wrote a tensor")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", [pytest.param(GPU, id="gpu")], indirect=True)
def test_norm_sums_on_another_device_than_the_params_is_refused(backend):
    call = Call("lamb_", "trust", torch.float32, False).on(backend)
    with pytest.raises(RuntimeError,
                       match="norm_sums must be a contiguous float64 tensor .* on the params' device, got .* on cpu"):
        call(norm_sums=torch.zeros(len(SIZES), 2, dtype=torch.float64), sums_only=True)


@pytest.mark.parametrize("backend", [pytest.param(EMULATED, id="emulated")], indirect=True)
@pytest.mark.parametrize("op", list(VARIANTS))
def test_the_two_calls_launch_the_summing_passes_once(backend, op):
    """Counted by the emulation: the sums-only call launches the summing pass and the reduction
    into the rows (LAMB: its first pass without stores) and nothing else; the update with the rows
    launches the one call's kernels less the reduction (LARS: less its norm pass too)."""
    inputs = Call(op, "trust", torch.float32, False)
    call, one = inputs.on(backend), inputs.on(backend)
    launches = backend.op("emulated_launches")
    before = launches()
    one()
    one_call = launches() - before
    sums = call.new_sums()
    before = launches()
    call(norm_sums=sums, sums_only=True)
    sums_only = launches() - before
    before = launches()
    call(norm_sums=sums)
    update = launches() - before
    assert sums_only == 2
    assert update == one_call - (1 if op in LAMB else 2)
