"""``OpSpec``: the declaration of one update op, from which its schema, the optimizers' keyword
scalars and the op tests' sample inputs are derived (the declarations are in :mod:`.specs`).

An update op takes ``(params, grads, <state lists>, <per-step lists>, *, <scalars>, <AMP args>)``
(see :mod:`._ops`). Its spec says, once:

* the state lists: the op's argument name and the torch.optim state name each element comes from
  (``momentum_buffers`` holds each param's ``state["momentum_buffer"]``), and the group option
  without which the list is passed empty (``momentum``: SGD keeps no buffer without momentum);
  every op's last state list is ``master_params`` (:data:`MASTER_PARAMS`, added here), the fp32
  master weights of fp16/bf16 params;
* the per-step lists (schema type and name): ``bool[] first_step`` is the only kind, one flag per
  param, True on its first step;
* the keyword scalars: schema type, optional schema default, and where an optimizer takes the
  value from: a group key (``"lr"``), or a function ``(optimizer, group) -> value`` for a
  computed one (Adam's ``beta1`` is ``group["betas"][0]``, LAMB's ``global_grad_norm`` the
  optimizer's norm of this step);
* the reference implementation (:mod:`._reference`);
* sample inputs for the op tests: a value per scalar, and a function making the extra keyword
  arguments a call needs (a generator, LAMB's ``global_grad_norm``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from . import state_formats

AMP_ARGS = "Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None"


@dataclass(frozen=True)
class StateList:
    """A state tensor list of an op: its argument name, and the torch.optim state key of each
    param whose tensor it holds. ``sample`` says how the op tests fill it: ``"any"`` (normal
    values), ``"nonnegative"`` (second moments), ``"counter"`` (0-dim step counters)."""

    name: str
    state_key: str
    sample: str = "any"
    when: str | None = None  # a group key: the list is passed empty when the group's value is falsy
    optional: bool = False  # passed empty, too, for params without this state or groups without `when`

    def of(self, group: dict, states: list[dict]) -> list:
        """The list an optimizer passes for the params of ``states`` in ``group``."""
        if self.when is not None and not (group.get(self.when) if self.optional else group[self.when]):
            return []
        if self.optional and not all(self.state_key in st for st in states):
            return []
        return [st[self.state_key] for st in states]


# The fp32 master weights of fp16/bf16 params in a group with ``master_weights`` (fp32 and fp64
# params have none: the list is empty for them). With masters, an op reads the params' grads,
# updates the masters and the (fp32) state, and writes each param as its master rounded to
# nearest even; without, it updates the params. The op tests fill it as "master" says (empty).
MASTER_PARAMS = StateList("master_params", "master_param", "master", when="master_weights", optional=True)


@dataclass(frozen=True)
class Scalar:
    """A keyword scalar: ``<type> <name>[=<default>]`` in the schema, whose value an optimizer
    takes from ``source``: a group key (the value as it is), ``(group key, i)`` (item ``i`` of the
    value, as a float: ``("betas", 0)``), a function ``(optimizer, group) -> value``, or None (the
    schema's default, unless a class passes the scalar itself: CPUAdam's ``div_scale``)."""

    name: str
    type: str
    source: str | tuple[str, int] | Callable[[Any, dict], Any] | None
    default: str | None = None

    def schema(self) -> str:
        return f"{self.type} {self.name}" + ("" if self.default is None else f"={self.default}")


def _store_8bit(codes: Tensor, absmax: Tensor, signed: bool, x: Tensor) -> Tensor:
    """Encodes x into (codes, absmax); returns the values they now hold."""
    new_codes, new_absmax = state_formats.encode_8bit(x, signed)
    codes.copy_(new_codes)
    absmax.copy_(new_absmax)
    return state_formats.decode_8bit(codes, absmax, signed)


def _store_bf16(t: Tensor, bits: Tensor | None, x: Tensor) -> Tensor:
    """Rounds x into the bf16 tensor t; returns the values it now holds."""
    t.copy_(state_formats.round_bf16(x, bits))
    return t.float()


def _store_cast(t: Tensor, x: Tensor) -> Tensor:
    """Stores x into t, rounded to t's dtype; returns the values t now holds."""
    t.copy_(x)
    return t.to(x.dtype)


