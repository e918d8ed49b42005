"""Optimizer state in fewer bytes: the bf16 and blockwise 8-bit formats and stochastic rounding.

The reference definitions; the CPU kernels (``csrc/cpu/compact_state.h``) implement the same
formats (per element in ``csrc/shared/state_codes.h``, shared with the CUDA kernels) and the same
random bits, so the two agree code for code.

**bf16** (``state_dtype=torch.bfloat16``): the state tensor is bfloat16; a step decodes it to
fp32 exactly (the 16 bits are the high half of the fp32), runs the fp32 rule and rounds back,
to nearest even or stochastically.

**8-bit** (``state_dtype="8bit"``): the elements of a state tensor, flattened, are cut into blocks
of ``BLOCK`` = 256. A block stores one fp32 scale, the largest magnitude among its elements
(``absmax``; a ``<name>_absmax`` tensor of ceil(numel/256) elements beside the ``uint8`` codes),
and one byte per element: a small float of y = |x| * (top / absmax), in [0, top]. The byte has 4
exponent bits and M mantissa bits: M = 3 for a moment that may be negative (exp_avg,
momentum_buffer), whose top bit is the sign, and M = 4 for a second moment (exp_avg_sq,
max_exp_avg_sq), which spends the sign bit on precision. Exponent field f = 1..15 holds
2^(f-16)·(1 + m/2^M), the binades from 2^-15 to 1 (the largest entry ``top`` = 1 - 2^-(M+1), which
x = absmax takes); f = 0 holds m·2^-(15+M), evenly spaced down to 0 like IEEE subnormals, so small
magnitudes keep a relative precision of 2^-(M+1) over 4.5 decades below the block's absmax, where
a linear code would lose them (the "dynamic" codes of Dettmers et al., 8-bit Optimizers via
Block-wise Quantization, 2022, are also sign, exponent and linear fraction). The byte is y rounded
to the nearest entry, ties to even, computed with integer operations on y's fp32 bits (no table,
no search); a non-zero second moment never takes the byte 0 (it takes the smallest entry): Adam
divides by √v + eps, and a v rounded to zero would turn a tiny step into one of size lr·m/eps.
The value of a byte is its entry times absmax / top. Both scales are one fp32 division per block.

**fp32** (``state_dtype=torch.float32``) for fp16 / bf16 params without master weights (DeepSpeed's
CPU Adam default, bitsandbytes' 32-bit optimizers): the state tensors are float32; a step reads
them as they are, updates the param in fp32 and rounds it once. (For fp32 params it is their
plain state.)

**Stochastic rounding** of fp32 to bf16: add 16 random bits to the fp32 bits below the bf16
mantissa, then truncate. A value between two bf16 neighbours a and b = a + ulp rounds to b with
probability (x - a)/ulp, so its expectation is x (the magnitude rounds up or down; the sign is
untouched; NaN stays NaN). The bits are a hash of (key, stream, element index): ``key`` a per-param
int64 counter in the optimizer state (``state["rounding_key"]``, advanced by one per step),
``stream`` 0 for the param and 1 + k for its k-th state tensor; the index is the element's in its
whole tensor (a DTensor whose local tensor is a range of rows starts at its ``element_offset``,
:mod:`.sharding`). Results therefore do not depend on the thread count nor on how the tensor is
sharded, the reference reproduces the kernels' bits, and a resumed run continues exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256


def mantissa_bits(signed: bool) -> int:
    return 3 if signed else 4


def top(signed: bool) -> float:
    """The largest entry, 1 - 2^-(M+1) (exact in fp32)."""
    return 1.0 - 2.0 ** -(mantissa_bits(signed) + 1)


_SMALLEST_NORMAL = 0x38000000  # the fp32 bits of 2^-15


def _bits(x: Tensor) -> Tensor:
    """The fp32 bits of x as non-negative int64."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b: Tensor) -> Tensor:
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


