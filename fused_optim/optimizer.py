"""``FusedOptimizer``: everything an optimizer needs except its update rule.

An algorithm subclass declares data and small hooks:

* ``op_name``: the op it calls, declared in :mod:`.specs` (schema, keyword scalars, reference);
* ``_validate(group)``: torch-style ``ValueError`` for bad hyperparameters (defaults and every group);
* ``_init_state(p, state, group)``: adds the state tensors a param still lacks (torch.optim names),
  made like ``state_like(p, state)`` (the param, or its fp32 master under master weights);
* ``_check_state(state)``: raises for a loaded param state it cannot continue from;
* ``_state_lists(group, params, states, fresh)``: the op's arguments after params and grads, as
  ``(state tensor lists, per-step lists)`` (``fresh[i]``: param i got new state for this step,
  i.e. this is its first step); its op's spec makes them (an algorithm need not write it);
* ``_scalars(group)``: the op's keyword scalars, built from the group as the op's declaration in
  :mod:`.specs` maps them (an algorithm need not write it);
* ``_layout(group)``: what in a group changes those lists (e.g. momentum on/off);
* ``_prepare_step()``: work across all groups after the closure ran (LAMB's global grad norm).

The base class validates, initializes state lazily, buckets each group's params by (device,
dtype, kernel eligibility), caches the tensor lists (rebuilt only when the group's params, the set
of params with grads, the layout, or a param's state dict (assigned anew, or loaded) changes),
keeps them registered on the C++ side (the kernel reads the grads from the params), and calls one
op per bucket. It implements the AMP contract of ``torch.amp.GradScaler`` (``grad_scale`` /
``found_inf`` are handed to the op, which unscales inside and skips everything on overflow) and
the three-valued ``fused`` flag:

* ``fused=None`` (default): the kernels where they build and the tensors are supported, else the
  reference implementation with one warning saying why;
* ``fused=True``: the kernels or an error that says what failed and how to fix it;
* ``fused=False``: always the reference implementation.

``master_weights=True`` (every optimizer's keyword; a group key when set) gives each fp16/bf16
param an fp32 master, ``state["master_param"]``, made from the param on its first step; the
param's other state is fp32 too. A step updates the masters from the half grads (unscaled inside,
as above) in fp32 and writes each param as its master rounded to nearest even: on the CPU one
kernel pass reads the grad, updates master and state and writes the param. fp32/fp64 params of
such a group step as usual. State dicts carry the masters, loaded back in fp32 (torch would cast
them to the param's dtype).

``state_dtype`` (``torch.bfloat16`` or ``"8bit"``), ``state_rounding`` (``"nearest"`` or
``"stochastic"``) and ``stochastic_rounding`` (keywords of the optimizers whose op has compact
kernels, ``OpSpec.compact``; group keys when set) keep the moments in fewer bytes and round bf16
state / params stochastically (formats: :mod:`.state_formats`). A group with any of them steps
through its op's compact twin (CPU kernels and CUDA functors; float64 params take the reference); a
param's moments are made in, or converted to, the group's format, and state dicts keep the codes,
absmaxes and rounding keys as saved.

``opt.implementation`` records what the last step used: ``"fused"``, ``"reference"`` or
``"mixed"`` (``None`` before the first step of an optimizer that may fuse).
"""

from __future__ import annotations

import bisect
import numbers
import re
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from . import _build, _ops, state_formats
from .spec import OpSpec
from .specs import SPECS

FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FUSED_DEVICE_TYPES = ("cpu", "cuda")

# torch.optim's words when ``fused=True`` meets a param its fused kernels do not take (a
# non-floating param, or one on a device without kernels): ours say them too, so that code
# matching torch's message matches ours.
TORCH_FUSED_REFUSAL = "`fused=True` requires all the params to be floating point Tensors of supported devices"

_build_warnings_shown: set[str] = set()  # device types whose failed build was reported
# Added to ``defaults`` by torch's ``Optimizer.__setstate__`` (so by every load_state_dict); a
# group must not gain it, or a state dict changes across save/load.
_TORCH_ONLY_DEFAULTS = frozenset({"differentiable"})


def check_range(label: str, value: Any, ok: bool, need: str) -> None:
    """Raise torch-style ``ValueError("Invalid <label>: <value>")`` plus what is needed."""
    if not ok:
        raise ValueError(f"Invalid {label}: {value} ({need})")


def check_lr(lr: Any) -> None:
    """A float >= 0, or (torch.optim's Tensor lr) a one-element floating tensor >= 0: the kernels
    read it when they run, so a scheduler may change it in place and a CUDA graph replays it."""
    if isinstance(lr, Tensor):
        check_range("learning rate", lr, lr.numel() == 1 and lr.is_floating_point(),
                    "Tensor lr must be 1-element and floating point")
        check_range("learning rate", lr, float(lr) >= 0.0, "lr must be >= 0")
        return
    check_range("learning rate", lr, is_real(lr) and lr >= 0.0, "lr must be a float >= 0")


def _lr_missing(group: dict) -> bool:
    """Whether the group has no lr (None: the constructor's lr left to the param groups)."""
    return group.get("lr") is None


def is_real(value: Any) -> bool:
    """A real number as torch.optim takes one: int, float, or a numpy scalar such as numpy.float32."""
    return isinstance(value, numbers.Real)


def check_nonnegative(name: str, value: Any) -> None:
    check_range(f"{name} value", value, is_real(value) and value >= 0.0, f"{name} must be >= 0")


