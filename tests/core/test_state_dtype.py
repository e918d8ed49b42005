"""Optimizer state in fewer bytes (``state_dtype``: bf16 or blockwise 8-bit moments, rounded to
nearest or stochastically) and stochastically rounded bf16 params (``stochastic_rounding``).

The chain of truth: the formats' definitions (fused_optim/state_formats.py, checked here against
brute force and torch's own bf16 rounding) -> the compact reference (decode, the fp32 reference,
encode) -> the CPU kernels, which must reproduce the reference's codes and random bits."""

import io
import math

import pytest
import torch

import fused_optim
from fused_optim import state_formats as sf
from fused_optim.specs import SPECS
from test_ops import step_bucket_twin

SIZES = (1, 255, 256, 257, 4097, 70000)  # block edges, a SIMD tail, and a tensor split between threads


# ---- the formats -------------------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8bit_entries_are_a_small_float_of_4_exponent_bits(signed):
    """Magnitude bytes 0..2^M-1 are evenly spaced from 0 (step 2^-(15+M)), the rest the binades
    2^-15 .. 1 with 2^M entries each; the largest is top = 1 - 2^-(M+1); a signed byte's top bit
    is the sign."""
    m = sf.mantissa_bits(signed)
    e = sf.entries(signed).double()
    magnitudes = e[:128] if signed else e
    assert bool((magnitudes[1:] > magnitudes[:-1]).all()) and magnitudes[0].item() == 0.0
    assert torch.equal(magnitudes[:2 ** m], torch.arange(2 ** m).double() * 2.0 ** -(15 + m))
    for f in range(1, 16):
        binade = magnitudes[f << m:(f + 1) << m]
        assert torch.equal(binade, 2.0 ** (f - 16) * (1 + torch.arange(2 ** m).double() / 2 ** m))
    assert magnitudes.max().item() == sf.top(signed) == 1 - 2.0 ** -(m + 1)
    if signed:
        assert torch.equal(e[128:], -e[:128])


def _values(signed: bool, n: int = 5000) -> torch.Tensor:
    """Values over many decades (as second moments are), a few blocks' worth, plus exact zeros."""
    g = torch.Generator().manual_seed(1)
    magnitude = 10 ** (torch.rand(n, generator=g) * 9 - 8)
    x = magnitude * (torch.randn(n, generator=g).sign() if signed else 1.0)
    x[::97] = 0.0
    return x


def _scaled(x, absmax, signed):
    """y = |x| * (top / absmax) of each element, as the format defines it."""
    inv = torch.where(absmax > 0, sf.top(signed) / absmax, 0.0).repeat_interleave(sf.BLOCK)[:x.numel()]
    return x.abs() * inv


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8bit_encoding_takes_the_nearest_entry_ties_to_even(signed):
    """Each element's byte is that of the entry nearest to y = |x| * top / absmax (brute force over
    the entries, the even byte on a tie) with x's sign, except that a non-zero unsigned value never
    takes the byte 0; the absmax is the block's largest magnitude. Ties: a last block holding top
    (so y = |x|) and every midpoint between neighbouring entries (exact in fp32: one more bit)."""
    magnitudes = sf.entries(signed)[:128 if signed else 256]
    midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2
    x = torch.cat([_values(signed, 20 * sf.BLOCK), midpoints, torch.tensor([sf.top(signed)])])
    codes, absmax = sf.encode_8bit(x, signed)
    assert codes.dtype == torch.uint8 and absmax.numel() == math.ceil(x.numel() / sf.BLOCK)
    blocks = torch.nn.functional.pad(x, (0, absmax.numel() * sf.BLOCK - x.numel())).view(-1, sf.BLOCK)
    assert torch.equal(absmax, blocks.abs().amax(dim=1))
    distance = (_scaled(x, absmax, signed).double()[:, None] - magnitudes.double()[None, :]).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    index = torch.arange(magnitudes.numel())
    tie_to_even = nearest & ((index % 2 == 0)[None, :] | (nearest.sum(dim=1, keepdim=True) == 1))
    expected = torch.where(tie_to_even, index, 10 ** 6).min(dim=1).values
    if signed:
        expected = expected | torch.where(x < 0, 128, 0)
    else:
        expected = torch.where((expected == 0) & (x != 0), 1, expected)
    assert int((nearest.sum(dim=1) == 2).sum()) >= midpoints.numel() // 2  # the ties are exercised
    assert torch.equal(codes.long(), expected)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8bit_round_trip_error_is_at_most_half_an_entry_gap(signed):
    """decode(encode(x)) is within half an entry gap of x: relative 2^-(M+1) where y = |x| top /
    absmax >= 2^-15 (the binades), absolute 2^-(16+M) absmax / top below (evenly spaced entries),
    the smallest entry for the unsigned values lifted from 0; plus 4 fp32 roundings of |x| (the
    two block scales, y and the decoded product)."""
    m = sf.mantissa_bits(signed)
    x = _values(signed)
    codes, absmax = sf.encode_8bit(x, signed)
    y = sf.decode_8bit(codes, absmax, signed)
    scale = (absmax / sf.top(signed)).repeat_interleave(sf.BLOCK)[:x.numel()].double()
    xd = x.double()
    lifted = (codes == 1) & (xd.abs() < 2.0 ** -(16 + m) * scale) & (not signed)
    quantization = torch.maximum(2.0 ** -(m + 1) * xd.abs(), 2.0 ** -(16 + m) * scale)
    bound = torch.where(lifted, 2.0 ** -(15 + m) * scale, quantization) + 4 * 2.0 ** -24 * xd.abs()
    assert bool(((y.double() - xd).abs() <= bound).all())


