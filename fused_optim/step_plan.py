"""The step plan: what a param group's step calls, cached between steps, and the containers
that say when it must be rebuilt.

A plan (:class:`Plan`) cuts a group's params with grads into buckets (:class:`Bucket`): params of
one (device, dtype, kernel eligibility) whose tensor lists (params, the op's state and per-step
lists) go to one op call, registered once on the C++ side (``bucket_new``) so that a step passes
no tensor list. Params that share memory go to successive buckets (:class:`Layers`), so they are
updated one after the other, as torch.optim's per-param loop does. A plan is reused while the
group's params list, the set of params with grads, the group's layout and options, and the
optimizer's state are unchanged: the group's ``params`` is a :class:`ParamList` and
``optimizer.state`` a :class:`StateDict`, containers that count their changes (a param added or
replaced, a state dict or state tensor assigned anew), so that a step looks for a change by
comparing counters, not lists. The base class (:mod:`.optimizer`) builds and runs the plans.
"""

from __future__ import annotations

import bisect
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import _ops, sharding


@dataclass
class Bucket:
    """Params of one group sharing (device, dtype, kernel eligibility), with cached op lists."""

    index: list[int]  # positions in the group's params
    whole: bool  # all of the group's params, in order: the group's grads list is the bucket's
    params: list[Tensor]
    state: tuple  # the op's state tensor lists
    per_step: tuple  # the op's other list arguments (e.g. first-step flags)
    fused: bool
    compact: dict | None = None  # the compact twin's flags (its lists end ``state``), or None: the plain op
    sharded: bool = False  # DTensor params: the op takes their local tensors (fused_optim/sharding.py)
    _id: int | None = None

    def bucket_id(self) -> int:
        """The params and state lists registered with the kernels (once; freed with the bucket)."""
        if self._id is None:
            lists = [self.params, *self.state]
            self._id = _ops.op("bucket_new")([t for lst in lists for t in lst], [len(lst) for lst in lists])
            weakref.finalize(self, _ops.op("bucket_free"), self._id).atexit = False
        return self._id


def _extent(p: Tensor) -> tuple[int, int] | None:
    """The byte range [start, end) spanned by ``p``'s elements; None when it has none, or when
    there is no address to read (a tensor subclass, or a fake tensor under torch.compile)."""
    if p.numel() == 0 or type(p) not in (Tensor, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None
    last = sum((size - 1) * stride for size, stride in zip(p.shape, p.stride()))
    return p.data_ptr(), p.data_ptr() + (last + 1) * p.element_size()


class Layers:
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
        """The layer of the next param ``p`` (a DTensor's: of its local tensor)."""
        span = _extent(sharding.local(p))
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
class Created:
    """State a plan made or converted for a param's step: the param's state dict, what it held
    before (None: the dict itself is new), so a step that fails or is skipped can put it back, and
    whether the algorithm's state was made (``first``: the param's first step) or only converted
    (a master added, moments brought to another format: the param continues)."""

    param: Tensor
    state: dict
    before: dict | None
    first: bool


@dataclass
class Plan:
    """A group's step: its buckets, run in order, and what they were built for."""

    key: tuple | None  # what the lists are built for (FusedOptimizer._plan_key; None under dynamo: not cached)
    params: list  # the group's params list, held: its id in the key cannot be reused
    has_grad: list[bool]  # which params had a grad when the plan was built
    buckets: list[Bucket]
    created: list[Created] = field(default_factory=list)  # state made for this step (undone if it fails)
    state_version: int = -1
    direct: bool = False  # one fused bucket holding every param of the group (see _step_direct)


# ParamList and ParamState spell out each mutator with super(): dynamo traces those calls (a
# compiled step makes state), not the builtin's methods taken from the class by a decorator.
class ParamList(list):
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


class Changes:
    """How many times an optimizer's state dicts changed (see StateDict)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class ParamState(dict):
    """One param's state in ``optimizer.state``: a dict that counts every change of its entries
    (a state tensor assigned, replaced or removed) in its optimizer's ``Changes``. Copied and
    pickled as a plain dict."""

    __slots__ = ("_changes",)

    def __init__(self, items=(), changes: Changes | None = None):
        super().__init__(items)
        self._changes = Changes() if changes is None else changes

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


class StateDict(defaultdict):
    """``optimizer.state`` that counts the changes of its state dicts (``version``): a param's
    state dict assigned or removed (Lightning's optimizer_to_device replaces them when it moves
    state), or an entry of one (``ParamState``: every dict stored in it becomes one), so that
    cached lists notice when a state tensor is replaced. Like torch's ``defaultdict(dict)`` it
    takes any key and value: a value that is not a dict (``state["ran_hook"] = True``, as
    torch's state-dict hooks store) is kept as it is."""

    def __init__(self, items=()):
        self._changes = Changes()
        super().__init__(self.new_param_state)
        for key, value in dict(items).items():
            self[key] = value

    @property
    def version(self) -> int:
        return self._changes.count

    def new_param_state(self) -> ParamState:
        """An empty state dict whose changes this one counts."""
        return ParamState(changes=self._changes)

    def __setitem__(self, key, value) -> None:
        self._changes.count += 1
        if isinstance(value, dict) and not (isinstance(value, ParamState) and value._changes is self._changes):
            value = ParamState(value, self._changes)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._changes.count += 1
        super().__delitem__(key)

    def __reduce__(self):
        return type(self), (dict(self),)


def param_states(state: dict):
    """The params' state dicts among an ``optimizer.state``'s values (keyed by a tensor, as torch
    keys them; other keys hold whatever hooks stored there)."""
    return (value for key, value in state.items() if isinstance(key, Tensor) and isinstance(value, dict))