def check_flag(name: str, value: Any) -> None:
    """A boolean option: a bool (or numpy bool, or the int 0 / 1); a string such as "False" is
    truthy in Python, so it is refused rather than silently read as True."""
    ok = (isinstance(value, numbers.Integral) and value in (0, 1)) or type(value).__name__ == "bool_"
    check_range(f"{name} value", repr(value), ok, f"{name} must be True or False")


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """torch.optim's closure contract: ``closure`` (if any) runs with grad enabled (a step runs
    under no_grad) and its loss is returned (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def state_like(p: Tensor, state: dict) -> Tensor:
    """What a param's state tensors are made like (shape, dtype, device): its fp32 master under
    master weights (``state["master_param"]``, made before ``_init_state`` runs), else the param."""
    return state.get("master_param", p)


def scalar_dtype() -> torch.dtype:
    """dtype of a step counter (torch.optim's ``_get_scalar_dtype``): float64 under a float64
    default dtype, else float32."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def as_betas(betas: Any) -> Any:
    """A constructor's ``betas`` as the tuple the group keeps; anything but a pair is left as it is,
    for :func:`check_betas` to refuse by name."""
    return tuple(betas) if isinstance(betas, (tuple, list)) else betas


def check_betas(betas: Any) -> None:
    check_range("betas", betas, isinstance(betas, (tuple, list)) and len(betas) == 2, "need (beta1, beta2)")
    for i, beta in enumerate(betas):
        number = is_real(beta) or (isinstance(beta, Tensor) and beta.numel() == 1)  # (torch takes Tensor betas)
        check_range(f"beta parameter at index {i}", beta, number and 0.0 <= float(beta) < 1.0,
                    "betas must be in [0, 1)")


def _step_as_tensor(state: dict) -> None:
    """A plain-number ``step`` (state dicts of torch < 1.12) becomes the 0-dim counter torch.optim
    makes of it when it loads one (``Adam.__setstate__``): the kernels count in a tensor."""
    step = state.get("step")
    if step is not None and not isinstance(step, Tensor):
        state["step"] = torch.tensor(float(step), dtype=scalar_dtype())


def _param_states(state: dict):
    """The params' state dicts among an ``optimizer.state``'s values (keyed by a tensor, as torch
    keys them; other keys hold whatever hooks stored there)."""
    return (value for key, value in state.items() if isinstance(key, Tensor) and isinstance(value, dict))


def torch_fused_refusal(p: Tensor) -> str | None:
    """torch.optim's refusal of ``p`` under ``fused=True`` (with its devices and the param's dtype
    and device), or None when torch's check takes it."""
    if p.is_floating_point() and p.device.type in FUSED_DEVICE_TYPES:
        return None
    return f"{TORCH_FUSED_REFUSAL}: {list(FUSED_DEVICE_TYPES)} but {p.dtype} and {p.device.type}"


def _place_step(p: Tensor, state: dict) -> None:
    """Keeps a step counter on its param's device, as torch's fused optimizers do: float32 on a
    GPU, where the kernels read and increment it without a host sync; on the CPU otherwise. (A
    state dict saved on one device and loaded for params on another moves its counters here.)
    A param on a device without kernels (``meta``: shape tracing) keeps its counter on the CPU,
    as torch's for-loop optimizers do: the reference implementation reads it as a number."""
    step = state.get("step")
    device = p.device if p.device.type in FUSED_DEVICE_TYPES else torch.device("cpu")
    if isinstance(step, Tensor) and step.device != device:
        state["step"] = step.to(device, torch.float32 if device.type == "cuda" else step.dtype)


@dataclass
class _Bucket:
    """Params of one group sharing (device, dtype, kernel eligibility), with cached op lists."""

    index: list[int]  # positions in the group's params
    whole: bool  # all of the group's params, in order: the group's grads list is the bucket's
    params: list[Tensor]
    state: tuple  # the op's state tensor lists
    per_step: tuple  # the op's other list arguments (e.g. first-step flags)
    fused: bool
    compact: dict | None = None  # the compact twin's flags (its lists end ``state``), or None: the plain op
    _id: int | None = None

    def bucket_id(self) -> int:
        """The params and state lists registered with the kernels (once; freed with the bucket)."""
        if self._id is None:
            lists = [self.params, *self.state]
            self._id = _ops.op("bucket_new")([t for lst in lists for t in lst], [len(lst) for lst in lists])
            weakref.finalize(self, _ops.op("bucket_free"), self._id).atexit = False
        return self._id


_INDEXED = re.compile(r"([A-Za-z_]+)\[(\d+)\]")  # a tensor list element in a kernel's message: grads[2]


def in_group_terms(message: str, where: list[tuple[int, int]]) -> str:
    """A kernel's error about the tensor lists it was given (``grads[2]``: the third) in the
    user's terms: each ``name[k]`` gains ``(param i of group g)``, with ``(g, i) = where[k]``."""
    def named(m: re.Match) -> str:
        k = int(m.group(2))
        return f"{m.group(0)} (param {where[k][1]} of group {where[k][0]})" if k < len(where) else m.group(0)

    return _INDEXED.sub(named, message)


def _extent(p: Tensor) -> tuple[int, int] | None:
    """The byte range [start, end) spanned by ``p``'s elements; None when it has none, or when
    there is no address to read (a tensor subclass, or a fake tensor under torch.compile)."""
    if p.numel() == 0 or type(p) not in (Tensor, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None
    last = sum((size - 1) * stride for size, stride in zip(p.shape, p.stride()))
    return p.data_ptr(), p.data_ptr() + (last + 1) * p.element_size()


class _Layers:
    """Numbers a group's params, in order, so that no two params of one layer share memory: a
    param that overlaps one of the current layer opens the next. Running the layers one after the
    other updates overlapping params (the same param twice, overlapping views of one storage) in
    their order in the group, as torch.optim's per-param loop does, while the params of one layer
    may be updated concurrently. Views that interleave without sharing an element count as
    overlapping (their byte ranges do): slower, same result."""

    def __init__(self) -> None:
        self.layer = 0
        self._spans: dict[torch.device, tuple[list[int], list[int]]] = {}  # sorted disjoint [start, end)

    def of(self, p: Tensor) -> int:
        """The layer of the next param ``p``."""
        span = _extent(p)
        if span is None:
            return self.layer
        start, end = span
        starts, ends = self._spans.setdefault(p.device, ([], []))
        k = bisect.bisect_right(starts, start)
        if (k > 0 and ends[k - 1] > start) or (k < len(starts) and starts[k] < end):
            self.layer += 1
            self._spans = {p.device: ([start], [end])}
        else:
            starts.insert(k, start)
            ends.insert(k, end)
        return self.layer


@dataclass
class _Created:
    """State a plan made for a param's first step: the param's state dict, what it held before
    (None: the dict itself is new), so a step that fails or is skipped can put it back."""

    param: Tensor
    state: dict
    before: dict | None


@dataclass
class _Plan:
    key: tuple  # what the lists are built for (FusedOptimizer._plan_key)
    params: list  # the group's params list, held: its id in the key cannot be reused
    has_grad: list[bool]  # which params had a grad when the plan was built
    buckets: list[_Bucket]
    created: list[_Created] = field(default_factory=list)  # state made for this step (undone if it fails)
    state_version: int = -1
    direct: bool = False  # one fused bucket holding every param of the group (see _step_direct)


# _ParamList and _ParamState spell out each mutator with super(): dynamo traces those calls (a
# compiled step makes state), not the builtin's methods taken from the class by a decorator.
class _ParamList(list):
    """A param group's ``params``: a list that counts its changes (``changes``), so that cached
    lists notice a param added, removed or replaced in place (torch.optim reads the list every
    step). Copied and pickled as a plain list."""

    __slots__ = ("changes",)

    def __init__(self, items=()):
        super().__init__(items)
        self.changes = 0

    def __setitem__(self, index, value) -> None:
        self.changes += 1
        super().__setitem__(index, value)

    def __delitem__(self, index) -> None:
        self.changes += 1
        super().__delitem__(index)

    def __iadd__(self, other):
        self.changes += 1
        return super().__iadd__(other)

    def __imul__(self, n):
        self.changes += 1
        return super().__imul__(n)

    def append(self, value) -> None:
        self.changes += 1
        super().append(value)

    def extend(self, values) -> None:
        self.changes += 1
        super().extend(values)

    def insert(self, index, value) -> None:
        self.changes += 1
        super().insert(index, value)

    def pop(self, *args):
        self.changes += 1
        return super().pop(*args)

    def remove(self, value) -> None:
        self.changes += 1
        super().remove(value)

    def clear(self) -> None:
        self.changes += 1
        super().clear()

    def sort(self, *args, **kwargs) -> None:
        self.changes += 1
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self.changes += 1
        super().reverse()

    def __reduce__(self):
        return list, (list(self),)


class _Changes:
    """How many times an optimizer's state dicts changed (see _StateDict)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class _ParamState(dict):
    """One param's state in ``optimizer.state``: a dict that counts every change of its entries
    (a state tensor assigned, replaced or removed) in its optimizer's ``_Changes``. Copied and
    pickled as a plain dict."""

    __slots__ = ("_changes",)

    def __init__(self, items=(), changes: _Changes | None = None):
        super().__init__(items)
        self._changes = _Changes() if changes is None else changes

    def __setitem__(self, key, value) -> None:
        self._changes.count += 1
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._changes.count += 1
        super().__delitem__(key)

    def __ior__(self, other):
        self._changes.count += 1
        return super().__ior__(other)

    def clear(self) -> None:
        self._changes.count += 1
        super().clear()

    def pop(self, *args):
        self._changes.count += 1
        return super().pop(*args)

    def popitem(self):
        self._changes.count += 1
        return super().popitem()

    def setdefault(self, key, default=None):
        self._changes.count += 1
        return super().setdefault(key, default)

    def update(self, *args, **kwargs) -> None:
        self._changes.count += 1
        super().update(*args, **kwargs)

    def __reduce__(self):
        return dict, (dict(self),)


class _StateDict(defaultdict):
    """``optimizer.state`` that counts the changes of its state dicts (``version``): a param's
    state dict assigned or removed (Lightning's optimizer_to_device replaces them when it moves
    state), or an entry of one (``_ParamState``: every dict stored in it becomes one), so that
    cached lists notice when a state tensor is replaced. Like torch's ``defaultdict(dict)`` it
    takes any key and value: a value that is not a dict (``state["ran_hook"] = True``, as
    torch's state-dict hooks store) is kept as it is."""

    def __init__(self, items=()):
        self._changes = _Changes()
        super().__init__(self.new_param_state)
        for key, value in dict(items).items():
            self[key] = value

    @property
    def version(self) -> int:
        return self._changes.count

    def new_param_state(self) -> _ParamState:
        """An empty state dict whose changes this one counts."""
        return _ParamState(changes=self._changes)

    def __setitem__(self, key, value) -> None:
        self._changes.count += 1
        if isinstance(value, dict) and not (isinstance(value, _ParamState) and value._changes is self._changes):
            value = _ParamState(value, self._changes)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._changes.count += 1
        super().__delitem__(key)

    def __reduce__(self):
        return type(self), (dict(self),)


class FusedOptimizer(torch.optim.Optimizer):
    op_name: ClassVar[str]
    _group_scalars: ClassVar[tuple]  # (scalar, group key) from the op's spec
    _computed_scalars: ClassVar[tuple]  # (scalar, function (optimizer, group) -> value) from the op's spec
    _spec: ClassVar[OpSpec]  # the op's declaration (specs.py)
    # The group's boolean options, checked by check_flag: the op's boolean scalars read from the
    # group (from its spec) and ``extra_flags``, those that are not (or are computed) op scalars.
    extra_flags: ClassVar[tuple[str, ...]] = ()
    _flags: ClassVar[tuple[str, ...]] = ()
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf

    def __init_subclass__(cls, **kwargs) -> None:
        """A class naming its op gets the op's scalar sources and reference from its spec, once."""
        super().__init_subclass__(**kwargs)
        if "op_name" in cls.__dict__:
            if cls.op_name not in SPECS:
                raise TypeError(f"{cls.__name__}.op_name = {cls.op_name!r} has no OpSpec; declare the op in "
                                "fused_optim/specs.py")
            spec = cls._spec = SPECS[cls.op_name]
            cls._group_scalars, cls._computed_scalars = spec.group_scalars(), spec.computed_scalars()
            cls._flags = (*spec.group_flags(), *cls.extra_flags, "master_weights", "stochastic_rounding")

    def __init__(self, params, defaults: dict, *, fused: bool | None = None, set_grad_none: bool = True,
                 master_weights: bool = False, state_dtype=None, state_rounding: str = "nearest",
                 stochastic_rounding: bool = False):
        if fused not in (None, True, False):
            raise ValueError(f"Invalid fused value: {fused!r} (use None, True or False)")
        check_flag("master_weights", master_weights)
        check_flag("stochastic_rounding", stochastic_rounding)
        if master_weights:  # (a group without the key has none: state dicts are as before)
            defaults = {**defaults, "master_weights": True}
        # Compact state (fused_optim/state_formats.py): group keys only when set, as master_weights.
        defaults = {**defaults, **state_formats.group_keys(state_dtype, state_rounding, stochastic_rounding)}
        self.fused = fused
        self.set_grad_none = bool(set_grad_none)
        self.implementation: str | None = "reference" if fused is False else None
        self._plans: dict[int, _Plan] = {}
        self._warned: set[str] = set()
        self._checked: dict[int, list] = {}  # id(group) -> its hyperparameters at their last check
        # lr=None (apex's and quadra's torch `required`): the constructor leaves lr to every param group
        self._check_group({**defaults, "lr": 0.0} if _lr_missing(defaults) else defaults)
        super().__init__(params, defaults)
        self.state = _StateDict(self.state)

    # ---- hooks for algorithms -------------------------------------------------------------
    def _validate(self, group: dict) -> None:
        raise NotImplementedError

    def _init_state(self, p: Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _check_state(self, state: dict) -> None:
        """Raises for a loaded param state the algorithm cannot continue from (nothing is loaded)."""

    def _state_lists(self, group: dict, params: list[Tensor], states: list[dict], fresh: list[bool]) -> tuple:
        return self._spec.lists(group, states, fresh)

    def _scalars(self, group: dict) -> dict:
        """The op's keyword scalars: each a group value, or computed by its spec's function (one
        dict build per group and step)."""
        scalars = {name: group[key] for name, key in self._group_scalars}
        for name, compute in self._computed_scalars:
            scalars[name] = compute(self, group)
        return scalars

    def _layout(self, group: dict) -> tuple:
        return ()

    def _prepare_step(self) -> None:
        pass

    # ---- torch.optim.Optimizer API ---------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_group(merged)  # before torch adds the group: a bad group leaves no trace
        if "state_dtype" in param_group:  # as the check normalized it: torch.bfloat16 and "bf16" are "bfloat16"
            param_group["state_dtype"] = merged["state_dtype"]
        super().add_param_group(param_group)
        # counted from the start (_plan_key also wraps a list assigned later; a compiled step only reads it)
        self.param_groups[-1]["params"] = _ParamList(self.param_groups[-1]["params"])
        complex_params = [p for p in self.param_groups[-1]["params"] if p.is_complex()]
        if complex_params:
            self.param_groups.pop()
            raise ValueError(
                f"{type(self).__name__} does not support complex parameters (got {complex_params[0].dtype}); "
                "optimize torch.view_as_real(param) or use torch.optim"
            )

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "fused": self.fused, "set_grad_none": self.set_grad_none}

    def state_dict(self) -> dict:
        """torch's, each param's state a plain dict (torch.load's ``weights_only`` takes no other);
        entries of ``optimizer.state`` that are not dicts are kept as they are, as torch does."""
        state_dict = super().state_dict()
        state_dict["state"] = {key: dict(value) if isinstance(value, _ParamState) else value
                               for key, value in state_dict["state"].items()}
        return state_dict

    def __setstate__(self, state: dict) -> None:
        for param_state in _param_states(state.get("state", {})):
            self._check_state(param_state)
        super().__setstate__(state)
        for group in self.param_groups:  # groups saved by torch.optim lack our keys
            for key, value in self.defaults.items():
                if key not in _TORCH_ONLY_DEFAULTS:
                    group.setdefault(key, value)
        self.__dict__.setdefault("fused", None)  # unpickled from an older version
        self.__dict__.setdefault("set_grad_none", True)
        self.__dict__.setdefault("implementation", "reference" if self.fused is False else None)
        self.__dict__.setdefault("_warned", set())
        self.state = _StateDict(self.state)
        for param_state in _param_states(self.state):
            _step_as_tensor(param_state)
        self._plans = {}  # load_state_dict ends here: state tensors were replaced
        self._checked = {}  # (and the groups)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the state of a param with master weights or compact state keeps
        its tensors as saved (torch casts every state tensor of a floating-point param to its
        dtype: fp16 masters, uint8 codes, int64 rounding keys); the next step converts compact
        state saved in another format to the group's (decode, encode)."""
        def keep(st: dict) -> bool:
            return "master_param" in st or any(isinstance(v, Tensor) and v.dtype in (torch.uint8, torch.int64)
                                               for v in st.values())

        def saved_as_is(st: dict, key: str, value) -> bool:
            return isinstance(value, Tensor) and key != "step" and (keep(st) or value.dtype == torch.bfloat16)

        kept = {pid: {k: v for k, v in st.items() if saved_as_is(st, k, v)}
                for pid, st in state_dict["state"].items() if isinstance(st, dict)}
        # The state format is the loading optimizer's choice, not the checkpoint's: keep the groups'.
        formats = [{k: g[k] for k in state_formats.OPTIONS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, own in zip(self.param_groups, formats):
            for key in state_formats.OPTIONS:
                group.pop(key, None)
            group.update(own)
        saved_ids = (pid for g in state_dict["param_groups"] for pid in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for pid, p in zip(saved_ids, params):
            for key, value in kept.get(pid, {}).items():  # rounding keys: CPU tensors on every device
                self.state[p][key] = value.to(device="cpu" if key == state_formats.ROUNDING_KEY else p.device)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Like torch's; ``set_to_none=None`` uses the optimizer's ``set_grad_none`` default."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One update of every param with a grad; runs ``closure`` first and returns its loss."""
        loss = run_closure(closure)
        grad_scale, found_inf = self._amp_args()
        self._prepare_step()
        self._check_hyperparameters()
        self._check_later_groups()
        used = set()
        for gi, group in enumerate(self.param_groups):
            scalars = self._scalars(group)
            lr_tensor = scalars["lr"] if isinstance(scalars["lr"], Tensor) else None
            if lr_tensor is not None:
                scalars["lr"] = 0.0  # unused: the ops read lr_tensor
            amp = dict(lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf)
            if self._step_direct(group, scalars, amp):
                used.add("fused")
                continue
            used.update(self._step_general(gi, group, scalars, amp))
        if used:
            self.implementation = used.pop() if len(used) == 1 else "mixed"
        return loss

    # ---- internals --------------------------------------------------------------------------
    def _check_group(self, group: dict) -> None:
        """The algorithm's checks of a group's hyperparameters, after those of its boolean options."""
        if _lr_missing(group):
            raise ValueError(f"{type(self).__name__}: a param group has no lr and the constructor got none; "
                             "pass lr=... to the constructor or give every param group an 'lr'")
        for name in self._flags:
            if name in group:
                check_flag(name, group[name])
        state_formats.check_options(group, type(self).__name__, self._spec.compact)
        self._validate(group)

    def _amp_args(self) -> tuple[Tensor | None, Tensor | None]:
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, Tensor):
            # GradScaler passes a plain 0 when it recorded no inf checks for this optimizer.
            found_inf = torch.tensor(float(found_inf))
        return grad_scale, found_inf

    def _step_general(self, gi: int, group: dict, scalars: dict, amp: dict) -> set[str]:
        """The group's step through its plan, bucket by bucket; returns the implementations used.

        A step that raises leaves the group as it found it: the grads of the buckets after the
        first are checked before the first runs (each op checks its own before it writes), and the
        state made for first steps is removed with the plan, whose first-step flags would
        otherwise stay set."""
        grads = [p.grad for p in group["params"]]
        plan = self._plan(gi, group, grads)
        used = set()
        try:
            bucket_grads = [grads if b.whole else [grads[i] for i in b.index] for b in plan.buckets]
            for bucket, bgrads in zip(plan.buckets[1:], bucket_grads[1:]):
                self._check_grads(bucket, bgrads, gi)
            for bucket, bgrads in zip(plan.buckets, bucket_grads):
                used.add(self._run(bucket, bgrads, gi, scalars, amp))
        except BaseException:
            self._forget(group, plan)
            raise
        if plan.created:
            found_inf = amp["found_inf"]
            if found_inf is not None and bool(found_inf.item()):
                self._forget(group, plan)  # a skipped (overflow) first step: params never stepped
            self._plans.pop(id(group), None)  # the lists change after a param's first step
        return used

    def _forget(self, group: dict, plan: _Plan) -> None:
        """Undo the state ``plan`` made for first steps (a param that never stepped has no state,
        or the state it had) and drop the group's cached plan."""
        for made in plan.created:
            if made.before is None:
                del self.state[made.param]
            else:
                made.state.clear()
                made.state.update(made.before)
        self._plans.pop(id(group), None)

    def _step_direct(self, group: dict, scalars: dict, amp: dict) -> bool:
        """The common case in one call, without touching a grad in Python: the group's cached plan
        is one fused bucket of all its params, and the kernel's twin reads their grads itself.
        False (nothing changed) sends the step down the general path, which rebuilds the plan
        when a grad went missing and reports errors (sparse or mixed-dtype grads)."""
        plan = self._cached_plan(group)
        if plan is None or not plan.direct or torch.compiler.is_compiling():
            return False
        try:
            return self._step_twin(plan.buckets[0], scalars, amp)
        except RuntimeError:
            return False

    def _step_twin(self, bucket: _Bucket, scalars: dict, amp: dict) -> bool:
        """The bucket's eager kernel call; False (nothing changed) when a param has no grad.

        Under ``fused_optim.testing.emulated_cuda()`` this does what the twin does for CUDA params
        (read the grads, call the list op: ``run_on_device`` in csrc/cpu/bucket.h) with the emulated
        CUDA library's list op: the twin itself would run the CPU kernels on these CPU tensors."""
        name, flags = (self.op_name, {}) if bucket.compact is None else (self._spec.compact_name, bucket.compact)
        if _ops.emulating_cuda():
            grads = [p.grad for p in bucket.params]
            if any(g is None for g in grads):
                return False
            _ops.op(name)(bucket.params, grads, *bucket.state, *bucket.per_step, **amp, **scalars, **flags)
            return True
        return _ops.op(name + "bucket")(bucket.bucket_id(), *bucket.per_step, **amp, **scalars, **flags) == 0

    def _cached_plan(self, group: dict) -> _Plan | None:
        """The group's plan if its lists are still those of the group's params, layout and state."""
        plan = self._plans.get(id(group))
        if plan is None or plan.state_version != self.state.version:
            return None
        return plan if plan.key == self._plan_key(group) else None

    def _plan_key(self, group: dict) -> tuple:
        """What a plan's lists are built for: the group's params list and its changes, master
        weights, compact state options and layout."""
        params = group["params"]
        if type(params) is not _ParamList:  # a list assigned to the group: counted from now on
            params = group["params"] = _ParamList(params)
        compact = tuple(group.get(k, default) for k, default in state_formats.OPTIONS.items())
        return id(params), params.changes, bool(group.get("master_weights")), compact, self._layout(group)

    def _plan(self, gi: int, group: dict, grads: list) -> _Plan:
        has_grad = [g is not None for g in grads]
        plan = self._cached_plan(group)
        if plan is not None and plan.has_grad == has_grad:
            return plan
        plan = _Plan(self._plan_key(group), group["params"], has_grad, [])
        try:
            self._fill_plan(plan, gi, group, grads)
        except BaseException:
            self._forget(group, plan)
            raise
        plan.state_version = self.state.version
        plan.direct = len(plan.buckets) == 1 and plan.buckets[0].whole and plan.buckets[0].fused
        if not torch.compiler.is_compiling():  # dynamo traces the plan; it cannot store it
            self._plans[id(group)] = plan
        return plan

    def _fill_plan(self, plan: _Plan, gi: int, group: dict, grads: list) -> None:
        """Makes the state of params on their first step (recorded in ``plan.created``) and cuts
        the params with grads into ``plan.buckets``, run in order: params that share memory (the
        same param twice, overlapping views) go to successive buckets (see ``_Layers``)."""
        kernels: dict[str, bool] = {}  # device type -> may use the kernels
        by_kind: dict[tuple, list[int]] = {}  # (layer, device, dtype, fused) -> indices, layers in order
        layers = _Layers()
        for i, (p, g) in enumerate(zip(group["params"], grads)):
            if g is None:
                continue
            if not p.is_floating_point():
                torch_words = f"(fused=True): {torch_fused_refusal(p)};" if self.fused else ":"
                raise RuntimeError(
                    f"{type(self).__name__}{torch_words} param {i} of group {gi} has dtype {p.dtype}; only "
                    "floating-point params can be optimized (torch.optim fails on it too); leave it out of the optimizer"
                )
            if p.layout is not torch.strided:  # before its state is made: zeros_like(sparse) fails unclearly
                raise RuntimeError(
                    f"{type(self).__name__}: param {i} of group {gi} is a sparse tensor ({p.layout}); fused_optim "
                    "does not support sparse gradients or params (use torch.optim.SparseAdam, or a dense param)"
                )
            state = self.state.get(p)  # not self.state[p]: dynamo cannot trace our __missing__
            new = state is None
            if new:
                state = self.state.new_param_state()
            before = dict(state)
            self._make_master(p, state, group, gi, i)
            self._init_state(p, state, group)
            self._compact_state(p, state, group, gi, i)
            if new and state:  # as torch.optim: a param without state tensors has no entry
                self.state[p] = state
            if len(state) != len(before) or any(state[k] is not v for k, v in before.items()):
                plan.created.append(_Created(p, state, None if new else before))
            _place_step(p, state)
            kind = p.device.type
            if kind not in kernels:
                kernels[kind] = self.fused is not False and self._kernels_available(kind)
            reason = self._unfusable(p, state, group) if kernels[kind] else "kernels unavailable"
            if reason and self.fused is not False and kernels[kind]:
                self._fallback(f"param {i} of group {gi} {reason}", torch_fused_refusal(p))
            by_kind.setdefault((layers.of(p), p.device, p.dtype, reason is None), []).append(i)
        fresh_ids = {id(made.state) for made in plan.created}
        for (_, _, _, fused), index in by_kind.items():
            params = [group["params"][i] for i in index]
            states = [self.state.get(p, {}) for p in params]
            state, per_step = self._state_lists(group, params, states, [id(st) in fresh_ids for st in states])
            whole = len(index) == len(grads)
            compact = None
            if state_formats.is_compact(group):
                compact, extra = self._compact_lists(group, params, states, state)
                state = (*state, *extra)
            plan.buckets.append(_Bucket(index, whole, params, state, per_step, fused, compact))

    @staticmethod
    def _make_master(p: Tensor, state: dict, group: dict, gi: int, i: int) -> None:
        """With the group's ``master_weights``, an fp16/bf16 param's fp32 master
        (``state["master_param"]``), made from the param on its first step."""
        if p.dtype not in (torch.float16, torch.bfloat16):
            return
        if not group.get("master_weights"):
            if "master_param" in state:
                raise RuntimeError(f"param {i} of group {gi} has a master_param in its state, but the group's "
                                   "master_weights is False; set it back to True, or drop the param's state")
            return
        if "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format)

    def _compact_keys(self) -> list[tuple[str, bool]]:
        """(state key, signed) of the state tensors a compact format may hold (the op's moments)."""
        return [(lst.state_key, lst.sample != "nonnegative") for _, lst in self._spec.compact_lists()]

    def _compact_state(self, p: Tensor, state: dict, group: dict, gi: int, i: int) -> None:
        """Brings a param's moments to its group's ``state_dtype`` (new zeros, or state loaded or
        made in another format: decoded and encoded) and gives it a rounding key when the group
        rounds stochastically (see fused_optim/state_formats.py)."""
        values = state_like(p, state).dtype
        state_formats.convert_state(state, self._compact_keys(), state_formats.target_dtype(group, values))
        stochastic = group.get("state_rounding") == "stochastic" or group.get("stochastic_rounding")
        if stochastic and state_formats.ROUNDING_KEY not in state:
            state[state_formats.ROUNDING_KEY] = state_formats.initial_key(gi, i)

    def _compact_lists(self, group: dict, params: list[Tensor], states: list[dict], lists: tuple):
        """The compact twin's flags and its two extra lists (absmaxes of the 8-bit state lists,
        list-major, and the rounding keys) for a bucket whose op lists are ``lists``."""
        absmaxes = []
        for k, lst in self._spec.compact_lists():
            if lists[k] and lists[k][0].dtype == torch.uint8:
                absmaxes += [st[state_formats.absmax_key(lst.state_key)] for st in states]
        moments = [lists[k] for k, _ in self._spec.compact_lists() if lists[k]]
        half_values = state_like(params[0], states[0]).dtype == torch.bfloat16
        flags = dict(stochastic_state=group.get("state_rounding") == "stochastic" and bool(moments)
                     and moments[0][0].dtype == torch.bfloat16,
                     stochastic_params=bool(group.get("stochastic_rounding")) and half_values
                     and "master_param" not in states[0])
        stochastic = flags["stochastic_state"] or flags["stochastic_params"]
        keys = [st[state_formats.ROUNDING_KEY] for st in states] if stochastic else []
        return flags, (absmaxes, keys)

    def _kernels_available(self, device_type: str) -> bool:
        """Whether the kernels for ``device_type`` built (building them now if needed); True for
        a device type without kernels, which ``_unfusable`` then names."""
        if device_type not in FUSED_DEVICE_TYPES:
            return True
        try:
            _build.load(device_type)
            return True
        except _build.BuildError:
            if self.fused:
                raise
            if device_type not in _build_warnings_shown:
                _build_warnings_shown.add(device_type)
                warnings.warn(f"{_build.build_error(device_type)} Falling back to the reference implementation.",
                              stacklevel=4)
            return False

    def _unfusable(self, p: Tensor, state: dict, group: dict) -> str | None:
        """Why the kernel cannot update ``p`` in place, or None when it can."""
        if type(p) not in (Tensor, torch.nn.Parameter):
            return f"is a {type(p).__name__}, a tensor subclass the kernel cannot see through"
        if p.device.type not in FUSED_DEVICE_TYPES:
            return f"is on {p.device}, which has no fused kernel yet"
        if p.dtype not in FUSED_DTYPES:
            return f"has dtype {p.dtype}, which has no fused kernel"
        if not p.is_contiguous():
            return "is not contiguous (the kernel never updates a copy)"
        dtype = state["master_param"].dtype if "master_param" in state else p.dtype  # (_master)
        if state_formats.is_compact(group) and dtype == torch.float64:
            return "is float64: compact state (state_dtype) has kernels for float32/16 and bfloat16 values only"
        compact = {key: state_formats.target_dtype(group, dtype) for key, _ in self._compact_keys()}
        for name, t in state.items():
            want = compact.get(name, torch.int64 if name == state_formats.ROUNDING_KEY else
                               torch.float32 if name.endswith("_absmax") else dtype)
            device = torch.device("cpu") if name == state_formats.ROUNDING_KEY else p.device  # (read on the host)
            if isinstance(t, Tensor) and name != "step" and not (
                t.is_contiguous() and t.dtype == want and t.device == device
            ):
                return f"has state '{name}' that is not a contiguous {want} tensor on {device}"
        return None

    def _run(self, bucket: _Bucket, grads: list[Tensor], gi: int, scalars: dict, amp: dict) -> str:
        """One op call for the bucket; returns which implementation ran.

        The kernel checks the grads itself (dense, same dtype and shape as their params) before it
        writes anything, so the hot path does no per-grad Python check: a bucket the kernel
        refuses is unchanged and is redone here by the reference path, or the error is raised,
        naming params by their index in the group."""
        if bucket.compact is not None:
            return self._run_compact(bucket, grads, gi, scalars, amp)
        if bucket.fused:
            try:
                if torch.compiler.is_compiling():  # the traceable op, with every list spelled out
                    _ops.op(self.op_name)(bucket.params, grads, *bucket.state, *bucket.per_step, **amp, **scalars)
                elif not self._step_twin(bucket, scalars, amp):
                    raise RuntimeError("fused_optim: a param lost its grad during the step")
                return "fused"
            except RuntimeError as exc:
                self._check_grads(bucket, grads, gi)
                mismatch = self._dtype_mismatch(bucket, grads, gi)
                if mismatch is None:
                    raise RuntimeError(in_group_terms(str(exc), [(gi, i) for i in bucket.index])) from exc
                self._fallback(mismatch)
        self._check_grads(bucket, grads, gi)
        self._spec.run_reference(bucket.params, grads, *bucket.state, *bucket.per_step, **amp, **scalars)
        return "reference"

    def _run_compact(self, bucket: _Bucket, grads: list[Tensor], gi: int, scalars: dict, amp: dict) -> str:
        """``_run`` for a compact bucket: the compact twin op (a list op, CPU or CUDA) or its reference."""
        self._check_grads(bucket, grads, gi)
        args = (bucket.params, grads, *bucket.state, *bucket.per_step)
        if bucket.fused and self._dtype_mismatch(bucket, grads, gi) is None:
            try:
                _ops.op(self._spec.compact_name)(*args, **amp, **scalars, **bucket.compact)
                return "fused"
            except RuntimeError as exc:
                raise RuntimeError(in_group_terms(str(exc), [(gi, i) for i in bucket.index])) from exc
        self._spec.run_compact_reference(*args, **amp, **scalars, **bucket.compact)
        return "reference"

    def _check_hyperparameters(self) -> None:
        """``_check_group`` on every group whose hyperparameters changed since their last check,
        before any group steps: a bad value set in a later group (``group["lr"] = None``) raises
        naming it and leaves every group as it was, instead of failing in that group's kernel call
        after the groups before it stepped. The lr, which schedulers and AdaScale change from step
        to step, is left out of the comparison: every step checks only that it is a number or a
        Tensor (what the kernels take), its range is checked with the group's other values."""
        for group in self.param_groups:
            values = [v for k, v in group.items() if k != "params" and k != "lr"]
            if self._checked.get(id(group)) != values:
                self._check_group(group)
                self._checked[id(group)] = values
            elif not (is_real(group["lr"]) or isinstance(group["lr"], Tensor)):
                check_lr(group["lr"])  # raises, naming it

    def _check_later_groups(self) -> None:
        """``_check_grads`` on the grads of every group after the first, before the first steps: a
        step that raises for a grad then leaves every group as it found it, not only that grad's
        group (the first group's grads are checked by its own step before it writes). A group on
        the direct path is looked at in one C++ call, its grads in Python only when that finds one
        missing or unlike its param."""
        for gi, group in enumerate(self.param_groups[1:], 1):
            plan = self._cached_plan(group)
            if plan is not None and plan.direct and _ops.op("bucket_grads_match")(plan.buckets[0].bucket_id()):
                continue
            index = [i for i, p in enumerate(group["params"]) if p.grad is not None]
            params = [group["params"][i] for i in index]
            # one fused bucket of the group's params with grads: the dtypes fused=True refuses
            self._check_grads(_Bucket(index, False, params, (), (), True), [p.grad for p in params], gi)

    def _check_grads(self, bucket: _Bucket, grads: list[Tensor], gi: int) -> None:
        """Raises, naming the param by its index in its group, for a grad no implementation takes:
        sparse, or not of its param's shape; with ``fused=True`` also for a grad whose dtype is
        not its param's (``fused=None`` updates such a bucket by the reference implementation)."""
        for i, p, g in zip(bucket.index, bucket.params, grads):
            if g.layout is not torch.strided:
                raise RuntimeError(
                    f"{type(self).__name__}: param {i} of group {gi} has a sparse gradient; "
                    "fused_optim does not support sparse gradients (use torch.optim.SparseAdam)"
                )
            if g.shape != p.shape:
                raise RuntimeError(
                    f"{type(self).__name__}: param {i} of group {gi} has shape {tuple(p.shape)} but its gradient "
                    f"has shape {tuple(g.shape)}; give each param a gradient of its own shape"
                )
        mismatch = self._dtype_mismatch(bucket, grads, gi)
        if mismatch is not None and self.fused:
            self._fallback(mismatch)

    @staticmethod
    def _dtype_mismatch(bucket: _Bucket, grads: list[Tensor], gi: int) -> str | None:
        """Why a fused bucket's kernel cannot take these grads because of their dtype, or None."""
        if bucket.fused:
            for i, p, g in zip(bucket.index, bucket.params, grads):
                if g.dtype != p.dtype:
                    return (f"group {gi} has gradients whose dtype differs from their params' ({p.dtype}): "
                            f"param {i} of group {gi} has a {g.dtype} gradient")
        return None

    def _fallback(self, why: str, torch_words: str | None = None) -> None:
        """Under ``fused=True`` raises saying ``why`` the kernels cannot be used (after torch's
        ``torch_words`` for the same refusal, if any); else warns once per reason, which the
        reference implementation then handles."""
        hint = "make the tensors contiguous/supported, or pass fused=False"
        if self.fused:
            prefix = f"{torch_words}; " if torch_words else ""
            raise RuntimeError(f"{type(self).__name__}(fused=True): {prefix}{why}; {hint}")
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(
                f"{type(self).__name__}: {why}; it is updated by the slower reference implementation "
                f"({hint} to silence this).",
                stacklevel=4,
            )