def test_a_non_zero_second_moment_never_decodes_to_zero():
    """Adam divides by sqrt(v) + eps: a tiny v next to a large one in its block must not become 0."""
    x = torch.tensor([1.0, 1e-12, 3e-9, 0.0])
    codes, absmax = sf.encode_8bit(x, signed=False)
    y = sf.decode_8bit(codes, absmax, signed=False)
    assert bool((y[:3] > 0).all()) and y[3].item() == 0.0


def test_the_formats_compute_on_their_input_s_device():
    """Encoding, decoding, random bits, rounding and a state conversion create every tensor on
    the device of what they are given (on a GPU they once mixed in CPU tensors and failed). The
    ``meta`` device stands in for one here: an op mixing it with a CPU tensor raises."""
    x = torch.empty(700, device="meta")
    codes, absmax = sf.encode_8bit(x, signed=True)
    assert codes.device.type == absmax.device.type == "meta" and absmax.shape == (3,)
    assert sf.decode_8bit(codes, absmax, signed=True).device.type == "meta"
    bits = sf.random_bits(5, 1, x.numel(), x.device)
    assert bits.device.type == "meta" and sf.round_bf16(x, bits).device.type == "meta"
    state = {"exp_avg": torch.empty(700, device="meta")}
    sf.convert_state(state, [("exp_avg", True)], torch.uint8)
    assert state["exp_avg"].device.type == state["exp_avg_absmax"].device.type == "meta"
    sf.convert_state(state, [("exp_avg", True)], torch.bfloat16)
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg"].device.type == "meta"


def test_nearest_bf16_rounding_is_torch_s():
    x = torch.randn(10000) * 10 ** torch.randint(-30, 30, (10000,)).float()
    assert torch.equal(sf.round_bf16(x), x.to(torch.bfloat16))


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased_over_many_draws():
    """Each draw is one of the two bf16 neighbours of x; over N draws (N keys) the mean is x:
    a draw's error has standard deviation <= ulp/2, so the mean's is <= ulp/(2 sqrt(N)); we allow
    5 of those."""
    x = torch.tensor([1.0 + 2 ** -10, 1.0 + 3 * 2 ** -10, -3.0 - 2 ** -9, 1e-30 * (1 + 2 ** -11), 100.0 + 0.1])
    n = 4000
    draws = torch.stack([sf.round_bf16(x, sf.random_bits(key, 1, x.numel())).float() for key in range(n)])
    ulp = (torch.tensor([torch.finfo(torch.bfloat16).eps]) * 2.0 ** torch.floor(torch.log2(x.abs()))).float()
    for j in range(x.numel()):
        values = set(draws[:, j].tolist())
        assert len(values) == 2 and min(values) <= x[j].item() <= max(values)
    mean = draws.double().mean(dim=0)
    assert bool(((mean - x.double()).abs() <= 5 * ulp.double() / (2 * math.sqrt(n))).all()), (mean - x.double(), ulp)


# ---- the kernels against the reference -------------------------------------------------------

def _op_inputs(op, fmt, param_dtype, amsgrad, seed=0):
    """Params, grads and the state lists of one call of ``op`` with state in ``fmt``."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(param_dtype) for n in SIZES]
    grads = [torch.randn(n, generator=g).to(param_dtype) for n in SIZES]
    spec = SPECS[op]
    lists, absmaxes = [], []
    for k, lst in spec.compact_lists():
        if lst.when == "amsgrad" and not amsgrad:
            lists.append([])
            continue
        signed = lst.sample != "nonnegative"
        values = [(torch.randn(n, generator=g) if signed else torch.rand(n, generator=g) ** 4) for n in SIZES]
        if fmt == "8bit":
            encoded = [sf.encode_8bit(v, signed) for v in values]
            lists.append([c for c, _ in encoded])
            absmaxes += [a for _, a in encoded]
        else:
            lists.append([v.to(torch.bfloat16 if fmt == "bf16" else torch.float32) for v in values])
    keys = [torch.tensor(12345678901 + 7 * i) for i in range(len(SIZES))]
    steps = [[torch.tensor(3.0) for _ in SIZES]] if any(s.sample == "counter" for s in spec.state) else []
    return params, grads, lists, steps, absmaxes, keys


def _clone(x):
    return [_clone(y) for y in x] if isinstance(x, list) else x.clone()


# colossal_lamb_ in its one-pass variant (no trust ratio); lamb_'s samples take the trust ratio (two passes).
_SCALARS = {"colossal_lamb_": dict(adam=True)}


def _args(op, inputs, masters=()):
    """The compact twin's arguments and scalars."""
    params, grads, lists, steps, absmaxes, keys = inputs
    spec = SPECS[op]
    scalars = dict(spec.sample_scalars, **spec.sample_extra(), **_SCALARS.get(op, {}))
    if op == "adam_":
        scalars["amsgrad"] = bool(lists[-1])
    per_step = [[False] * len(params)] if spec.per_step else []
    return (params, grads, *lists, *steps, list(masters), absmaxes, keys, *per_step), scalars