def entries(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The 256 entries (fp32) by byte: the value of byte c before the block's scale absmax / top."""
    m_bits = mantissa_bits(signed)
    code = torch.arange(256, dtype=torch.int64, device=device)
    m = code & 0x7F if signed else code
    subnormal = m.float() * 2.0 ** -(15 + m_bits)
    normal = _from_bits((m + (111 << m_bits)) << (23 - m_bits))
    magnitude = torch.where(m < 2 ** m_bits, subnormal, normal)
    return torch.where(code >= 128, -magnitude, magnitude) if signed else magnitude


def blocks_of(numel: int) -> int:
    return -(-numel // BLOCK)


def _block_absmax(flat: Tensor) -> Tensor:
    padded = torch.zeros(blocks_of(flat.numel()) * BLOCK, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    return padded.view(-1, BLOCK).abs().amax(dim=1)


def encode_8bit(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """``(codes uint8 of x's shape, absmax fp32 [blocks])`` of the fp32 values ``x``: y = |x| ·
    (top / absmax) rounded to the nearest entry (ties to even), by the kernels' integer steps."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    absmax = _block_absmax(flat)
    inv = torch.where(absmax > 0, top(signed) / torch.where(absmax > 0, absmax, 1.0), 0.0)
    y = flat.abs() * inv.repeat_interleave(BLOCK)[:n]
    b = _bits(y)
    m_bits = mantissa_bits(signed)
    shift = 23 - m_bits
    normal = ((b + (1 << (shift - 1)) - 1 + ((b >> shift) & 1)) >> shift) - (111 << m_bits)
    # y / step < 2^M to an integer, nearest even: the fp32 addition of 2^23 rounds it
    subnormal = _bits(y * 2.0 ** (15 + m_bits) + 2.0 ** 23) - 0x4B000000
    code = torch.where(b < _SMALLEST_NORMAL, subnormal, normal).clamp(max=127 if signed else 255)
    if signed:
        code = code | torch.where(torch.signbit(flat), 128, 0)
    else:
        code = torch.where((code == 0) & (flat != 0), 1, code)
    return code.to(torch.uint8).view(x.shape), absmax


def decode_8bit(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """The fp32 values of 8-bit state (codes of any shape, one absmax per block of 256)."""
    n = codes.numel()
    scale = (absmax / top(signed)).repeat_interleave(BLOCK)[:n]
    values = entries(signed, codes.device)[codes.reshape(-1).long()] * scale
    return values.view(codes.shape)


_M32 = 0xFFFFFFFF


def hash32(x: Tensor) -> Tensor:
    """A bijective 32-bit mix of int64 tensors holding 32-bit values (the kernels' ``hash32``):
    x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16 (mod 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32  # int64 products wrap; the low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _scalar_hash(v: int) -> int:
    return int(hash32(torch.tensor([v & _M32], dtype=torch.int64))[0])


def stream_seed(key: int, stream: int) -> int:
    """The 32-bit seed of one stream of a param's step: hash(hash(key_lo ^ hash(key_hi)) ^ stream·φ)."""
    key &= (1 << 64) - 1
    mixed = _scalar_hash((key & _M32) ^ _scalar_hash(key >> 32))
    return _scalar_hash(mixed ^ ((stream * 0x9E3779B9) & _M32))


def random_bits(key: int, stream: int, numel: int, device: torch.device | str = "cpu", offset: int = 0) -> Tensor:
    """16 random bits per element (int64): hash(seed ^ low 32 bits of i ^ hash(i >> 32)) & 0xffff,
    for the elements i = offset, …, offset + numel − 1 (a shard's indices in its whole tensor)."""
    seed = stream_seed(key, stream)
    i = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    high = hash32(i >> 32)
    return hash32((i & _M32) ^ seed ^ high) & 0xFFFF


def round_bf16(x: Tensor, bits: Tensor | None = None) -> Tensor:
    """fp32 ``x`` as bfloat16: to nearest even, or with ``bits`` (16 per element) stochastically."""
    x = x.float()
    if bits is None:
        return x.to(torch.bfloat16)
    as_int = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    rounded = ((as_int + bits.view(x.shape)) >> 16) & 0xFFFF
    rounded = torch.where(torch.isnan(x), as_int >> 16 | 0x40, rounded)  # a NaN stays a (quiet) NaN
    signed16 = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded)
    return signed16.to(torch.int16).view(torch.bfloat16)


# ---- the optimizers' options and a param's state in a format ---------------------------------

OPTIONS = {"state_dtype": None, "state_rounding": "nearest", "stochastic_rounding": False}
ROUNDING_KEY = "rounding_key"


def normalized_state_dtype(value):
    """``state_dtype`` as a group holds it: None, ``"bfloat16"``, ``"8bit"`` or ``"float32"``
    (``torch.bfloat16`` and ``"bf16"``, ``torch.float32`` and ``"fp32"`` are accepted; strings keep
    state dicts loadable with ``weights_only=True``)."""
    if value is None or value in ("8bit", "bfloat16", "float32"):
        return value
    if value is torch.bfloat16 or value == "bf16":
        return "bfloat16"
    if value is torch.float32 or value == "fp32":
        return "float32"
    raise ValueError(f"Invalid state_dtype: {value!r} (use None, torch.bfloat16, '8bit' or torch.float32)")


def check_options(group: dict, owner: str, supported: bool) -> None:
    """Checks (and normalizes) a group's compact-state options; ``supported``: the optimizer's op
    has compact kernels."""
    if "state_dtype" in group:
        group["state_dtype"] = normalized_state_dtype(group["state_dtype"])
    rounding = group.get("state_rounding", "nearest")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"Invalid state_rounding: {rounding!r} (use 'nearest' or 'stochastic')")
    if rounding == "stochastic" and group.get("state_dtype") in ("8bit", "float32"):
        raise ValueError(f"Invalid state_rounding: 'stochastic' rounds bf16 state; {group['state_dtype']} state is "
                         "not rounded that way (use state_dtype=torch.bfloat16, or state_rounding='nearest')")
    used = [k for k, default in OPTIONS.items() if group.get(k, default) != default]
    if used and not supported:
        raise ValueError(f"{owner} does not support {', '.join(used)} (compact state and stochastic rounding are "
                         "implemented for the SGD family, Adam/AdamW and LAMB); leave them at their defaults")


def group_keys(state_dtype, state_rounding, stochastic_rounding) -> dict:
    """The options that differ from the defaults, as group keys (a group without them has none:
    its state dict is torch's)."""
    given = dict(state_dtype=normalized_state_dtype(state_dtype), state_rounding=state_rounding,
                 stochastic_rounding=stochastic_rounding)
    return {k: v for k, v in given.items() if v != OPTIONS[k]}


def is_compact(group: dict) -> bool:
    """Whether a group's steps go through the compact twin ops."""
    return any(group.get(k, default) != default for k, default in OPTIONS.items())


def target_dtype(group: dict, values_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a group's compact-able state tensors for values (param or master) of ``values_dtype``
    (a group's ``state_dtype`` set after construction in any spelling the keyword takes, or refused)."""
    fmt = normalized_state_dtype(group.get("state_dtype"))
    if fmt == "8bit":
        return torch.uint8
    if fmt == "bfloat16":
        return torch.bfloat16
    if fmt == "float32":
        return torch.float32
    return values_dtype


def absmax_key(key: str) -> str:
    return f"{key}_absmax"


def convert_state(state: dict, keys: list[tuple[str, bool]], dtype: torch.dtype,
                  encode=encode_8bit, decode=decode_8bit) -> None:
    """Brings the state tensors ``keys`` ((name, signed) pairs) of a param to ``dtype``: decoded
    from what they hold (values, bf16, or 8-bit with their ``<name>_absmax``) to fp32, encoded to
    ``dtype`` (bf16 to nearest even); 8-bit state gets or loses its absmax tensor. ``encode`` and
    ``decode``: the 8-bit codec (a DTensor's: :mod:`.sharded_blocks`)."""
    for key, signed in keys:
        current = state.get(key)
        if current is None or current.dtype == dtype:
            continue
        if current.dtype == torch.uint8:
            x = decode(current, state.pop(absmax_key(key)), signed)
        else:
            x = current.float()
        if dtype == torch.uint8:
            codes, absmax = encode(x, signed)
            state[key], state[absmax_key(key)] = codes.to(current.device), absmax.to(current.device)
        else:
            state[key] = x.to(dtype=dtype, device=current.device)


def initial_key(group_index: int, param_index: int) -> Tensor:
    """A param's first rounding key: its position (group, index) in the high bits, the step count
    added below (distinct for 2^32 steps of up to 2^20 params per group)."""
    return torch.tensor((group_index << 52) + (param_index << 32), dtype=torch.int64)
