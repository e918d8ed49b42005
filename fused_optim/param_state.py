"""A param's state beyond its algorithm's update rule: step counters, fp32 masters and compact moments.

The base class makes a param's state on its first step (``_init_state``, the algorithm's hook,
between :func:`make_master` and :func:`to_group_format`) and keeps it where the kernels read it:

* **Step counters** are torch.optim's 0-dim tensors (:func:`scalar_dtype`), kept on the param's
  device where it has kernels and on the CPU otherwise (:func:`place_step`).
* **Master weights** (``master_weights=True``): an fp16/bf16 param gets ``state["master_param"]``,
  an fp32 copy made on its first step; its other state is made like the master (:func:`state_like`).
* **Compact state** (``state_dtype``, ``state_rounding``, ``stochastic_rounding``; the formats are
  defined in :mod:`.state_formats`): a group that sets them keeps the moments in bf16 or 8-bit
  codes, plus per-param rounding keys; :func:`to_group_format` brings a param's moments to its
  group's format, :func:`compact_lists` gives the compact twin ops their extra lists. A plain
  group only decodes moments loaded in another format (:func:`in_other_format`).
* **Loading**: torch's ``load_state_dict`` casts every state tensor to its param's dtype; the
  tensors that must stay as saved (masters, codes, rounding keys, bf16 moments) are taken from
  the checkpoint before and put back after (:func:`kept_as_saved`, :func:`restore_kept`), and
  the groups keep their own format options (:func:`group_formats`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import sharded_blocks, sharding, state_formats
from ._ops import FUSED_DEVICE_TYPES
from .spec import OpSpec


def state_like(p: Tensor, state: dict) -> Tensor:
    """What a param's state tensors are made like (shape, dtype, device): its fp32 master under
    master weights (``state["master_param"]``, made before ``_init_state`` runs), else the param."""
    return state.get("master_param", p)


def scalar_dtype() -> torch.dtype:
    """dtype of a step counter (torch.optim's ``_get_scalar_dtype``): float64 under a float64
    default dtype, else float32."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def step_as_tensor(state: dict) -> None:
    """A plain-number ``step`` (state dicts of torch < 1.12) becomes the 0-dim counter torch.optim
    makes of it when it loads one (``Adam.__setstate__``): the kernels count in a tensor."""
    step = state.get("step")
    if step is not None and not isinstance(step, Tensor):
        state["step"] = torch.tensor(float(step), dtype=scalar_dtype())


def place_step(p: Tensor, state: dict) -> None:
    """Keeps a step counter on its param's device, as torch's fused optimizers do: float32 on a
    GPU, where the kernels read and increment it without a host sync; on the CPU otherwise. (A
    state dict saved on one device and loaded for params on another moves its counters here.)
    A param on a device without kernels (``meta``: shape tracing) keeps its counter on the CPU,
    as torch's for-loop optimizers do: the reference implementation reads it as a number."""
    step = state.get("step")
    device = p.device if p.device.type in FUSED_DEVICE_TYPES else torch.device("cpu")
    if isinstance(step, Tensor) and step.device != device:
        state["step"] = step.to(device, torch.float32 if device.type == "cuda" else step.dtype)


def make_master(p: Tensor, state: dict, group: dict, gi: int, i: int) -> None:
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


def compact_keys(spec: OpSpec) -> list[tuple[str, bool]]:
    """(state key, signed) of the state tensors a compact format may hold (the op's moments)."""
    return [(lst.state_key, lst.sample != "nonnegative") for _, lst in spec.compact_lists()]


def in_other_format(p: Tensor, state: dict, keys: list[tuple[str, bool]]) -> bool:
    """Whether a param's moments (``keys``) are held in a dtype other than its values' (loaded,
    or made by its group under another ``state_dtype``): a plain group decodes them."""
    values = state_like(p, state).dtype
    return any(isinstance(state.get(key), Tensor) and state[key].dtype != values for key, _ in keys)


def to_group_format(p: Tensor, state: dict, group: dict, gi: int, i: int, keys: list[tuple[str, bool]]) -> None:
    """Brings a param's moments to its group's ``state_dtype`` (new zeros, or state loaded or
    made in another format: decoded and encoded) and gives it a rounding key when the group
    rounds stochastically (see fused_optim/state_formats.py)."""
    values = state_like(p, state).dtype
    if sharding.is_dtensor(p):  # (8-bit codes blocked per shard)
        state_formats.convert_state(state, keys, state_formats.target_dtype(group, values),
                                    sharded_blocks.encode_shards, sharded_blocks.decode_shards)
        _record_layout(p, state, keys)
    else:
        state_formats.convert_state(state, keys, state_formats.target_dtype(group, values))
    stochastic = group.get("state_rounding") == "stochastic" or group.get("stochastic_rounding")
    if stochastic and state_formats.ROUNDING_KEY not in state:
        state[state_formats.ROUNDING_KEY] = state_formats.initial_key(gi, i)


def _record_layout(p: Tensor, state: dict, keys: list[tuple[str, bool]]) -> None:
    """Keeps ``state["block_layout"]`` with a DTensor param's 8-bit codes (:mod:`.sharded_blocks`)."""
    if any(isinstance(state.get(key), Tensor) and state[key].dtype == torch.uint8 for key, _ in keys):
        state.setdefault(sharded_blocks.LAYOUT_KEY, sharded_blocks.layout_of(p))
    else:
        state.pop(sharded_blocks.LAYOUT_KEY, None)


def _rounding_flags(group: dict, p: Tensor, state: dict, moments: list) -> dict:
    """Which roundings of a compact bucket (first param ``p``, its ``state``; its non-empty moment
    lists) are stochastic: bf16 moments under ``state_rounding="stochastic"``, bf16 params
    without masters under ``stochastic_rounding``."""
    return dict(stochastic_state=group.get("state_rounding") == "stochastic" and bool(moments)
                and moments[0][0].dtype == torch.bfloat16,
                stochastic_params=bool(group.get("stochastic_rounding"))
                and state_like(p, state).dtype == torch.bfloat16 and "master_param" not in state)


def compact_lists(spec: OpSpec, group: dict, params: list[Tensor], states: list[dict], lists: tuple):
    """The compact twin's flags (with ``element_offsets`` for DTensor params rounded
    stochastically: :func:`.sharding.element_offset`) and its two extra lists (absmaxes of the
    8-bit state lists, list-major, and the rounding keys) for a bucket whose op lists are ``lists``."""
    absmaxes = []
    for k, lst in spec.compact_lists():
        if lists[k] and lists[k][0].dtype == torch.uint8:
            key = state_formats.absmax_key(lst.state_key)
            absmaxes += [sharded_blocks.local_absmax(st[key], p) if sharding.is_dtensor(p) else st[key]
                         for p, st in zip(params, states)]
    moments = [lists[k] for k, _ in spec.compact_lists() if lists[k]]
    flags = _rounding_flags(group, params[0], states[0], moments)
    stochastic = flags["stochastic_state"] or flags["stochastic_params"]
    keys = [st[state_formats.ROUNDING_KEY] for st in states] if stochastic else []
    if stochastic and any(sharding.is_dtensor(p) for p in params):  # shards draw their whole tensors' bits
        flags["element_offsets"] = [sharding.element_offset(p) for p in params]
    return flags, (absmaxes, keys)


def expected_state(name: str, group: dict, p: Tensor, values: torch.dtype,
                   keys: list[tuple[str, bool]] | None) -> tuple[torch.dtype, torch.device]:
    """(dtype, device) the kernels need state tensor ``name`` of param ``p`` in: the group's
    format for a moment of a compact group (``keys``: its moments; None for a plain group), an
    int64 CPU tensor for a rounding key (read on the host) or a block layout, fp32 for an 8-bit
    absmax, else the values' dtype (``values``: the param's, or its master's)."""
    if name in (state_formats.ROUNDING_KEY, sharded_blocks.LAYOUT_KEY):
        return torch.int64, torch.device("cpu")
    if name.endswith("_absmax"):
        return torch.float32, p.device
    if keys is not None and any(name == key for key, _ in keys):
        return state_formats.target_dtype(group, values), p.device
    return values, p.device


def saved_form(state: dict) -> dict:
    """A param's state as its state dict holds it: a plain dict whose 8-bit codes have a trailing
    dimension of 1 (shape ``param.shape + (1,)``, a view). Any optimizer that would read them as
    plain moments (torch.optim's cast them to the param's dtype) then fails at its first update
    (no in-place update of the param takes a broadcast shape of more dimensions) instead of
    stepping with codes as moments; :func:`restore_kept` gives them back the param's shape."""
    return {k: v.unsqueeze(-1) if isinstance(v, Tensor) and v.dtype == torch.uint8 else v for k, v in state.items()}


def check_loaded(state_dict: dict, groups: list[dict], keys: list[tuple[str, bool]]) -> None:
    """Raises ``ValueError`` for a saved param state no step can continue from, naming the param
    (group index, position) and the key: a ``step`` that is not a finite non-negative number
    (a damaged checkpoint: the update would turn the params non-finite), or 8-bit codes of a
    moment (``keys``) of another size than the param (of ``groups``, the loading optimizer's) or
    without an absmax of one element per block, or 8-bit codes blocked for another sharding than
    the param's (:mod:`.sharded_blocks`: whole-tensor codes into a DTensor param, a shard's into
    a plain one or a DTensor sharded otherwise). Runs before anything is loaded, so a refused
    state dict leaves the optimizer as it was."""
    saved = state_dict["state"]
    for gi, group in enumerate(state_dict["param_groups"]):
        params = groups[gi]["params"] if gi < len(groups) else []
        for i, pid in enumerate(group["params"]):
            st = saved.get(pid)
            if not isinstance(st, dict):
                continue
            where = f"param {i} of group {gi}"
            if "step" in st:
                _check_step(st["step"], where)
            param = params[i] if i < len(params) else None
            for key, _ in keys:
                codes = st.get(key)
                if isinstance(codes, Tensor) and codes.dtype == torch.uint8:
                    _check_sharding(codes, param, st, key, where)
                    _check_codes(codes, codes.numel() if param is None else param.numel(), key, where)
                    _check_absmax(st.get(state_formats.absmax_key(key)), codes, param, key, where)


def _check_step(step, where: str) -> None:
    if isinstance(step, Tensor) and step.numel() == 1 and not step.is_complex():
        value = float(step)
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"the loaded state of {where} has 'step' = {step!r}; a step count is a finite number >= 0 "
                         "(a damaged checkpoint?): load an intact checkpoint, or drop that param's state to "
                         "restart its moments")


