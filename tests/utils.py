"""Shared helpers: the odd-shaped param layout every comparison runs on, and comparisons."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import subprocess
from pathlib import Path

import torch

from fused_optim import _build
from fused_optim.registry import get_spec

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GOLDEN = TESTS / "golden"  # recorded trajectories of the references (golden/make_golden.py)
WORKERS = TESTS / "workers"  # the scripts the multi-process tests start, one process per rank

SMALL = 300  # many small tensors in one group


@functools.cache
def cpu_kernels_fuse_multiply_adds() -> bool:
    """Whether the CPU kernels are compiled for FMA (every CPU with AVX2 has it): then their x*y + z
    round once, as the CUDA code's; without it (x86-64 before AVX2) at::vec rounds the product and
    the sum. Asks the compiler for its predefined macros under the build's flags."""
    out = subprocess.run(["c++", *_build.CFLAGS, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                         text=True, check=True, timeout=120)
    return "#define __FMA__ 1" in out.stdout.splitlines()


def make_groups(dtype=torch.float32, seed=0, small=SMALL) -> list[dict]:
    """Param groups with the shapes that break multi-tensor code: a 1-element and a 4097-element
    tensor, a (33, 65) matrix, ``small`` (300) small tensors in a second group with its own lr, an
    empty group, and a param that never gets a grad. Returns groups of plain tensors (wrap per
    optimizer)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    small = [rnd(int(n)) for n in torch.randint(1, 70, (small,), generator=g)]
    return [
        {"params": [rnd(1), rnd(4097), rnd(33, 65), rnd(17)]},
        {"params": small, "lr_scale": 0.5},
        {"params": []},
    ]


def clone_groups(groups, lr=None) -> list[dict]:
    """Fresh nn.Parameters for each optimizer under test; 'lr_scale' becomes a per-group lr."""
    out = []
    for grp in groups:
        new = {"params": [torch.nn.Parameter(t.clone()) for t in grp["params"]]}
        if lr is not None and "lr_scale" in grp:
            new["lr"] = lr * grp["lr_scale"]
        out.append(new)
    return out


def twin_groups(case, dtype=torch.float32):
    """Two independent copies of the make_groups() layout, with the case's lr per group."""
    groups = make_groups(dtype)
    lr = case.ours_kw["lr"]
    return clone_groups(groups, lr), clone_groups(groups, lr)


def set_grads(groups_a, groups_b, step, seed=1, late=True):
    """Same random grads on both param sets. The last param of group 0 never gets one, and (with
    ``late``) the first param of the small group gets its first grad only at step 5."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    for ga, gb in zip(groups_a, groups_b):
        for i, (a, b) in enumerate(zip(ga["params"], gb["params"])):
            skip = (ga is groups_a[0] and i == len(ga["params"]) - 1) or (late and ga is groups_a[1] and i == 0 and step < 5)
            grad = None if skip else torch.randn(a.shape, generator=g).to(a.dtype)
            a.grad = None if grad is None else grad.clone()
            b.grad = None if grad is None else grad.clone()


def params_of(opt) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def assert_rel_close(actual, expected, rtol, what=""):
    """max|a − e| ≤ rtol · max(max|e|, 1): relative to the tensor's scale, not element by element
    (an element near zero has no meaningful relative error at float precision)."""
    assert_pairs_close([what], [actual], [expected], rtol)


def assert_pairs_close(names, actual, expected, rtol):
    """:func:`assert_rel_close` for each pair (named by ``names``), in one batch of tensor ops."""
    lengths = torch.tensor([e.numel() for e in expected])
    assert [a.numel() for a in actual] == lengths.tolist(), f"{names}: sizes differ"
    # on the CPU: a GPU run's tensors are compared with the CPU kernels'
    a, e = (torch.cat([t.detach().reshape(-1).cpu() for t in ts]).double() for ts in (actual, expected))
    # per tensor: max|a − e| and max|e| (-inf for an empty tensor: no error, scale 1)
    err = torch.segment_reduce((a - e).abs(), "max", lengths=lengths, unsafe=True)
    scale = torch.segment_reduce(e.abs(), "max", lengths=lengths, unsafe=True).clamp(min=1.0)
    bad = (~(err <= rtol * scale)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        raise AssertionError(f"{names[i]}: max abs error {err[i]:.3e} > {rtol:.1e} * {scale[i]:.3e}")


def assert_state_close(ours, theirs, rtol, label=""):
    """Params and every state tensor, param by param, with torch's state names; each pair as
    :func:`assert_rel_close` (in one batch: this runs every step of every test)."""
    names, actual, expected = [], [], []
    for i, (p, q) in enumerate(zip(params_of(ours), params_of(theirs))):
        names.append(f"{label} param {i}")
        actual.append(p.detach())
        expected.append(q.detach())
        s_ours, s_theirs = ours.state.get(p, {}), theirs.state.get(q, {})
        keys = {k for k, v in s_theirs.items() if isinstance(v, torch.Tensor)}
        assert keys == {k for k, v in s_ours.items() if isinstance(v, torch.Tensor)}, f"{label} state keys of param {i}"
        for k in sorted(keys):
            names.append(f"{label} state {k} of param {i}")
            actual.append(s_ours[k])
            expected.append(s_theirs[k])
    assert_pairs_close(names, actual, expected, rtol)


def optimizer_kwargs(name: str) -> dict:
    """Hyperparameters that switch registry entry ``name``'s math on, for those its class's
    constructor takes (momentum, weight decay: with it LARS and LAMB use trust ratios; a seed:
    two optimizers then draw the same coordinates)."""
    accepted = inspect.signature(get_spec(name).cls).parameters
    wanted = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01, "seed": 0}
    return {k: v for k, v in wanted.items() if k in accepted}


def compiled_step_matches_eager(cls, kw: dict, params: list, backend: str = "inductor",
                                context=contextlib.nullcontext) -> None:
    """``torch.compile(opt.step, fullgraph=True)`` of ``cls(**kw)`` over copies of ``params`` steps
    as the eager optimizer does for 3 steps (grads k + 1); the state is created inside the graph
    on the first compiled step. ``context``: where the steps run (the CUDA emulation, say)."""
    torch._dynamo.reset()
    comp = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_e, opt_c = cls(params, fused=True, **kw), cls(comp, fused=True, **kw)
    step = torch.compile(opt_c.step, fullgraph=True, backend=backend)
    with context():
        for k in range(3):
            for a, b in zip(params, comp):
                a.grad = torch.full_like(a, k + 1.0)
                b.grad = a.grad.clone()
            opt_e.step()
            step()
    for a, b in zip(params, comp):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
