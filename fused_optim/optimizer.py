"""``FusedOptimizer``: everything an optimizer needs except its update rule.

An algorithm subclass declares data and small hooks:

* ``op_name``: the op it calls, declared in :mod:`.specs` (schema, keyword scalars, reference);
* ``_validate(group)``: torch-style ``ValueError`` for bad hyperparameters (defaults and every
  group; the checks are in :mod:`.checks`);
* ``_init_state(p, state, group)``: adds the state tensors a param still lacks (torch.optim names),
  made like ``state_like(p, state)`` (the param, or its fp32 master under master weights);
* ``_check_state(state)``: raises for a loaded param state it cannot continue from;
* ``_state_lists(group, params, states, fresh)``: the op's arguments after params and grads, as
  ``(state tensor lists, per-step lists)`` (``fresh[i]``: ``_init_state`` made state for param i
  for this step, i.e. this is its first step); its op's spec makes them (an algorithm need not write it);
* ``_scalars(group)``: the op's keyword scalars, built from the group as the op's declaration in
  :mod:`.specs` maps them (an algorithm need not write it);
* ``_layout(group)``: what in a group changes those lists (e.g. momentum on/off);
* ``_prepare_step()``: work across all groups after the closure ran (LAMB's global grad norm).

The base class wires the pieces of a step, each in a module of its own: it validates the groups
(:mod:`.checks`), makes each param's state lazily (:mod:`.param_state`: step counters, fp32
masters, compact moments), cuts each group's params into buckets by (device, dtype, kernel
eligibility) and caches their tensor lists, registered on the C++ side, until the group or the
state changes (:mod:`.step_plan`), and decides what the kernels cannot take (:mod:`.fallback`,
the three-valued ``fused`` flag: ``None`` the kernels where they build and take the tensors, else
the reference implementation with one warning; ``True`` the kernels or an error; ``False`` the
reference). A step calls one op per bucket; in the common case (one fused bucket holding the
whole group) that is one C++ call that reads the grads itself. It implements the AMP contract of
``torch.amp.GradScaler`` (``grad_scale`` / ``found_inf`` are handed to the op, which unscales
inside and skips everything on overflow).

``master_weights=True`` (every optimizer's keyword; a group key when set) gives each fp16/bf16
param an fp32 master, ``state["master_param"]``; a step updates the masters in fp32 and writes
each param as its master rounded to nearest even (one kernel pass on the CPU). ``state_dtype``
(``torch.bfloat16`` or ``"8bit"``; ``torch.float32`` for fp16/bf16 params), ``state_rounding``
and ``stochastic_rounding`` (keywords of the optimizers whose op has compact kernels,
``OpSpec.compact``; group keys when set) keep the moments in another format (:mod:`.state_formats`):
such a group steps through its op's compact twin. State dicts keep masters, codes, absmaxes and rounding keys as saved (8-bit codes
with a trailing dimension of 1, which no other optimizer takes for moments).

``opt.implementation`` records what the last eager step used: ``"fused"``, ``"reference"`` or
``"mixed"`` (``None`` before the first step of an optimizer that may fuse); a step compiled by
``torch.compile`` leaves it as it was (dynamo before torch 2.13 cannot trace the write).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from . import _ops, fsdp1, param_state, sharding, state_formats
from .checks import check_flag, check_lr, lr_missing
from .fallback import FallbackPolicy, in_group_terms
from .spec import OpSpec
from .specs import SPECS
from .step_plan import Bucket, Created, Layers, ParamList, ParamState, Plan, StateDict, param_states

# Added to ``defaults`` by torch's ``Optimizer.__setstate__`` (so by every load_state_dict); a
# group must not gain it, or a state dict changes across save/load.
_TORCH_ONLY_DEFAULTS = frozenset({"differentiable"})
# The group options a plan's lists depend on besides the algorithm's layout, with their defaults.
_STATE_OPTIONS = (("master_weights", False), *state_formats.OPTIONS.items())
_StateDict = StateDict  # the name that optimizers pickled before step_plan.py held it refer to


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """torch.optim's closure contract: ``closure`` (if any) runs with grad enabled (a step runs
    under no_grad) and its loss is returned (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FusedOptimizer(FallbackPolicy, torch.optim.Optimizer):
    op_name: ClassVar[str]
    _group_scalars: ClassVar[tuple]  # (scalar, group key) from the op's spec
    _item_scalars: ClassVar[tuple]  # (scalar, group key, index) from the op's spec
    _computed_scalars: ClassVar[tuple]  # (scalar, function (optimizer, group) -> value) from the op's spec
    _twins: ClassVar[dict]  # compact? -> the bucket twin op a step calls (its list op's, its compact twin's)
    _spec: ClassVar[OpSpec]  # the op's declaration (specs.py)
    _moments: ClassVar[list]  # (state key, signed) of the state a compact format may hold, from the spec
    # The group's boolean options, checked by check_flag: the op's boolean scalars read from the
    # group (from its spec) and ``extra_flags``, those that are not (or are computed) op scalars.
    extra_flags: ClassVar[tuple[str, ...]] = ()
    _flags: ClassVar[tuple[str, ...]] = ()
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    # (what the update does with each whole tensor, what to use instead where params are slices
    # of tensors) for a rule that is not elementwise; FSDP1's params are refused with it.
    whole_tensor_rule: ClassVar[tuple[str, str] | None] = None

    def __init_subclass__(cls, **kwargs) -> None:
        """A class naming its op gets the op's scalar sources and reference from its spec, once."""
        super().__init_subclass__(**kwargs)
        if "op_name" in cls.__dict__:
            if cls.op_name not in SPECS:
                raise TypeError(f"{cls.__name__}.op_name = {cls.op_name!r} has no OpSpec; declare the op in "
                                "fused_optim/specs.py")
            spec = cls._spec = SPECS[cls.op_name]
            cls._group_scalars, cls._item_scalars = spec.group_scalars(), spec.item_scalars()
            cls._computed_scalars = spec.computed_scalars()
            cls._twins = {False: _ops.op(spec.name + "bucket"),
                          True: _ops.op(spec.compact_name + "bucket") if spec.compact else None}
            cls._moments = param_state.compact_keys(spec)
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
        self._plans: dict[int, Plan] = {}
        self._warned: set[str] = set()
        self._checked: dict[int, list] = {}  # group index -> its hyperparameters at their last check
        # lr=None (apex's and quadra's torch `required`): the constructor leaves lr to every param group
        self._check_group({**defaults, "lr": 0.0} if lr_missing(defaults) else defaults)
        super().__init__(params, defaults)
        self.state = StateDict(self.state)

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
        """The op's keyword scalars: each a group value, an item of one as a float, or computed by
        its spec's function (one dict build per group and step)."""
        scalars = {name: group[key] for name, key in self._group_scalars}
        for name, key, i in self._item_scalars:
            scalars[name] = float(group[key][i])
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
        self.param_groups[-1]["params"] = ParamList(self.param_groups[-1]["params"])
        complex_params = [p for p in self.param_groups[-1]["params"] if p.is_complex()]
        if complex_params:
            self.param_groups.pop()
            raise ValueError(
                f"{type(self).__name__} does not support complex parameters (got {complex_params[0].dtype}); "
                "optimize torch.view_as_real(param) or use torch.optim"
            )
        if self.whole_tensor_rule is not None:
            try:
                fsdp1.check_whole_tensors(self.param_groups[-1]["params"], len(self.param_groups) - 1,
                                          type(self).__name__, *self.whole_tensor_rule)
            except ValueError:
                self.param_groups.pop()
                raise

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "fused": self.fused, "set_grad_none": self.set_grad_none}

    def state_dict(self) -> dict:
        """torch's, each param's state a plain dict (torch.load's ``weights_only`` takes no other)
        in its saved form (8-bit codes with a trailing dimension of 1: :func:`.param_state.saved_form`);
        entries of ``optimizer.state`` that are not dicts are kept as they are, as torch does."""
        state_dict = super().state_dict()
        state_dict["state"] = {key: param_state.saved_form(value) if isinstance(value, ParamState) else value
                               for key, value in state_dict["state"].items()}
        return state_dict

    def __setstate__(self, state: dict) -> None:
        for saved in param_states(state.get("state", {})):
            self._check_state(saved)
        super().__setstate__(state)
        for group in self.param_groups:  # groups saved by torch.optim lack our keys
            for key, value in self.defaults.items():
                if key not in _TORCH_ONLY_DEFAULTS:
                    group.setdefault(key, value)
        self.__dict__.setdefault("fused", None)  # unpickled from an older version
        self.__dict__.setdefault("set_grad_none", True)
        self.__dict__.setdefault("implementation", "reference" if self.fused is False else None)
        self.__dict__.setdefault("_warned", set())
        self.state = StateDict(self.state)
        for loaded in param_states(self.state):
            param_state.step_as_tensor(loaded)
        self._plans = {}  # load_state_dict ends here: state tensors were replaced
        self._checked = {}  # (and the groups)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the state of a param with master weights or compact state keeps
        its tensors as saved (torch casts every state tensor of a floating-point param to its
        dtype: fp16 masters, uint8 codes, int64 rounding keys), and each group keeps its own
        compact-state options; the next step converts compact state saved in another format to
        the group's (decode, encode). A damaged param state (a step count that is not a finite
        number >= 0, 8-bit codes or absmax of the wrong length) raises ``ValueError`` naming the
        param, and nothing is loaded."""
        param_state.check_loaded(state_dict, self.param_groups, self._moments)
        kept = param_state.kept_as_saved(state_dict["state"])
        formats = param_state.group_formats(self.param_groups)
        super().load_state_dict(state_dict)
        param_state.set_group_formats(self.param_groups, formats)
        param_state.restore_kept(self.state, state_dict["param_groups"], self.param_groups, kept)

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
        if used and not torch.compiler.is_compiling():
            self.implementation = used.pop() if len(used) == 1 else "mixed"
        return loss

    # ---- internals --------------------------------------------------------------------------
    def _check_group(self, group: dict) -> None:
        """The algorithm's checks of a group's hyperparameters, after those of its boolean options."""
        if lr_missing(group):
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
            self._drop_plan(group)  # the lists change after a param's first step
        return used

    def _forget(self, group: dict, plan: Plan) -> None:
        """Undo the state ``plan`` made or converted for this step (a param that never stepped has
        no state, or the state it had) and drop the group's cached plan."""
        for made in plan.created:
            if made.before is None:
                del self.state[made.param]
            else:
                made.state.clear()
                made.state.update(made.before)
        self._drop_plan(group)

    def _drop_plan(self, group: dict) -> None:
        if not torch.compiler.is_compiling():  # (nothing is cached under dynamo)
            self._plans.pop(id(group), None)

    def _step_direct(self, group: dict, scalars: dict, amp: dict) -> bool:
        """The common case in one call, without touching a grad in Python: the group's cached plan
        is one fused bucket of all its params, and the kernel's twin reads their grads itself.
        False (nothing changed) sends the step down the general path, which rebuilds the plan
        when a grad went missing and reports errors (sparse or mixed-dtype grads)."""
        plan = self._cached_plan(group)
        if plan is None or not plan.direct:
            return False
        try:
            return self._step_twin(plan.buckets[0], scalars, amp)
        except RuntimeError:
            return False

    def _step_twin(self, bucket: Bucket, scalars: dict, amp: dict) -> bool:
        """The bucket's eager kernel call; False (nothing changed) when a param has no grad.

        Under ``fused_optim.testing.emulated_cuda()`` this does what the twin does for CUDA params
        (read the grads, call the list op: ``run_on_device`` in csrc/cpu/bucket.h) with the emulated
        CUDA library's list op: the twin itself would run the CPU kernels on these CPU tensors."""
        compact = bucket.compact is not None
        flags = bucket.compact if compact else {}
        if _ops.ROUTING.emulated_cuda:
            grads = [p.grad for p in bucket.params]
            if any(g is None for g in grads):
                return False
            name = self._spec.compact_name if compact else self.op_name
            _ops.op(name)(bucket.params, grads, *bucket.state, *bucket.per_step, **amp, **scalars, **flags)
            return True
        return self._twins[compact](bucket.bucket_id(), *bucket.per_step, **amp, **scalars, **flags) == 0

    def _cached_plan(self, group: dict) -> Plan | None:
        """The group's plan if its lists are still those of the group's params, layout and state."""
        if torch.compiler.is_compiling():  # dynamo traces the plan each time; nothing is cached
            return None
        plan = self._plans.get(id(group))
        if plan is None or plan.state_version != self.state.version:
            return None
        return plan if plan.key == self._plan_key(group) else None

    def _plan_key(self, group: dict) -> tuple:
        """What a plan's lists are built for: the group's params list and its changes, master
        weights, compact state options and layout."""
        params = group["params"]
        if type(params) is not ParamList:  # a list assigned to the group: counted from now on
            params = group["params"] = ParamList(params)
        options = tuple(group.get(k, default) for k, default in _STATE_OPTIONS)
        return id(params), params.changes, options, self._layout(group)

    def _plan(self, gi: int, group: dict, grads: list) -> Plan:
        has_grad = [g is not None for g in grads]
        plan = self._cached_plan(group)
        if plan is not None and plan.has_grad == has_grad:
            return plan
        compiling = torch.compiler.is_compiling()  # dynamo traces the plan; it cannot store it
        plan = Plan(None if compiling else self._plan_key(group), group["params"], has_grad, [])
        try:
            self._fill_plan(plan, gi, group, grads)
        except BaseException:
            self._forget(group, plan)
            raise
        plan.state_version = self.state.version
        plan.direct = len(plan.buckets) == 1 and plan.buckets[0].whole and plan.buckets[0].fused \
            and not plan.buckets[0].sharded
        if not compiling:
            self._plans[id(group)] = plan
        return plan

    def _fill_plan(self, plan: Plan, gi: int, group: dict, grads: list) -> None:
        """Makes the state of params on their first step (recorded in ``plan.created``) and cuts
        the params with grads into ``plan.buckets``, run in order: params that share memory (the
        same param twice, overlapping views) go to successive buckets (see ``Layers``)."""
        kernels: dict[str, bool] = {}  # device type -> may use the kernels
        by_kind: dict[tuple, list[int]] = {}  # (layer, device, dtype, fused) -> indices, layers in order
        layers = Layers()
        compact = state_formats.is_compact(group)
        for i, (p, g) in enumerate(zip(group["params"], grads)):
            if g is None:
                continue
            self._check_param(p, gi, i)
            state = self._step_state(plan, p, group, gi, i, compact)
            fused = self._may_fuse(p, state, group, gi, i, kernels)
            if not fused:
                self._check_unfused(p, state, f"param {i} of group {gi}")
            by_kind.setdefault((layers.of(p), p.device, p.dtype, fused, sharding.is_dtensor(p)), []).append(i)
        # ids of params (a param listed twice is fresh twice, as in torch.optim); dynamo traces
        # id() of a tensor, not of a dict
        fresh_ids = {id(made.param) for made in plan.created if made.first}
        for (_, _, _, fused, sharded), index in by_kind.items():
            params = [group["params"][i] for i in index]
            states = [self.state.get(p, {}) for p in params]
            state, per_step = self._state_lists(group, params, states, [id(p) in fresh_ids for p in params])
            flags = None
            if compact:
                flags, extra = param_state.compact_lists(self._spec, group, params, states, state)
                state = (*state, *extra)
            plan.buckets.append(Bucket(index, len(index) == len(grads), params, state, per_step, fused, flags, sharded))

    def _step_state(self, plan: Plan, p: Tensor, group: dict, gi: int, i: int, compact: bool) -> dict:
        """Param ``i``'s state for this step: made where it is missing (its master, the
        algorithm's tensors, the group's compact format; recorded in ``plan.created``, so that a
        step that fails or is skipped puts it back), its step counter on the right device. The
        param is on its first step when the algorithm made state for it (``_init_state``); state
        that was only converted (a master added to loaded state, moments brought to the group's
        format) continues where it was."""
        state = self.state.get(p)  # not self.state[p]: dynamo cannot trace our __missing__
        new = state is None
        if new:
            state = self.state.new_param_state()
        before = dict(state)
        param_state.make_master(p, state, group, gi, i)
        made = dict(state)
        self._init_state(p, state, group)
        first = len(state) != len(made) or any(state[k] is not v for k, v in made.items())
        if compact or param_state.in_other_format(p, state, self._moments):
            param_state.to_group_format(p, state, group, gi, i, self._moments)
        if new and state:  # as torch.optim: a param without state tensors has no entry
            self.state[p] = state
        if len(state) != len(before) or any(state[k] is not v for k, v in before.items()):
            plan.created.append(Created(p, state, None if new else before, first))
        param_state.place_step(p, state)
        return state

    def _run(self, bucket: Bucket, grads: list[Tensor], gi: int, scalars: dict, amp: dict) -> str:
        """One op call for the bucket; returns which implementation ran.

        The kernel checks the grads itself (dense, same dtype and shape as their params) before it
        writes anything, so the hot path does no per-grad Python check: a bucket the kernel
        refuses is unchanged and is redone here by the reference path, or the error is raised,
        naming params by their index in the group."""
        if bucket.sharded and bucket.fused:
            return self._run_sharded(bucket, grads, gi, scalars, amp)
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

    def _run_sharded(self, bucket: Bucket, grads: list[Tensor], gi: int, scalars: dict, amp: dict) -> str:
        """``_run`` for a fused bucket of DTensor params: the op (or its compact twin) on the local
        tensors of params, grads and state; a layer-wise op with the norms of the whole tensors
        (:func:`.sharding.run_layerwise`)."""
        self._check_grads(bucket, grads, gi)
        name, flags = (self.op_name, {}) if bucket.compact is None else (self._spec.compact_name, bucket.compact)
        lists = (sharding.locals_of(bucket.params), sharding.locals_of(grads),
                 *(sharding.locals_of(lst) for lst in bucket.state), *bucket.per_step)
        kwargs = {**amp, **scalars, **flags, **self._sharded_kwargs(bucket)}
        try:
            if "norm_sums" in scalars:
                sharding.run_layerwise(_ops.op(name), lists, bucket.params, kwargs)
            else:
                _ops.op(name)(*lists, **kwargs)
        except RuntimeError as exc:
            raise RuntimeError(in_group_terms(str(exc), [(gi, i) for i in bucket.index])) from exc
        return "fused"

    def _check_unfused(self, p: Tensor, state: dict, where: str) -> None:
        """Raises for a param that only the kernels can step, which do not take it here (8-bit
        state of a DTensor: :func:`.sharding.check_format`)."""
        sharding.check_format(p, state, where)

    def _sharded_kwargs(self, bucket: Bucket) -> dict:
        """The op's arguments that depend on a DTensor bucket's params (none here)."""
        return {}

    def _run_compact(self, bucket: Bucket, grads: list[Tensor], gi: int, scalars: dict, amp: dict) -> str:
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
        to step, is compared by its type only: a group whose lr stays a float (or a Tensor) is not
        checked again, one whose lr became another type is, lr included (``None``, a string, a
        negative int or a 2-element Tensor raise; an lr set to -1.0 in place of a float is not
        seen, as in torch.optim)."""
        for gi, group in enumerate(self.param_groups):
            lr = group.get("lr")
            values = [type(lr), *(v for k, v in group.items() if k != "params" and k != "lr")]
            if self._checked.get(gi) != values:
                if lr_missing(group):  # torch's "Invalid learning rate: None", not the constructor's message
                    check_lr(lr)
                self._check_group(group)
                self._checked[gi] = values

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
            sharded = any(sharding.is_dtensor(p) for p in params)
            self._check_grads(Bucket(index, False, params, (), (), True, sharded=sharded), [p.grad for p in params], gi)