def _check_sharding(codes: Tensor, param: Tensor | None, st: dict, key: str, where: str) -> None:
    """8-bit codes go to a param sharded as when they were made (see :func:`check_loaded`)."""
    if sharding.is_dtensor(param):
        # (codes of the whole tensor: a plain tensor, or one a full state dict's load distributed)
        if not sharding.is_dtensor(codes) or sharded_blocks.LAYOUT_KEY not in st:
            raise ValueError(f"the loaded state of {where} has 8-bit {key!r} without the {sharded_blocks.LAYOUT_KEY!r} "
                             "that codes blocked per shard come with (codes of the whole tensor, as an unsharded or "
                             "full state dict holds them), but the param is sharded (a DTensor), whose codes are "
                             "blocked per shard; load it into the unsharded model, or resume the sharded one from its "
                             "own sharded checkpoint or from one saved with state_dtype=torch.bfloat16 or None")
        sharded_blocks.check_layout(st[sharded_blocks.LAYOUT_KEY], param, key, where)
    elif sharding.is_dtensor(codes) or sharded_blocks.LAYOUT_KEY in st:
        raise ValueError(f"the loaded state of {where} has 8-bit {key!r} saved from a sharded param (blocked per "
                         "shard), but the param is a whole tensor; resume the sharded model on the mesh it was saved "
                         "with, or from a checkpoint saved with state_dtype=torch.bfloat16 or None")


