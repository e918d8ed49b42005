"""Test cases as data: our optimizer + kwargs, the torch.optim counterpart + kwargs, readable ids."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field

import torch

import fused_optim
from fused_optim.registry import get_spec, list_optimizers


@dataclass(frozen=True)
class Case:
    id: str
    ours: type
    ours_kw: dict
    torch_cls: type
    torch_kw: dict = field(default_factory=dict)

    def make_ours(self, params, **extra):
        return self.ours(params, **{**self.ours_kw, **extra})

    def make_torch(self, params, **extra):
        return self.torch_cls(params, **{**self.torch_kw, **extra})


def _sgd_cases() -> list[Case]:
    cases = []
    for momentum, dampening, nesterov, wd, maximize in itertools.product(
        (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.05), (False, True)
    ):
        if nesterov and (momentum == 0 or dampening != 0):
            continue
        kw = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd,
                  maximize=maximize)
        cid = f"sgd-m{momentum}-d{dampening}-nest{int(nesterov)}-wd{wd}-max{int(maximize)}"
        cases.append(Case(cid, fused_optim.FusedSGD, kw, torch.optim.SGD, kw))
    return cases


def _adam_cases() -> list[Case]:
    cases = []
    for decoupled, amsgrad, wd, maximize in itertools.product((False, True), (False, True), (0.0, 0.1),
                                                              (False, True)):
        kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
        cid = f"{'adamw' if decoupled else 'adam'}-ams{int(amsgrad)}-wd{wd}-max{int(maximize)}"
        torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        cases.append(Case(cid, fused_optim.FusedAdam, {**kw, "adam_w_mode": decoupled}, torch_cls, kw))
    return cases


def _colossalai_adam_cases() -> list[Case]:
    """ColossalAI's CPUAdam / HybridAdam (adamw_mode: AdamW, else Adam with L2) == torch.optim."""
    cases = []
    for cls, adamw_mode in itertools.product((fused_optim.CPUAdam, fused_optim.HybridAdam), (True, False)):
        kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
        cid = f"{cls.__name__}-adamw_mode{int(adamw_mode)}"
        cases.append(Case(cid, cls, {**kw, "adamw_mode": adamw_mode},
                          torch.optim.AdamW if adamw_mode else torch.optim.Adam, kw))
    return cases