def _decoded_8bit(codes: list[Tensor], absmaxes: list[Tensor], signed: bool) -> tuple[list, list]:
    """The fp32 values of a list of 8-bit state tensors, and for each the function storing new
    values back (:func:`_store_8bit`)."""
    decoded = [state_formats.decode_8bit(t, absmax, signed) for t, absmax in zip(codes, absmaxes)]
    return decoded, [functools.partial(_store_8bit, t, absmax, signed) for t, absmax in zip(codes, absmaxes)]


def _decoded_bf16(tensors: list[Tensor], keys: list[Tensor] | None, stream: int,
                  offsets: list[int]) -> tuple[list, list]:
    """A list of bf16 state tensors as they are, and for each the function storing new values
    back (:func:`_store_bf16`): rounded to nearest even, or with ``keys`` stochastically, with
    the random bits of the kernels' ``stream`` for this list (tensor t's elements from index
    ``offsets[t]`` of its whole tensor)."""
    if keys is None:
        bits = [None] * len(tensors)
    else:
        bits = [state_formats.random_bits(int(key), stream, t.numel(), t.device, offset)
                for key, t, offset in zip(keys, tensors, offsets)]
    return list(tensors), [functools.partial(_store_bf16, t, b) for t, b in zip(tensors, bits)]


