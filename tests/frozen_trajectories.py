"""Frozen CPU trajectories: every registered single-process optimizer, in every format it offers,
stepped a few times on fixed data; the params and a digest of the state after each step.

A refactor that must not change any result (moving code between modules or headers, splitting a
class) is checked against a file recorded before it: ``tests/core/test_frozen_trajectories.py``
compares bit for bit. Record anew only where a change is meant to alter results, and say so in
its commit::

    .venv/bin/python tests/frozen_trajectories.py         # adds what is not recorded yet (a new optimizer)
    .venv/bin/python tests/frozen_trajectories.py --all   # records everything anew

Formats (each recorded where the optimizer accepts it; the file lists the ones that ran):
fp32 fused and reference (``fused=False``), bf16 params with fp32 ``master_weights``, and fp32
params with ``state_dtype`` bf16 and 8-bit. The data: three params (a vector, a matrix, and 300
elements, more than one 256-element 8-bit block), grads from a fixed generator, 4 steps. Kept:
a digest of the params and one of the state after each step, and the params after the last.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from pathlib import Path

import torch

from fused_optim.registry import get_spec, list_optimizers

PATH = Path(__file__).parent / "golden" / "frozen_trajectories.pt"
SHAPES = ((37,), (5, 7), (300,))
STEPS = 4
FORMATS = {
    "fp32": (torch.float32, {}),
    "fp32-reference": (torch.float32, {"fused": False}),
    "bf16-master": (torch.bfloat16, {"master_weights": True}),
    "state-bf16": (torch.float32, {"state_dtype": torch.bfloat16}),
    "state-8bit": (torch.float32, {"state_dtype": "8bit"}),
}


def _kwargs(name: str, extra: dict) -> dict:
    """lr, a weight decay (so its term is exercised) and a seed (sparsified_sgd's draws) where the
    constructor has them."""
    signature = inspect.signature(get_spec(name).cls.__init__).parameters
    kw = {"lr": 1e-2}
    if "weight_decay" in signature:
        kw["weight_decay"] = 1e-2
    if "seed" in signature:
        kw["seed"] = 1234
    return {**kw, **extra}


def digest(items) -> str:
    """SHA-256 over (key, value) pairs: a tensor's dtype, shape and bytes, another value's repr."""
    h = hashlib.sha256()
    for key, value in items:
        h.update(str(key).encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def state_digest(optimizer: torch.optim.Optimizer) -> str:
    """The digest of the state dict's state, in key order."""
    state = optimizer.state_dict()["state"]
    return digest((f"{index}/{key}", entry[key]) for index, entry in sorted(state.items()) for key in sorted(entry))


def run(name: str, fmt: str) -> dict:
    """The trajectory of one optimizer in one format: the params' and the state's digests after each
    step, and the last params."""
    dtype, extra = FORMATS[fmt]
    generator = torch.Generator().manual_seed(1234)
    params = [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in SHAPES]
    optimizer = get_spec(name).cls(params, **_kwargs(name, extra))
    steps = []
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(dtype)
        optimizer.step()
        steps.append({"params": digest(enumerate(params)), "state": state_digest(optimizer)})
    return {"steps": steps, "last_params": [p.detach().clone() for p in params]}


def record(cases: dict) -> dict:
    """``cases`` plus every (optimizer, format) pair it lacks that constructs and steps; the others
    are left out."""
    cases = dict(cases)
    for name in list_optimizers():
        for fmt in FORMATS:
            if f"{name}/{fmt}" in cases:
                continue
            try:
                cases[f"{name}/{fmt}"] = run(name, fmt)
            except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
                print(f"{name}/{fmt}: not offered ({type(exc).__name__}: {str(exc)[:80]})")
    return cases


if __name__ == "__main__":
    torch.set_num_threads(2)
    kept = {} if "--all" in sys.argv[1:] or not PATH.exists() else torch.load(PATH, weights_only=True)["cases"]
    recorded = record(kept)
    torch.save({"torch": str(torch.__version__), "cases": recorded}, PATH)
    print(f"{len(recorded)} trajectories -> {PATH}")