def _call(op, fused, inputs, masters=(), **flags):
    spec = SPECS[op]
    args, scalars = _args(op, inputs, masters)
    if fused:
        fused_optim._build.load("cpu")
        getattr(torch.ops.fused_optim, spec.compact_name)(*args, **scalars, **flags)
    else:
        spec.run_compact_reference(*args, **scalars, **flags)


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or one code / bf16 or fp16 ulp apart (bit patterns of the same sign differing by one).
    A bf16 value may also differ by a few fp32 ulps of the tensor's largest value: where a
    moment's sum of two products cancels (LAMB's m = β1·m + β3·g), the reference rounds both
    products and the sum and the kernel's fused multiply-add once, an absolute difference of up
    to ~3·2^-24 of the products' magnitude, i.e. many bf16 ulps of the small result (even its
    sign); we allow 2^-20 of the largest value."""
    if a.dtype == torch.uint8:
        return bool(((a.int() - b.int()).abs() <= 1).all())
    if a.dtype in (torch.bfloat16, torch.float16):  # (fp16: params beside fp32 state)
        near = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs() <= 1
        cancelled = (a.float() - b.float()).abs() <= 2.0 ** -20 * b.float().abs().max()
        return bool((near | cancelled).all())
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


CASES = [  # (op, state format, param dtype, stochastic_state, stochastic_params, amsgrad)
    ("adam_", "bf16", torch.float32, False, False, False),
    ("adam_", "bf16", torch.float32, True, False, True),
    ("adam_", "8bit", torch.float32, False, False, False),
    ("adam_", "8bit", torch.float32, False, False, True),
    ("adam_", "8bit", torch.bfloat16, False, True, False),
    ("adam_", "bf16", torch.bfloat16, True, True, False),  # pure bf16: state and params rounded stochastically
    ("sgd_", "bf16", torch.float32, True, False, False),
    ("sgd_", "8bit", torch.float32, False, False, False),
    ("sgd_", "8bit", torch.bfloat16, False, True, False),
    ("lars_", "8bit", torch.float32, False, False, False),
    ("lamb_", "8bit", torch.float32, False, False, False),
    ("lamb_", "bf16", torch.float32, True, False, False),
    ("lamb_", "8bit", torch.bfloat16, False, True, False),
    ("lamb_", "bf16", torch.bfloat16, True, True, False),
    ("colossal_lamb_", "8bit", torch.float32, False, False, False),
    ("colossal_lamb_", "bf16", torch.bfloat16, True, True, False),
    ("lion_", "8bit", torch.float32, False, False, False),
    ("lion_", "bf16", torch.bfloat16, True, True, False),
    ("adagrad_", "8bit", torch.float32, False, False, False),
    ("adagrad_", "bf16", torch.float32, True, False, False),
    ("adagrad_", "8bit", torch.bfloat16, False, True, False),
    # fp32 state of 16-bit params (state_dtype=torch.float32)
    ("adam_", "fp32", torch.bfloat16, False, False, True),
    ("adam_", "fp32", torch.float16, False, False, False),
    ("adam_", "fp32", torch.bfloat16, False, True, False),
    ("sgd_", "fp32", torch.float16, False, False, False),
    ("lars_", "fp32", torch.bfloat16, False, False, False),
    ("lamb_", "fp32", torch.bfloat16, False, False, False),
    ("colossal_lamb_", "fp32", torch.float16, False, False, False),
    ("lion_", "fp32", torch.bfloat16, False, False, False),
    ("adagrad_", "fp32", torch.float16, False, False, False),
]


def _case_id(c) -> str:
    flags = [name for name, on in (("srstate", c[3]), ("srparams", c[4]), ("amsgrad", c[5])) if on]
    return "-".join([c[0] + c[1], str(c[2])[6:], *flags])


@pytest.mark.parametrize("op,fmt,param_dtype,sr_state,sr_params,amsgrad", CASES, ids=[_case_id(c) for c in CASES])
def test_the_compact_kernel_is_the_compact_reference(op, fmt, param_dtype, sr_state, sr_params, amsgrad):
    """Same codes, same absmaxes, same random bits. The kernels compute each x*y + z as one fused
    multiply-add where the reference rounds twice, so an fp32 value may differ in its last bits
    (rtol 1e-5 for fp32 params and absmaxes), and a value that falls on a rounding boundary may
    then take the neighbouring code or bf16 value: never further (_adjacent). A value that
    differs that way must be rare: at most 1% of the elements. LAMB's second pass updates the
    params from the moments as stored: an element whose stored moment took the neighbouring
    code moves by lr times that code's change of u, so its param is compared only where its
    moments agree (those elements are among the 1%)."""
    inputs = _op_inputs(op, fmt, param_dtype, amsgrad)
    ours, ref = _clone(list(inputs)), _clone(list(inputs))
    flags = dict(stochastic_state=sr_state, stochastic_params=sr_params)
    _call(op, True, ours, **flags)
    _call(op, False, ref, **flags)
    (p, _, lists, _, absmaxes, keys), (q, _, ref_lists, _, ref_absmaxes, ref_keys) = ours, ref
    if SPECS[op].settles:  # the params where every stored moment agrees
        agree = [torch.ones(n, dtype=torch.bool) for n in SIZES]
        for a_list, b_list in zip(lists, ref_lists):
            agree = [same & (a == b).reshape(-1) for same, a, b in zip(agree, a_list, b_list)]
        p, q = [a[same] for a, same in zip(p, agree)], [b[same] for b, same in zip(q, agree)]
    total = sum(SIZES)
    for a_list, b_list in [(p, q), *zip(lists, ref_lists)]:
        assert all(_adjacent(a, b) for a, b in zip(a_list, b_list))
        if a_list and a_list[0].dtype != torch.float32:
            assert sum(int((a != b).sum()) for a, b in zip(a_list, b_list)) <= total // 100
    assert all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(absmaxes, ref_absmaxes))
    advanced = sr_state or sr_params
    assert [int(k) for k in keys] == [int(k) for k in ref_keys] == [12345678901 + 7 * i + advanced for i in
                                                                   range(len(SIZES))]
    # and the step did something: the state changed
    assert any(not torch.equal(a, b) for a, b in zip(lists[0], inputs[2][0]))


@pytest.mark.parametrize("op,fmt,param_dtype,sr_state,sr_params,amsgrad", CASES, ids=[_case_id(c) for c in CASES])
def test_the_compact_bucket_twin_is_the_compact_list_op(op, fmt, param_dtype, sr_state, sr_params, amsgrad):
    """The eager fast path of compact state: the lists registered once, the grads read from the
    params' .grad. Nothing changes while a param has no grad; then one step is the list op's,
    bit for bit (codes, absmaxes, advanced keys), and every registered tensor's version is bumped."""
    spec = SPECS[op]
    inputs = _op_inputs(op, fmt, param_dtype, amsgrad)
    ref = _clone(list(inputs))
    flags = dict(stochastic_state=sr_state, stochastic_params=sr_params)
    _call(op, True, ref, **flags)
    (params, grads, *rest), scalars = _args(op, _clone(list(inputs)))
    lists, per_step = [params, *rest[:len(rest) - len(spec.per_step)]], rest[len(rest) - len(spec.per_step):]
    twin = getattr(torch.ops.fused_optim, spec.compact_name + "bucket")
    _, versions = step_bucket_twin(twin, lists, grads, per_step, {**scalars, **flags})
    (ref_args, _) = _args(op, ref)
    ref_lists = [ref_args[0], *ref_args[2:len(ref_args) - len(spec.per_step)]]
    assert all(torch.equal(a, b) for lst, ref_lst in zip(lists, ref_lists) for a, b in zip(lst, ref_lst))
    assert [t._version for lst in lists for t in lst] == [v + 1 for v in versions]


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "8bit"], ids=["bf16", "8bit"])
def test_an_eager_step_with_compact_state_calls_the_bucket_twin(state_dtype):
    """Once its lists are cached, an optimizer with compact state of one bucket passes no tensor list:
    it calls the compact twin's bucket twin (the list op's dispatch costs ~85 ns per tensor per
    list; 200 params of compact AdamW state took 4-6x the step of fp32 state through it)."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 300, 5000)]
    opt = fused_optim.AdamW(params, lr=1e-2, state_dtype=state_dtype, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step makes the state, the second caches the lists (the general path)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    called = [e.name for e in prof.events() if e.name.startswith("fused_optim::")]
    assert called.count("fused_optim::adam_compact_bucket") == 1 and "fused_optim::adam_compact_" not in called
    assert opt.implementation == "fused"


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "8bit"], ids=["bf16", "8bit"])
def test_a_replaced_compact_state_tensor_is_the_one_updated(state_dtype):
    """Compact state assigned anew (codes, or an absmax) is what the next step reads and updates,
    as in a twin optimizer whose state was never replaced: bit for bit."""
    a_params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 700)]
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    a, b = (fused_optim.AdamW(ps, lr=1e-2, state_dtype=state_dtype, fused=True) for ps in (a_params, b_params))
    for step in range(4):
        for p, q in zip(a_params, b_params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        a.step()
        b.step()
        if step == 1:
            for p in a_params:
                for key in [k for k, v in a.state[p].items() if isinstance(v, torch.Tensor) and k != "step"]:
                    a.state[p][key] = a.state[p][key].clone()
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)
        assert all(torch.equal(v, b.state[q][k]) for k, v in a.state[p].items())


# The CPU kernels encode and decode whole SIMD vectors (csrc/shared/state_codes.h's templates on the
# lanes of csrc/cpu/state_code_lanes.h) and encode each chunk's tail element by element (the same
# templates on floats): 3 full blocks and one of 45 elements cover both on AVX-512 (16 lanes) and
# AVX2 (8). The emulated CUDA functors (csrc/cuda/compact_state.cuh run on the CPU) take every
# element through the templates on floats. Ops whose rule only copies a value make the comparison
# exact: no fused multiply-add can move a value across a rounding boundary.
_EXACT_NUMEL = 3 * sf.BLOCK + 45


_KERNELS = pytest.mark.parametrize("emulated", [False, pytest.param(True, marks=pytest.mark.slow)],
                                   ids=["cpu", "emulated_cuda"])  # slow: builds the emulated library


def _kernels(emulated: bool):
    """The ops of the CPU kernels, or of the emulated CUDA functors."""
    if emulated:
        fused_optim._build.load_emulated_cuda()
        return torch.ops.fused_optim_emulated_cuda
    fused_optim._build.load("cpu")
    return torch.ops.fused_optim


def _sgd_exact(emulated, grad, buf, absmaxes, first_step, **flags):
    """One sgd_compact_ step of a zero param with lr 1, momentum 1, no dampening and no decay:
    buf <- grad (first step) or the decoded buf + grad, and the param <- -buf (both exact)."""
    param = torch.zeros(grad.numel())
    keys = [torch.tensor(987654321)]
    _kernels(emulated).sgd_compact_([param], [grad], [buf], [], absmaxes, keys, [first_step], lr=1.0,
                                    momentum=1.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                                    maximize=False, wd_after_momentum=False, **flags)
    return param


def _every_code_per_block():
    """Codes holding each of the 256 byte values in every full block (shuffled), and absmaxes (a
    block of absmax 0 decodes to zeros)."""
    g = torch.Generator().manual_seed(3)
    codes = torch.cat([torch.randperm(256, generator=g) for _ in range(4)])[:_EXACT_NUMEL].to(torch.uint8)
    return codes, torch.tensor([1.0, 3.7e-3, 0.0, 2.5])


def _adam_exact(emulated, grad, m, v, absmaxes, beta2):
    """One adam_compact_ step without bias correction or decay: v <- beta2*v + (1 - beta2)*g*g,
    exact for beta2 = 1 (the decoded v) and beta2 = 0 (g*g, one rounding)."""
    _kernels(emulated).adam_compact_([torch.zeros(grad.numel())], [grad], [m], [v], [], [torch.tensor(0.0)], [],
                                     absmaxes, [], lr=1.0, beta1=0.9, beta2=beta2, eps=1.0, weight_decay=0.0,
                                     amsgrad=False, decoupled=True, maximize=False, bias_correction=False)


@_KERNELS
def test_8bit_kernels_decode_every_byte_as_the_reference(emulated):
    """Signed (SGD's momentum buffer: the param becomes -decoded) and unsigned (Adam's second
    moment with beta2 = 1: v is the decoded value, encoded again) through the vector path and the
    tail: bit for bit the reference's values, codes and absmaxes."""
    codes, absmax = _every_code_per_block()
    buf, absmaxes = codes.clone(), [absmax.clone()]
    param = _sgd_exact(emulated, torch.zeros(_EXACT_NUMEL), buf, absmaxes, first_step=False)
    decoded = sf.decode_8bit(codes, absmax, True)
    assert torch.equal(param, -decoded)
    # the buffer is decoded + 0 (a -0 becomes +0, the byte 0 rather than 128)
    expected, expected_absmax = sf.encode_8bit(decoded + 0.0, True)
    assert torch.equal(buf, expected) and torch.equal(absmaxes[0], expected_absmax)

    m, m_absmax = sf.encode_8bit(torch.zeros(_EXACT_NUMEL), True)
    v, absmaxes = codes.clone(), [m_absmax, absmax.clone()]
    _adam_exact(emulated, torch.zeros(_EXACT_NUMEL), m, v, absmaxes, beta2=1.0)
    expected, expected_absmax = sf.encode_8bit(sf.decode_8bit(codes, absmax, False), False)
    assert torch.equal(v, expected) and torch.equal(absmaxes[1], expected_absmax)


