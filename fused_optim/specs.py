"""The declaration of every update op (see :class:`.spec.OpSpec`), by op name: ``SPECS["adam_"]``.

They live together here, not next to their optimizer classes, because :mod:`._ops` defines the
schemas from them when it is imported, before any optimizer module can be (those import
:mod:`.optimizer`, which imports :mod:`._ops`); this module needs only :mod:`._reference`.
The group keys named here are those of every optimizer class calling the op (its ``op_name``).
"""

from __future__ import annotations

import torch

from . import _reference
from .spec import OpSpec, Scalar, StateList

_INT64_MAX = 2**63 - 1

_MOMENTUM = (StateList("momentum_buffers", "momentum_buffer", when="momentum"),)
_FIRST_STEP = (("bool[]", "first_step"),)
_MOMENTS = (StateList("exp_avgs", "exp_avg"), StateList("exp_avg_sqs", "exp_avg_sq", "nonnegative"))
_STEPS = (StateList("steps", "step", "counter"),)
# The sharded step's two calls of a layer-wise op (fused_optim/sharding.py): the local per-tensor
# sums only, then the update with the sums of the whole tensors (None / False: one call).
_NORM_SUMS = (Scalar("norm_sums", "Tensor?", lambda opt, group: None, "None"),
              Scalar("sums_only", "bool", lambda opt, group: False, "False"))


def _float(key: str) -> Scalar:
    return Scalar(key, "float", key)


def _bool(key: str) -> Scalar:
    return Scalar(key, "bool", key)


def _beta(i: int) -> Scalar:
    """``beta<i+1>`` from the group's ``betas`` pair, as a float (torch.optim's Tensor betas too)."""
    return Scalar(f"beta{i + 1}", "float", ("betas", i))


_SGD_SCALARS = (_float("lr"), _float("momentum"), _float("dampening"), _float("weight_decay"), _bool("nesterov"))
_SGD_SAMPLE = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)


def _lamb_global_norm(opt, group: dict):
    """The norm of all groups' grads when the group clips (None: the op takes its own grads')."""
    return opt._grad_norm if group["max_grad_norm"] else None


def _sparse_grad_size(opt, group: dict) -> int:
    """k is clamped to each param's size in the op; an int64 holds any size."""
    return min(int(group["sparse_grad_size"]), _INT64_MAX)


SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec(
        "sgd_", _MOMENTUM, _FIRST_STEP,
        (*_SGD_SCALARS, _bool("maximize"), _bool("wd_after_momentum")),
        _reference.sgd_,
        dict(_SGD_SAMPLE, maximize=False, wd_after_momentum=False), compact=True,
    ),
    OpSpec("sign_sgd_", _MOMENTUM, _FIRST_STEP, _SGD_SCALARS, _reference.sign_sgd_, _SGD_SAMPLE, compact=True),
    OpSpec(
        "lars_", _MOMENTUM, _FIRST_STEP,
        (*_SGD_SCALARS, _float("trust_coefficient"), _float("eps"), _bool("trust_clip"), _bool("always_adapt"),
         *_NORM_SUMS),
        _reference.lars_,
        dict(_SGD_SAMPLE, dampening=0.0, nesterov=True, trust_coefficient=0.01, eps=1e-8, trust_clip=True,
             always_adapt=False), compact=True,
    ),
    OpSpec(
        "colossal_lars_", _MOMENTUM, _FIRST_STEP,
        (_float("lr"), _float("momentum"), _float("eeta"), _float("weight_decay"), _float("epsilon"),
         Scalar("lars", "bool", lambda opt, group: bool(group["lars"])), *_NORM_SUMS),
        _reference.colossal_lars_,
        dict(lr=0.1, momentum=0.9, eeta=0.01, weight_decay=0.01, epsilon=0.0, lars=True), compact=True,
    ),
    OpSpec(
        "sparsified_sgd_", (StateList("memories", "memory"),), (),
        (_float("lr"), _float("weight_decay"), Scalar("sparse_grad_size", "int", _sparse_grad_size),
         Scalar("random_sparse", "bool", lambda opt, group: bool(group["random_sparse"])),
         Scalar("generator", "Generator?", lambda opt, group: opt.generator, "None"),
         # a DTensor bucket's, per param dimension (SparsifiedSGD._sharded_kwargs; csrc/host/sparse_indices.h)
         Scalar("whole_shapes", "int[]", lambda opt, group: (), "[]"),
         Scalar("box_offsets", "int[]", lambda opt, group: (), "[]")),
        _reference.sparsified_sgd_,
        dict(lr=0.1, weight_decay=0.01, sparse_grad_size=5, random_sparse=True),
        lambda: dict(generator=torch.Generator().manual_seed(0)),
    ),
    OpSpec(
        "adam_", (*_MOMENTS, StateList("max_exp_avg_sqs", "max_exp_avg_sq", "nonnegative", when="amsgrad"), *_STEPS), (),
        (_float("lr"), _beta(0), _beta(1), _float("eps"), _float("weight_decay"),
         _bool("amsgrad"), Scalar("decoupled", "bool", "decoupled_weight_decay"), _bool("maximize"),
         Scalar("bias_correction", "bool", "bias_correction", "True"),
         # ColossalAI's step(div_scale=d) divisor of the grads in the update (CPUAdam passes it;
         # 1: none). Unlike grad_scale it is never taken out of the grads written back.
         Scalar("div_scale", "float", None, "1.")),
        _reference.adam_,
        dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, amsgrad=True, decoupled=True,
             maximize=False, bias_correction=True), compact=True,
    ),
    OpSpec(
        "lamb_", (*_MOMENTS, *_STEPS), (),
        (_float("lr"), _beta(0), _beta(1), _float("eps"), _float("weight_decay"),
         _bool("bias_correction"), _bool("grad_averaging"), _bool("adam_w_mode"),
         Scalar("max_grad_norm", "float", lambda opt, group: float(group["max_grad_norm"] or 0.0)),
         _bool("use_nvlamb"), _bool("trust_clip"),
         Scalar("global_grad_norm", "Tensor?", _lamb_global_norm, "None"), *_NORM_SUMS),
        _reference.lamb_,
        dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, bias_correction=True,
             grad_averaging=True, adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False, trust_clip=False),
        lambda: dict(global_grad_norm=torch.tensor(30.0)),  # > max_grad_norm: clips
        compact=True, settles=True,
    ),
    OpSpec(
        "colossal_lamb_", (*_MOMENTS, *_STEPS), (),
        (_float("lr"), _beta(0), _beta(1), _float("eps"), _float("weight_decay"),
         _bool("adam"), _bool("bias_correction"), *_NORM_SUMS),
        _reference.colossal_lamb_,
        dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, adam=False, bias_correction=True),
        compact=True, settles=True,
    ),
    OpSpec(
        "lion_", (StateList("exp_avgs", "exp_avg"),), (),
        (_float("lr"), _beta(0), _beta(1), _float("weight_decay")),
        _reference.lion_,
        dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1), compact=True,
    ),
    OpSpec(
        "adagrad_", (StateList("sums", "sum", "nonnegative"), *_STEPS), (),
        (_float("lr"), _float("lr_decay"), _float("weight_decay"), _float("eps"), _bool("maximize")),
        _reference.adagrad_,
        dict(lr=1e-2, lr_decay=0.1, weight_decay=0.01, eps=1e-10, maximize=False), compact=True,
    ),
)}