@dataclass(frozen=True)
class OpSpec:
    """One update op (``name`` ends in ``_``): everything about it that Python code needs."""

    name: str
    state: tuple[StateList, ...]
    per_step: tuple[tuple[str, str], ...]  # (schema type, name), e.g. ("bool[]", "first_step")
    scalars: tuple[Scalar, ...]
    reference: Callable[..., None]
    # a value for each scalar without a default, and maybe for plain ones with a default (op tests)
    sample_scalars: dict = field(default_factory=dict)
    sample_extra: Callable[[], dict] = dict  # values of optional scalars a test call needs (made anew)
    compact: bool = False  # has a compact twin ``<name>compact_``: bf16 / 8-bit state, stochastic rounding
    # The reference reads its new state back after storing it (LAMB's second pass updates the param
    # from the moments as stored) and takes ``settle`` (see run_compact_reference).
    settles: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", (*self.state, MASTER_PARAMS))
        required = {s.name for s in self.scalars if s.default is None}
        plain = {s.name for s in self.scalars if not s.type.endswith("?")}
        if not required <= set(self.sample_scalars) <= plain:
            raise ValueError(f"OpSpec {self.name}: sample_scalars must give a value for each scalar without a "
                             f"default: {sorted(required)}, and may for those of {sorted(plain - required)} "
                             f"(got {sorted(self.sample_scalars)})")

    def schemas(self) -> dict[str, str]:
        """The list op's schema (key ``""``) and its bucket twin's (key ``"bucket"``). State lists
        are mutable aliases ``Tensor(c!)[]``, ``Tensor(d!)[]``, … after the params' ``a`` and the
        grads' ``b`` (a step with a ``grad_scale`` other than 1 writes the grads back unscaled, as
        torch's ``_fused_adam_`` does)."""
        state = ", ".join(f"Tensor({chr(ord('c') + i)}!)[] {s.name}" for i, s in enumerate(self.state))
        per_step = "".join(f", {kind} {name}" for kind, name in self.per_step)
        scalars = ", ".join(s.schema() for s in self.scalars)
        return {
            "": f"(Tensor(a!)[] params, Tensor(b!)[] grads, {state}{per_step}, *, {scalars}, {AMP_ARGS}) -> ()",
            "bucket": f"(int bucket{per_step}, *, {scalars}, {AMP_ARGS}) -> int",
        }

    @property
    def compact_name(self) -> str:
        """The compact twin's name: ``adam_`` -> ``adam_compact_``."""
        return f"{self.name}compact_"

    def compact_schemas(self) -> dict[str, str]:
        """The compact twin's schema (key ``""``): the list op's, plus after the state lists
        ``absmaxes`` (the fp32 scales of the 8-bit state lists, list-major: one per param for each
        8-bit list) and ``rounding_keys`` (one int64 counter per param, advanced by one per step;
        empty without stochastic rounding), the flags ``stochastic_state`` / ``stochastic_params``
        and ``element_offsets`` (empty, or one per param: the index in its whole tensor of the
        first element of a param that is a contiguous part of one, a shard: stochastic rounding
        draws each element's bits by its index in the whole tensor, fused_optim/sharding.py); and
        its bucket twin's (key ``"bucket"``), as :meth:`schemas`.
        See fused_optim/state_formats.py, csrc/cpu/compact_state.h and csrc/cuda/compact_state.cuh."""
        head, _, tail = self.schemas()[""].partition(", *, ")
        letter = chr(ord("c") + len(self.state))
        extra = f", Tensor({letter}!)[] absmaxes, Tensor({chr(ord(letter) + 1)}!)[] rounding_keys"
        state, per_step = (head.split(", bool[]", 1) + [""])[:2]
        per_step = f", bool[]{per_step}" if per_step else ""
        flags = "bool stochastic_state=False, bool stochastic_params=False, int[] element_offsets=[], "
        keywords = tail.replace("Tensor? lr_tensor", flags + "Tensor? lr_tensor", 1).removesuffix(") -> ()")
        return {"": f"{state}{extra}{per_step}, *, {keywords}) -> ()",
                "bucket": f"(int bucket{per_step}, *, {keywords}) -> int"}

    def compact_lists(self) -> tuple[tuple[int, StateList], ...]:
        """(position, list) of the state lists a compact format may hold: the moments, not the
        step counters nor the masters. A list of non-negative values uses the unsigned 8-bit code."""
        return tuple((k, s) for k, s in enumerate(self.state[:-1]) if s.sample != "counter")

    def run_compact_reference(self, params: list, grads: list, *lists, stochastic_state: bool = False,
                              stochastic_params: bool = False, element_offsets=(), **kwargs) -> None:
        """The compact twin's reference: decode the compact state (and stochastically rounded
        bf16 params) to fp32, run :meth:`run_reference` on it, encode back with the same code
        books and random bits as the kernels (fused_optim/state_formats.py), advance the keys.
        A reference that ``settles`` gets ``settle(t)``: it encodes the fp32 state tensor t now
        and makes t the values stored (decoded), which the reference then reads back. A layer-wise
        op's ``sums_only`` call stores nothing back (it writes only its ``norm_sums``)."""
        count = len(self.state)
        state = [list(x) for x in lists[:count]]
        absmaxes, keys, per_step = lists[count], lists[count + 1], lists[count + 2:]
        found_inf = kwargs.get("found_inf")
        if found_inf is not None and bool(found_inf.item()):
            return
        offsets = self._offsets(element_offsets, len(params))
        pending = self._decode_compact(state, params, absmaxes, keys, stochastic_state, offsets)
        run_params = [p.float() for p in params] if stochastic_params else params

        def settle(t: Tensor) -> None:
            if id(t) in pending:
                x, store = pending.pop(id(t))
                x.copy_(store(x))

        extra = dict(settle=settle) if self.settles else {}
        self.run_reference(run_params, grads, *state, *per_step, **kwargs, **extra)
        if kwargs.get("sums_only"):  # the layer-wise ops' first call: nothing stored, no key advanced
            return
        for x, store in pending.values():
            store(x)
        if stochastic_params:
            for i, (p, x) in enumerate(zip(params, run_params)):
                bits = state_formats.random_bits(int(keys[i]), 0, p.numel(), p.device, offsets[i])
                p.copy_(state_formats.round_bf16(x, bits))
        if stochastic_state or stochastic_params:
            for key in keys:
                key.add_(1)

    def _offsets(self, element_offsets, n: int) -> list[int]:
        """Each param's element offset (none given: 0), checked as the kernels check them."""
        offsets = list(element_offsets) or [0] * n
        if len(offsets) != n or any(o < 0 for o in offsets):
            raise ValueError(f"{self.compact_name}: element_offsets has {len(offsets)} entries for {n} params, "
                             f"{sum(o < 0 for o in offsets)} negative; give one index >= 0 per param (or none)")
        return offsets

    def _decode_compact(self, state: list[list], params: list, absmaxes: list, keys: list,
                        stochastic_state: bool, offsets: list[int]) -> dict:
        """Replaces, in ``state``, each compact state tensor by its values in the kernels' math
        type (fp32; fp64 for fp64 values), and returns, by id of those values, ``(values, store)``:
        ``store(x)`` writes x back into the compact tensor (with the kernels' random bits when
        bf16 state rounds stochastically) and returns the values it now holds."""
        values = state[-1] or params
        math_dtype = torch.float64 if values[0].dtype == torch.float64 else torch.float32  # the kernels' opmath
        n = len(params)
        pending = {}  # id of fp32 values -> (the values, how to store them back), until stored
        slot = 0  # the 8-bit lists' absmax slot
        for k, spec in self.compact_lists():
            tensors = state[k]
            stochastic_bf16 = stochastic_state and bool(tensors) and tensors[0].dtype == torch.bfloat16
            if not tensors or (tensors[0].dtype in (values[0].dtype, math_dtype) and not stochastic_bf16):
                continue  # plain state, or fp32 state of fp16 / bf16 values: updated as it is
            if tensors[0].dtype == torch.uint8:
                decoded, stores = _decoded_8bit(tensors, absmaxes[slot * n:(slot + 1) * n], spec.sample != "nonnegative")
                slot += 1
            elif tensors[0].dtype == torch.bfloat16:
                decoded, stores = _decoded_bf16(tensors, keys if stochastic_state else None, 1 + k, offsets)
            else:  # fp32 state of fp64 values (their reference only: no kernel takes it)
                decoded, stores = list(tensors), [functools.partial(_store_cast, t) for t in tensors]
            for i, (x, store) in enumerate(zip(decoded, stores)):
                tensors[i] = x.to(math_dtype)
                pending[id(tensors[i])] = tensors[i], store
        return pending

    def run_reference(self, params: list, grads: list, *lists, **kwargs) -> None:
        """The reference implementation, called as the op is: with master weights (the last state
        list non-empty) it updates the masters from the grads in fp32, then writes each param as
        its master rounded; then, given a ``grad_scale`` other than 1, it writes the grads back
        unscaled (``g * (1/grad_scale)``, what ``GradScaler.unscale_`` makes of them). Both are
        skipped with the step when ``found_inf`` is set, and by a layer-wise op's ``sums_only``
        call, which writes nothing but its ``norm_sums``."""
        count = len(self.state)
        masters = lists[count - 1]
        if not masters:
            self.reference(params, grads, *lists[:count - 1], *lists[count:], **kwargs)
        else:
            self.reference(masters, [g.float() for g in grads], *lists[:count - 1], *lists[count:], **kwargs)
        found_inf, grad_scale = kwargs.get("found_inf"), kwargs.get("grad_scale")
        if kwargs.get("sums_only") or (found_inf is not None and bool(found_inf.item())):
            return
        if masters:
            torch._foreach_copy_(params, masters)
        if grad_scale is not None and float(grad_scale.item()) != 1.0:
            inv = 1.0 / float(grad_scale.item())
            for g in grads:  # in the kernels' math type (a scalar times a 16-bit tensor is rounded to it first)
                g.copy_(g.to(torch.float64 if g.dtype == torch.float64 else torch.float32) * inv)

    def lists(self, group: dict, states: list[dict], fresh: list[bool]) -> tuple[tuple, tuple]:
        """``(state lists, per-step lists)``: the op's arguments after params and grads for the
        params of ``states`` in ``group`` (``fresh[i]``: param i is on its first step). A
        ``first_step`` list is empty when no param is on its first step (one list less to pass),
        or when the op's first state list (the buffers it would set) is not passed."""
        state = tuple(s.of(group, states) for s in self.state)
        per_step = []
        for kind, name in self.per_step:
            if (kind, name) != ("bool[]", "first_step"):
                raise ValueError(f"OpSpec {self.name}: unknown per-step list {kind} {name}")
            per_step.append(list(fresh) if any(fresh) and state[0] else [])
        return state, tuple(per_step)

    def group_scalars(self) -> tuple[tuple[str, str], ...]:
        """``(scalar name, group key)`` of the scalars read from the group as they are."""
        return tuple((s.name, s.source) for s in self.scalars if isinstance(s.source, str))

    def group_flags(self) -> tuple[str, ...]:
        """The group keys of the boolean scalars read from the group as they are."""
        return tuple(s.source for s in self.scalars if s.type == "bool" and isinstance(s.source, str))

    def item_scalars(self) -> tuple[tuple[str, str, int], ...]:
        """``(scalar name, group key, i)`` of the scalars read as item ``i`` of a group value."""
        return tuple((s.name, *s.source) for s in self.scalars if isinstance(s.source, tuple))

    def computed_scalars(self) -> tuple[tuple[str, Callable[[Any, dict], Any]], ...]:
        """``(scalar name, function (optimizer, group) -> value)`` of the computed scalars."""
        return tuple((s.name, s.source) for s in self.scalars if callable(s.source))