def _around(values: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    """Each fp32 value and its neighbours up to `ulps` fp32 ulps either side."""
    bits = values.float().view(torch.int32)
    return torch.cat([(bits + k).view(torch.float32) for k in range(-ulps, ulps + 1)])


def _in_blocks(x: torch.Tensor, largest: float) -> torch.Tensor:
    """x repeated to _EXACT_NUMEL elements (so that the CPU's scalar tail, the end of the partial
    block, encodes some of its values too), each block's first element `largest`."""
    x = x.repeat(-(-_EXACT_NUMEL // x.numel()))[:_EXACT_NUMEL]
    x[::sf.BLOCK] = largest
    return x


def _midpoints(signed: bool) -> torch.Tensor:
    magnitudes = sf.entries(signed)[:128 if signed else 256]
    return (magnitudes[:-1] + magnitudes[1:]) / 2


@_KERNELS
def test_8bit_kernels_encode_every_rounding_boundary_as_the_reference(emulated):
    """Signed: SGD's first step stores the grad itself, encoded; every midpoint between
    neighbouring entries (a tie: blocks of absmax top, so y = |x|) and 2 fp32 ulps either side,
    both signs, through the vector path and the tail, take exactly the reference's codes.
    Unsigned: Adam with beta2 = 0 stores v = g*g (one rounding, as the reference's g*g), for g
    at and 1 ulp either side of the midpoints' square roots, and for a v small enough to be
    lifted to the byte 1."""
    x = _around(_midpoints(True), 2)
    x = _in_blocks(x * torch.where(torch.arange(x.numel()) % 2 == 0, 1.0, -1.0), sf.top(True))
    buf, absmaxes = torch.zeros(_EXACT_NUMEL, dtype=torch.uint8), [torch.zeros(4)]
    _sgd_exact(emulated, x, buf, absmaxes, first_step=True)
    codes, absmax = sf.encode_8bit(x, True)
    assert torch.equal(buf, codes) and torch.equal(absmaxes[0], absmax)

    g = _in_blocks(_around(_midpoints(False).double().sqrt().float(), 1), math.sqrt(sf.top(False)))
    g[-5:] = 1e-15  # v = 1e-30: far below the smallest entry
    m, v = torch.zeros(_EXACT_NUMEL, dtype=torch.uint8), torch.zeros(_EXACT_NUMEL, dtype=torch.uint8)
    absmaxes = [torch.zeros(4), torch.zeros(4)]
    _adam_exact(emulated, g, m, v, absmaxes, beta2=0.0)
    codes, absmax = sf.encode_8bit(g * g, False)
    assert torch.equal(v, codes) and torch.equal(absmaxes[1], absmax)
    assert bool((codes[-5:] == 1).all())


@_KERNELS
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_bf16_kernels_round_as_the_reference(stochastic, emulated):
    """SGD's first step stores the grad itself, rounded to bf16: values on and next to every
    rounding boundary (ties: low 16 bits 0x8000), denormals, infinities and a NaN, through the
    vector path and the tail, become exactly the reference's bf16 (with its random bits)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(_EXACT_NUMEL, generator=g) * 10.0 ** torch.randint(-40, 38, (_EXACT_NUMEL,), generator=g).float()
    bits = x.view(torch.int32)
    x[1::4] = ((bits[1::4] & ~0xFFFF) | 0x8000).view(torch.float32)  # ties
    x[2::4] = ((bits[2::4] & ~0xFFFF) | 0x7FFF).view(torch.float32)  # just below a tie
    x[3:40] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39] * 7 + [0.0, -0.0])
    buf = torch.zeros(_EXACT_NUMEL, dtype=torch.bfloat16)
    _sgd_exact(emulated, x, buf, [], first_step=True, stochastic_state=stochastic)
    expected = sf.round_bf16(x, sf.random_bits(987654321, 1, x.numel()) if stochastic else None)
    nan = x.isnan()  # to nearest, torch's conversion (the reference) and c10::BFloat16 pick different NaNs
    assert torch.equal(buf.isnan(), nan)
    assert torch.equal(buf[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("op,fmt", [("lamb_", "8bit"), ("adam_", "bf16")])
def test_the_compact_kernel_updates_master_weights_as_the_reference(op, fmt):
    """bf16 params with fp32 masters: the masters follow the reference as fp32 params do above
    (where LAMB's stored moments agree), each param is its master rounded to nearest."""
    inputs = _op_inputs(op, fmt, torch.bfloat16, amsgrad=False)
    ours, ref = _clone(list(inputs)), _clone(list(inputs))
    masters = [p.float() for p in inputs[0]]
    ours_m, ref_m = _clone(masters), _clone(masters)
    _call(op, True, ours, ours_m)
    _call(op, False, ref, ref_m)
    for a_list, b_list in zip(ours[2], ref[2]):
        assert all(_adjacent(a, b) for a, b in zip(a_list, b_list))
    agree = [torch.ones(n, dtype=torch.bool) for n in SIZES]
    if SPECS[op].settles:
        for a_list, b_list in zip(ours[2], ref[2]):
            agree = [same & (a == b).reshape(-1) for same, a, b in zip(agree, a_list, b_list)]
    assert all(_adjacent(a[same], b[same]) for a, b, same in zip(ours_m, ref_m, agree))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(ours[0], ours_m))
    assert any(not torch.equal(a, b) for a, b in zip(ours_m, masters))


def test_stochastically_rounded_params_follow_updates_smaller_than_half_an_ulp():
    """SGD on bf16 params of 1.0 with an update of a quarter ulp: rounded to nearest the params
    never move; stochastically rounded, a quarter of them move up one ulp (the mean is exact):
    with n elements the fraction's standard deviation is sqrt(0.25*0.75/n); we allow 5."""
    n = 1 << 16
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    for fused in (True, False):
        for stochastic in (False, True):
            p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
            opt = fused_optim.SGD([p], lr=1.0, stochastic_rounding=stochastic, fused=fused)
            p.grad = torch.full_like(p, -ulp / 4)
            opt.step()
            moved = (p.float() - 1.0) / ulp
            assert set(moved.unique().tolist()) <= {0.0, 1.0}
            if stochastic:
                assert abs(moved.mean().item() - 0.25) <= 5 * math.sqrt(0.25 * 0.75 / n)
            else:
                assert moved.sum().item() == 0.0


# ---- the optimizers ---------------------------------------------------------------------------

def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5)).to(dtype)


def _steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(n):
        x = torch.randn(32, 20, generator=g).to(dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("state_dtype,itemsize", [(torch.bfloat16, 2), ("8bit", 1)], ids=["bf16", "8bit"])
def test_state_takes_half_or_a_quarter_of_the_bytes(state_dtype, itemsize):
    model = _model()
    opt = fused_optim.AdamW(model.parameters(), state_dtype=state_dtype)
    _steps(model, opt, 1)
    numel = sum(p.numel() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items() if k != "step")
    blocks = sum(2 * math.ceil(p.numel() / 256) for p in model.parameters())  # one fp32 absmax per block, m and v
    assert moments == 2 * numel * itemsize + (4 * blocks if itemsize == 1 else 0)
    assert opt.implementation == "fused"


def test_groups_have_the_keys_only_when_set():
    model = _model()
    plain = fused_optim.AdamW(model.parameters())
    assert not set(sf.OPTIONS) & set(plain.param_groups[0])
    opt = fused_optim.AdamW(model.parameters(), state_dtype=torch.bfloat16, state_rounding="stochastic")
    assert opt.param_groups[0]["state_dtype"] == "bfloat16" and opt.param_groups[0]["state_rounding"] == "stochastic"
    assert "stochastic_rounding" not in opt.param_groups[0]


def test_a_group_s_own_state_dtype_is_used_in_every_spelling():
    """A param group's state_dtype (in the constructor's groups or add_param_group) is taken in
    the spellings the keyword takes: torch.bfloat16 and "bf16" make bf16 moments (they were kept
    as given, which the format lookup did not know: fp32 moments, silently), stored as the
    normalized "bfloat16" so that the state dict is the same for every spelling; a group's value
    set mid-run is taken in every spelling too, and a bad one is refused."""
    ps = [torch.nn.Parameter(torch.randn(300)) for _ in range(4)]
    groups = [{"params": ps[:1], "state_dtype": torch.bfloat16}, {"params": ps[1:2], "state_dtype": "bf16"},
              {"params": ps[2:3]}]
    opt = fused_optim.AdamW(groups, lr=1e-2, state_dtype="8bit")
    opt.add_param_group({"params": ps[3:], "state_dtype": torch.bfloat16})
    for p in ps:
        p.grad = torch.randn(300)
    opt.step()
    assert [g["state_dtype"] for g in opt.param_groups] == ["bfloat16", "bfloat16", "8bit", "bfloat16"]
    assert [opt.state[p]["exp_avg"].dtype for p in ps] == [torch.bfloat16, torch.bfloat16, torch.uint8, torch.bfloat16]
    assert opt.implementation == "fused"
    opt.param_groups[2]["state_dtype"] = torch.bfloat16  # set on a group mid-run: converted at the next step
    opt.step()
    assert opt.state[ps[2]]["exp_avg"].dtype == torch.bfloat16 and opt.implementation == "fused"
    opt.param_groups[2]["state_dtype"] = torch.float16
    with pytest.raises(ValueError, match="Invalid state_dtype"):
        opt.step()


FP32_STATE = [(fused_optim.AdamW, dict(lr=1e-2, amsgrad=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
              (fused_optim.SGD, dict(lr=0.1, momentum=0.9), ("momentum_buffer",)),
              (fused_optim.FusedLAMB, dict(lr=1e-2), ("exp_avg", "exp_avg_sq")),
              (fused_optim.Lion, dict(lr=1e-3), ("exp_avg",)),
              (fused_optim.Adagrad, dict(lr=1e-2), ("sum",))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cls,hyper,keys", FP32_STATE, ids=["adamw", "sgd", "lamb", "lion", "adagrad"])
def test_16bit_params_keep_fp32_state_with_state_dtype_float32(cls, hyper, keys, dtype):
    """DeepSpeed's CPU Adam default for 16-bit params (fp32 optimizer state, no master weights):
    the moments are float32 tensors; each step updates the param in fp32 from them and rounds it
    once. The kernels equal the reference implementation (fused=False) within what their fused
    multiply-adds change: a param 1 ulp of its dtype apart now and then (_adjacent), fp32 state to
    rtol 1e-5. Without the option the state has the params' dtype, and the runs differ."""
    runs = {}
    for label, fused, extra in (("kernels", True, dict(state_dtype=torch.float32)),
                                ("reference", False, dict(state_dtype="fp32")),
                                ("16-bit state", True, {})):
        model = _model(dtype=dtype)
        opt = cls(model.parameters(), fused=fused, **hyper, **extra)
        _steps(model, opt, 3)
        runs[label] = (list(model.parameters()), opt)
    (ps, opt), (qs, ref), (rs, plain) = runs["kernels"], runs["reference"], runs["16-bit state"]
    assert opt.implementation == "fused" and ref.implementation == "reference"
    assert opt.param_groups[0]["state_dtype"] == ref.param_groups[0]["state_dtype"] == "float32"
    for p, q in zip(ps, qs):
        assert p.dtype == dtype and _adjacent(p.detach(), q.detach())
        for key in keys:
            assert opt.state[p][key].dtype == ref.state[q][key].dtype == torch.float32, key
            assert torch.allclose(opt.state[p][key], ref.state[q][key], rtol=1e-5, atol=1e-7), key
    assert all(plain.state[r][keys[0]].dtype == dtype for r in rs)
    assert any(not torch.equal(p, r) for p, r in zip(ps, rs))


@pytest.mark.parametrize("kwargs", [
    dict(state_dtype=torch.bfloat16), dict(state_dtype="8bit"),
    dict(state_dtype=torch.bfloat16, state_rounding="stochastic"), dict(state_dtype=torch.float32),
], ids=["bf16", "8bit", "bf16-stochastic", "fp32"])
@pytest.mark.parametrize("cls,hyper", [(fused_optim.AdamW, dict(lr=1e-2, amsgrad=True)),
                                       (fused_optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
                                       (fused_optim.FusedLAMB, dict(lr=1e-2)),
                                       (fused_optim.ColossalLamb, dict(lr=1e-2, weight_decay=0.01))],
                         ids=["adamw", "sgd", "lamb", "colossal_lamb"])
def test_a_resumed_run_continues_exactly(cls, hyper, kwargs):
    """Save after 3 steps, load (weights_only) into a fresh optimizer, step 3 more: params and
    every state tensor (codes, absmaxes, rounding keys) equal those of the uninterrupted run."""
    model = _model()
    opt = cls(model.parameters(), **hyper, **kwargs)
    _steps(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _steps(model, opt, 3, seed=2)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    other = _model(seed=5)
    other.load_state_dict(saved["model"])
    resumed = cls(other.parameters(), **hyper, **kwargs)
    resumed.load_state_dict(saved["opt"])
    _steps(other, resumed, 3, seed=2)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == resumed.state[q].keys()
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], resumed.state[q][key]), key


@pytest.mark.parametrize("saved,loaded", [("8bit", torch.bfloat16), ("8bit", None), (torch.bfloat16, "8bit"),
                                          (None, "8bit"), (torch.bfloat16, None), ("8bit", torch.float32)])
@pytest.mark.parametrize("cls", [fused_optim.AdamW, fused_optim.FusedLAMB], ids=["adamw", "lamb"])
def test_state_loads_into_an_optimizer_of_another_state_dtype(cls, saved, loaded):
    """The loading optimizer's state_dtype wins: its next step converts the loaded moments
    (decode, encode to nearest), so they hold the saved values as that format represents them."""
    model = _model()
    opt = cls(model.parameters(), lr=1e-2, state_dtype=saved)
    _steps(model, opt, 2)
    other = _model()
    other.load_state_dict(model.state_dict())
    new = cls(other.parameters(), lr=1e-2, state_dtype=loaded)
    new.load_state_dict(opt.state_dict())
    assert new.param_groups[0].get("state_dtype") == sf.normalized_state_dtype(loaded)
    p, q = next(model.parameters()), next(other.parameters())
    before = {k: _decoded(opt.state[p], k) for k in ("exp_avg", "exp_avg_sq")}
    for x in other.parameters():
        x.grad = torch.zeros_like(x)
    new._plan(0, new.param_groups[0], [x.grad for x in other.parameters()])  # converts, does not step
    want = sf.target_dtype(new.param_groups[0], torch.float32)
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        assert new.state[q][key].dtype == want
        expected = before[key]
        if want == torch.uint8:
            expected = sf.decode_8bit(*sf.encode_8bit(expected, signed), signed)
        elif want == torch.bfloat16:
            expected = expected.to(torch.bfloat16).float()
        assert torch.equal(_decoded(new.state[q], key), expected)
    _steps(other, new, 1)
    assert new.implementation == "fused"


def _decoded(state, key):
    t = state[key]
    if t.dtype == torch.uint8:
        return sf.decode_8bit(t, state[sf.absmax_key(key)], key == "exp_avg")
    return t.float()


@pytest.mark.parametrize("kwargs,match", [
    (dict(state_dtype=torch.float16), "Invalid state_dtype"),
    (dict(state_dtype="4bit"), "Invalid state_dtype"),
    (dict(state_rounding="up"), "Invalid state_rounding"),
    (dict(state_dtype="8bit", state_rounding="stochastic"), "Invalid state_rounding: 'stochastic' rounds bf16"),
    (dict(state_dtype=torch.float32, state_rounding="stochastic"), "Invalid state_rounding: 'stochastic' rounds bf16"),
    (dict(stochastic_rounding="yes"), "stochastic_rounding"),
])
@pytest.mark.parametrize("cls", [fused_optim.AdamW, fused_optim.FusedLAMB, fused_optim.ColossalLamb],
                         ids=["adamw", "lamb", "colossal_lamb"])
def test_bad_options_raise_naming_the_option(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(_model().parameters(), **kwargs)


def test_optimizers_without_compact_kernels_refuse_the_options():
    opt = fused_optim.SparsifiedSGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="SparsifiedSGD does not support state_dtype"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "state_dtype": "8bit"})
    assert len(opt.param_groups) == 1


def test_float64_params_take_the_reference_or_raise_with_fused_true():
    model = _model(dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64: compact state"):
        _steps(model, fused_optim.AdamW(model.parameters(), state_dtype="8bit", fused=True), 1)
    with pytest.warns(UserWarning, match="float64: compact state"):
        opt = fused_optim.AdamW(model.parameters(), state_dtype="8bit")
        _steps(model, opt, 1)
    assert opt.implementation == "reference"


@pytest.mark.parametrize("cls", [fused_optim.AdamW, fused_optim.FusedLAMB], ids=["adamw", "lamb"])
def test_a_failed_step_leaves_params_and_compact_state_unchanged(cls):
    model = _model()
    opt = cls(model.parameters(), state_dtype=torch.bfloat16, state_rounding="stochastic")
    _steps(model, opt, 1)
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    last = list(model.parameters())[-1]
    last.grad = torch.zeros(last.shape).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p, before)
        assert all(torch.equal(v, state[id(p)][k]) for k, v in opt.state[p].items())


@pytest.mark.parametrize("name", ["sgd", "fused_sgd", "adam", "adamw", "fused_adam", "lars", "sign_sgd", "lamb",
                                  "fused_lamb", "nvlamb", "colossalai_lamb", "lion", "adagrad"])
def test_registry_entries_take_the_options(name):
    """Every registry entry of the SGD family, Adam, LAMB, Lion and Adagrad takes them as keywords
    (the adapters build optimizers through the registry: mmengine configs say state_dtype='8bit')."""
    model = _model()
    momentum = "sgd" in name or name == "lars"
    extra = dict(lr=0.1, momentum=0.9) if momentum else {}
    opt = fused_optim.create_optimizer(name, model.parameters(), state_dtype="8bit", **extra)
    _steps(model, opt, 1)
    key = {"adagrad": "sum"}.get(name, "momentum_buffer" if momentum else "exp_avg")
    assert opt.state[next(model.parameters())][key].dtype == torch.uint8
    assert opt.implementation == "fused"


def test_the_benchmark_runs_every_variant_and_reports_state_memory():
    """benchmarks.state_dtype on the 1M list, one round (speed is not asserted: measured)."""
    from benchmarks import state_dtype as bench

    result = bench.bench("1M", repeats=1, min_sample_s=0.0)
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(bench.VARIANTS) <= set(rows)
    assert rows["fp32 state"]["speedup_vs_fp32_state"] == 1.0
    assert [rows[v]["state_bytes_per_param"] for v in ("fp32 state", "bf16 state")] == [8.0, 4.0]
    assert 2.0 < rows["8-bit state"]["state_bytes_per_param"] < 2.1  # + one fp32 absmax per 256 codes, m and v
    assert "| 8-bit state |" in "\n".join(bench.markdown([result]))


@pytest.mark.parametrize("op,fmt", [("adam_", "8bit"), ("sgd_", "bf16"), ("lamb_", "8bit")])
def test_opcheck_of_the_compact_twins(op, fmt):
    """Schema (every mutated list declared mutable), fake implementation, dispatcher checks."""
    fused_optim._build.load("cpu")
    args, scalars = _args(op, _op_inputs(op, fmt, torch.float32, amsgrad=False))
    torch.library.opcheck(getattr(torch.ops.fused_optim, SPECS[op].compact_name).default, args,
                          dict(scalars, stochastic_state=fmt == "bf16"),
                          test_utils=("test_schema", "test_faketensor"))