def _layerwise_cases() -> list[Case]:
    """The layer-wise, sign and sparsified optimizers, each checked against our own reference implementation
    (fused=False; the published references are replayed from golden files in test_golden.py)."""
    fo = fused_optim
    table = [
        ("lamb-default", fo.FusedLAMB, dict(lr=0.01)),
        ("lamb-l2-noclip-nobc-noavg", fo.FusedLAMB, dict(lr=0.01, adam_w_mode=False, max_grad_norm=None,
                                                         bias_correction=False, grad_averaging=False)),
        ("lamb-clip-nvlamb-trustclip", fo.FusedLAMB, dict(lr=0.01, weight_decay=0.0, max_grad_norm=0.5,
                                                          use_nvlamb=True, trust_clip=True)),
        ("colossalai-lamb-bc", fo.Lamb, dict(lr=0.01, weight_decay=0.1, bias_correction=True)),
        ("colossalai-lamb-adam", fo.Lamb, dict(lr=0.01, adam=True)),
        ("lars-m-wd", fo.LARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
        ("lars-damp-wd", fo.LARS, dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=1e-2)),
        ("lars-nesterov-clip-adapt", fo.LARS, dict(lr=0.1, momentum=0.9, nesterov=True, trust_clip=True,
                                                   always_adapt=True)),
        ("colossalai-lars-m", fo.Lars, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
        ("colossalai-lars-nomomentum", fo.Lars, dict(lr=0.1, weight_decay=1e-3, epsilon=1e-9)),
        ("sign-sgd-m-wd", fo.SignSGD, dict(lr=0.01, momentum=0.9, weight_decay=1e-2)),
        ("sign-sgd-nesterov", fo.SignSGD, dict(lr=0.01, momentum=0.9, nesterov=True)),
        ("sparsified-sgd-block", fo.SparsifiedSGD, dict(lr=0.1, weight_decay=0.01, sparse_grad_size=5, seed=3)),
        ("sparsified-sgd-random", fo.SparsifiedSGD, dict(lr=0.1, sparse_grad_size=7, random_sparse=True, seed=3)),
    ]
    return [Case(cid, cls, kw, cls, {**kw, "fused": False}) for cid, cls, kw in table]


SGD_CASES = _sgd_cases()
ADAM_CASES = _adam_cases()
ALL_CASES = SGD_CASES + ADAM_CASES + _colossalai_adam_cases()
# A smaller set that still covers every state tensor of both algorithms.
STATEFUL_CASES = [c for c in ALL_CASES if c.id in (
    "sgd-m0.9-d0.3-nest0-wd0.05-max0", "sgd-m0.9-d0.0-nest1-wd0.05-max0",
    "adam-ams1-wd0.1-max0", "adamw-ams0-wd0.1-max1", "adamw-ams1-wd0.1-max0",
)]


LAYERWISE_CASES = _layerwise_cases()


def _registry_cases() -> list[Case]:
    """Every registry entry as it is created by name (its defaults, lr=0.01), against our reference:
    a newly registered optimizer is compared without being listed here. One that draws random
    numbers (takes a ``seed``) gets the same seed on both sides."""
    cases = []
    for name in list_optimizers():
        entry = get_spec(name)
        kw = {**entry.defaults, "lr": 0.01}
        if "seed" in inspect.signature(entry.cls).parameters:
            kw["seed"] = 0
        cases.append(Case(f"registry-{name}", entry.cls, kw, entry.cls, {**kw, "fused": False}))
    return cases


REGISTRY_CASES = _registry_cases()
# Every algorithm's state, for tests that need no torch.optim counterpart (make_torch is then our
# reference implementation).
STATEFUL_AND_LAYERWISE = STATEFUL_CASES + LAYERWISE_CASES


# Reduced precision. torch 2.13's fused CPU SGD is wrong in fp16/bf16: it never writes the params
# (only the scalar tail past the last full vector: element 4096 of a 4097-element tensor), and its
# momentum buffers differ from torch's own single-tensor SGD from the second step on. So
# SGD is compared over one step with torch's single-tensor SGD (which rounds every intermediate to
# fp16/bf16, hence one step only) and over many steps with our reference; Adam with torch fused.
SGD_LOW_PRECISION_CASES = [c for c in ALL_CASES if c.id == "sgd-m0.0-d0.0-nest0-wd0.05-max1"] + [
    c for c in STATEFUL_CASES if c.id.startswith("sgd")]
ADAM_LOW_PRECISION_CASES = [c for c in STATEFUL_CASES if not c.id.startswith("sgd")]


def ids(cases):
    return [c.id for c in cases]


# Bad hyperparameters: (class, kwargs, regex the ValueError must match).
ERROR_CASES = [
    (fused_optim.FusedSGD, dict(lr=-0.1), r"Invalid learning rate: -0\.1"),
    (fused_optim.FusedSGD, dict(lr=0.1, momentum=-1), r"Invalid momentum value: -1"),
    (fused_optim.FusedSGD, dict(lr=0.1, weight_decay=-1e-4), r"Invalid weight_decay value"),
    (fused_optim.FusedSGD, dict(lr=0.1, dampening=-0.5), r"Invalid dampening value"),
    (fused_optim.FusedSGD, dict(lr=0.1, nesterov=True), r"Invalid nesterov.*momentum > 0"),
    (fused_optim.FusedSGD, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), r"Invalid nesterov.*dampening = 0"),
    (fused_optim.FusedSGD, dict(lr=0.1, fused="yes"), r"Invalid fused value"),
    (fused_optim.FusedAdam, dict(lr=-1e-3), r"Invalid learning rate: -0\.001"),
    (fused_optim.FusedAdam, dict(betas=(1.0, 0.999)), r"Invalid beta parameter at index 0: 1\.0"),
    (fused_optim.FusedAdam, dict(betas=(0.9, -0.1)), r"Invalid beta parameter at index 1: -0\.1"),
    (fused_optim.FusedAdam, dict(betas=0.9), r"Invalid betas: 0\.9 \(need \(beta1, beta2\)\)"),
    (fused_optim.Lamb, dict(betas=0.9), r"Invalid betas: 0\.9"),
    (fused_optim.FusedAdam, dict(eps=-1e-8), r"Invalid epsilon value"),
    (fused_optim.FusedAdam, dict(weight_decay=-0.1), r"Invalid weight_decay value"),
    (fused_optim.FusedAdam, dict(adam_w_mode=True, decoupled_weight_decay=False), r"decoupled_weight_decay.*contradicts"),
    (fused_optim.FusedLAMB, dict(adam_w_mode=False, decoupled_weight_decay=True),
     r"decoupled_weight_decay.*contradicts"),
    (fused_optim.FusedLAMB, dict(decoupled_weight_decay="no"), r"decoupled_weight_decay"),
    (fused_optim.FusedLAMB, dict(max_grad_norm=-1.0), r"Invalid max_grad_norm: -1\.0"),
    (fused_optim.FusedLAMB, dict(amsgrad=True), r"Invalid amsgrad value.*no AMSGrad"),
    (fused_optim.FusedLAMB, dict(betas=(0.9, 1.5)), r"Invalid beta parameter at index 1"),
    (fused_optim.FusedLAMB, dict(betas=0.9), r"Invalid betas: 0\.9"),
    (fused_optim.FusedLAMB, dict(lr=-1.0), r"Invalid learning rate"),
    (fused_optim.Lamb, dict(eps=-1.0), r"Invalid epsilon value"),
    (fused_optim.LARS, dict(lr=0.1, trust_coefficient=-1.0), r"Invalid trust_coefficient value"),
    (fused_optim.LARS, dict(lr=0.1, nesterov=True), r"Invalid nesterov.*momentum > 0"),
    (fused_optim.LARS, dict(lr=0.1, eps=-1.0), r"Invalid epsilon value"),
    (fused_optim.Lars, dict(eeta=-1.0), r"Invalid eeta value"),
    (fused_optim.Lars, dict(momentum=-0.9), r"Invalid momentum value"),
    (fused_optim.SignSGD, dict(lr=0.1, momentum=0.9, dampening=0.5, nesterov=True), r"Invalid nesterov.*dampening = 0"),
    (fused_optim.SignSGD, dict(lr=-0.1), r"Invalid learning rate"),
    (fused_optim.Lion, dict(lr=-1e-4), r"Invalid learning rate: -0\.0001"),
    (fused_optim.Lion, dict(betas=(1.0, 0.99)), r"Invalid beta parameter at index 0: 1\.0"),
    (fused_optim.Lion, dict(betas=(0.9, -0.1)), r"Invalid beta parameter at index 1: -0\.1"),
    (fused_optim.Lion, dict(betas=0.9), r"Invalid betas: 0\.9 \(need \(beta1, beta2\)\)"),
    (fused_optim.Lion, dict(weight_decay=-1.0), r"Invalid weight_decay value: -1\.0"),
]