def _check_codes(codes: Tensor, numel: int, key: str, where: str) -> None:
    if codes.numel() != numel:
        raise ValueError(f"the loaded state of {where} has 8-bit {key!r} of {codes.numel()} codes for a param of "
                         f"{numel} elements: load the checkpoint into the params it was saved for")


def _check_absmax(absmax, codes: Tensor, param: Tensor | None, key: str, where: str) -> None:
    sharded = sharding.is_dtensor(param)
    expected = math.prod(sharded_blocks.layout_of(param)[:2].tolist()) if sharded else \
        state_formats.blocks_of(codes.numel())
    name = state_formats.absmax_key(key)
    if not isinstance(absmax, Tensor) or absmax.numel() != expected:
        got = "none" if not isinstance(absmax, Tensor) else f"{absmax.numel()} elements"
        per = "S×B: S shards of B blocks" if sharded else f"one per block of {state_formats.BLOCK}"
        raise ValueError(f"the loaded state of {where} has 8-bit {key!r} of {codes.numel()} codes but {name!r} has "
                         f"{got}; it needs {expected} ({per}): load an intact checkpoint, or drop that param's "
                         "state to restart its moments")


def kept_as_saved(saved_state: dict) -> dict:
    """Per saved param id, the state tensors ``load_state_dict`` keeps as saved rather than cast
    to the param's dtype as torch does: every tensor (but ``step``) of a state with a master
    (fp32 under an fp16 param) or with compact state (uint8 codes, int64 rounding keys), and bf16
    moments (bf16 state of an fp32 param)."""
    kept = {}
    for pid, st in saved_state.items():
        if not isinstance(st, dict):
            continue
        whole = "master_param" in st or any(isinstance(v, Tensor) and v.dtype in (torch.uint8, torch.int64)
                                            for v in st.values())
        kept[pid] = {k: v for k, v in st.items()
                     if isinstance(v, Tensor) and k != "step" and (whole or v.dtype == torch.bfloat16)}
    return kept


def restore_kept(state: dict, saved_groups: list[dict], groups: list[dict], kept: dict) -> None:
    """Puts the tensors of :func:`kept_as_saved` into the loaded ``state``, on their params'
    devices (rounding keys on the CPU, where the kernels read them on every device), 8-bit codes
    in their param's shape (saved with a trailing dimension of 1, or as older state dicts hold them)."""
    saved_ids = (pid for g in saved_groups for pid in g["params"])
    params = (p for g in groups for p in g["params"])
    for pid, p in zip(saved_ids, params):
        for key, value in kept.get(pid, {}).items():
            if value.dtype == torch.uint8:
                value = value.reshape(p.shape)
            on_host = key in (state_formats.ROUNDING_KEY, sharded_blocks.LAYOUT_KEY)
            state[p][key] = value.to(device="cpu" if on_host else p.device)


def group_formats(groups: list[dict]) -> list[dict]:
    """Each group's compact-state options: the state format is the loading optimizer's choice, not
    the checkpoint's (see :func:`set_group_formats`)."""
    return [{k: g[k] for k in state_formats.OPTIONS if k in g} for g in groups]


def set_group_formats(groups: list[dict], formats: list[dict]) -> None:
    """Gives loaded groups the options :func:`group_formats` took before the load."""
    for group, own in zip(groups, formats):
        for key in state_formats.OPTIONS:
            group.pop(key, None)
        group.update(own)
