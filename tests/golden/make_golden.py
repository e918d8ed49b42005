"""Generate the golden trajectories that the tests replay against our optimizers.

Each reference optimizer is run in float64 for 30 steps on a few small params with recorded grads;
the params after every step are saved (one ``.pt`` file per reference, next to this script), in our
constructor's vocabulary, so a test can rebuild the case with our class and compare.

File format (loadable with ``torch.load(path, weights_only=True)``)::

    {"reference": "<library> <version> <file> <class>",
     "cases": [{"id": str, "optimizer": our class name, "defaults": our ctor kwargs,
                "groups": [{"params": [param indices], "options": our per-group overrides}],
                "init": [float64 tensor per param],
                "grads": [[tensor or None per param] per step],
                "expected": [[tensor per param] per step]}]}

``mlbench_sparsified_estimates.pt`` instead holds SparsifiedSGD's estimated-weights averaging:
``{"reference", "cases": [{"id", "D", "k", "params": [[tensor] per t], "estimates": [[tensor] per t]}]}``.
The tensors of one case are views into one flat storage (it keeps the files small): clone before mutating.

``mlbench_fp16_optimizer.pt`` holds mlbench's ``FP16Optimizer`` on a tiny fp16 model (a flat fp32
master, a torch.optim optimizer inside, inf/NaN grads injected at some steps)::

    {"reference", "cases": [{"id", "options": FP16Optimizer kwargs (mlbench's names = ours),
        "step_kwargs": {"multiplier", "denom"}, "inner": {"name": torch.optim class, "kwargs"},
        "init": [fp16 tensor per param], "grads": fp16 [steps, n] (the scaled grads each step()
        read, params flattened in order), "scale": [loss scale after each step],
        "updated": [step()'s result], "masters": fp32 [steps, n], "params": fp16 [steps, n]}]}

The references live in their own venv, outside the repo (nothing here goes into the project's venv).
Reference modules are loaded by file path with their packages' ``__init__`` skipped, so none of their
other dependencies is needed. Setup, from the repo root::

    python3 -m venv /work/golden-venv
    /work/golden-venv/bin/pip install torch==2.13.0          # first; never let pip upgrade it
    /work/golden-venv/bin/pip install numpy                  # mlbench's optim.py imports it
    /work/golden-venv/bin/pip install --no-deps timm==1.0.31 torch-optimizer==0.3.0 mlbench-core==3.0.0
    /work/golden-venv/bin/pip install --no-deps --ignore-requires-python quadra==2.9.0
    /work/golden-venv/bin/pip download --no-deps colossalai==0.5.0 -d /work/golden-src
    tar xzf /work/golden-src/colossalai-0.5.0.tar.gz -C /work/golden-src   # read only, not installed
    /work/golden-venv/bin/python tests/golden/make_golden.py [FILE.pt ...]   # all files, or only those

``COLOSSALAI_SRC`` overrides the unpacked ColossalAI source dir (default /work/golden-src/colossalai-0.5.0).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import types
import zlib
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SITE = Path(sysconfig.get_paths()["purelib"])
COLOSSALAI = Path(os.environ.get("COLOSSALAI_SRC", "/work/golden-src/colossalai-0.5.0"))
STEPS = 30
SHAPES = [(3, 4), (5,), (2, 3, 2), (1,)]
ALL = range(STEPS)  # "at every step", for zero_grad / none_grad


def load(root: Path, dotted: str) -> types.ModuleType:
    """Import one module by file path. Its parent packages are empty stubs (their __init__ never runs)
    whose __path__ still lets the module's relative imports (timm's _helpers, torch_optimizer's types) resolve."""
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            pkg = sys.modules[name] = types.ModuleType(name)
            pkg.__path__ = [str(root.joinpath(*parts[:i]))]
    spec = importlib.util.spec_from_file_location(dotted, root.joinpath(*parts).with_suffix(".py"))
    module = sys.modules[dotted] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# file -> (reference description, our class, reference class loader, our kwarg -> reference kwarg,
#          extra reference ctor kwargs)
REFERENCES = {
    "timm_lamb.pt": ("timm 1.0.31 timm/optim/lamb.py Lamb", "FusedLAMB",
                     lambda: load(SITE, "timm.optim.lamb").Lamb, {}, {}),
    "timm_lars.pt": ("timm 1.0.31 timm/optim/lars.py Lars", "LARS",
                     lambda: load(SITE, "timm.optim.lars").Lars, {"trust_coefficient": "trust_coeff"}, {}),
    "torch_optimizer_lamb.pt": ("torch-optimizer 0.3.0 torch_optimizer/lamb.py Lamb (clamp_value=1e30)", "Lamb",
                                lambda: load(SITE, "torch_optimizer.lamb").Lamb, {"bias_correction": "debias"},
                                {"clamp_value": 1e30}),
    "quadra_lars.pt": ("quadra 2.9.0 quadra/optimizers/lars.py LARS", "LARS",
                       lambda: load(SITE, "quadra.optimizers.lars").LARS, {}, {}),
    "colossalai_lamb.pt": ("colossalai 0.5.0 colossalai/nn/optimizer/lamb.py Lamb", "Lamb",
                           lambda: load(COLOSSALAI, "colossalai.nn.optimizer.lamb").Lamb, {}, {}),
    "colossalai_lars.pt": ("colossalai 0.5.0 colossalai/nn/optimizer/lars.py Lars", "Lars",
                           lambda: load(COLOSSALAI, "colossalai.nn.optimizer.lars").Lars, {}, {}),
    "mlbench_signsgd.pt": ("mlbench-core 3.0.0 mlbench_core/optim/pytorch/optim.py SignSGD", "SignSGD",
                           lambda: load(SITE, "mlbench_core.optim.pytorch.optim").SignSGD, {}, {}),
}

TWO_GROUPS = [[0, 2], [1, 3]]  # param indices of the two groups in *-two-groups cases


def case(id, defaults=None, groups=None, **data):
    """groups: [(param indices, our options)], default one group with everything.
    data: see make_data()."""
    groups = groups or [(list(range(len(data.get("shapes", SHAPES)))), {})]
    return {"id": id, "defaults": defaults or {}, "groups": [{"params": i, "options": o} for i, o in groups],
            "data": data}


# Data helpers spelled out in the table below:
#   zero_init=[i]           param i starts at zeros (zero norm)
#   zero_grad={i: steps}    param i's grad is all zeros at those steps (ALL = every step)
#   none_grad={i: steps}    param i has no grad (None) at those steps
#   spike=t                 every grad x1e3 at step t
#   scales / init_scales    per-param grad / init scales
LATE = [0, 1, 2, 10, 11]  # None-grad steps: this param's first grad comes late, and it skips two more
ZEROS = dict(zero_init=[1], zero_grad={0: [3, 4, 5, 20], 3: ALL})  # a zero-norm param, zero grads
# Several options share a case: ~32 KB a case (float64 data + ~50 B of pickle per tensor), 5 a file.
CASES = {
    "timm_lamb.pt": [  # timm steps per group: never a None grad here
        case("defaults"),  # max_grad_norm=1 clips every step
        case("no-bias-correction-no-grad-averaging-clip-most",  # max_grad_norm=9.5 clips 25 of 30 steps
             dict(lr=0.01, bias_correction=False, grad_averaging=False, betas=[0.8, 0.99], max_grad_norm=9.5)),
        case("no-clip-spike-zero-norm", dict(lr=0.01, max_grad_norm=None, eps=1e-8), spike=12, **ZEROS),
        case("trust-clip-always-adapt-wd0-never-clips",
             dict(lr=0.01, weight_decay=0.0, always_adapt=True, trust_clip=True, max_grad_norm=1e3),
             init_scales=[3.0, 0.1, 1.0, 0.5]),
        case("two-groups", dict(lr=0.01, weight_decay=0.05), groups=[(TWO_GROUPS[0], {}),
             (TWO_GROUPS[1], dict(weight_decay=0.0, lr=0.05, betas=[0.8, 0.99], eps=1e-4))]),
    ],
    "timm_lars.pt": [  # no zero-norm param/grad here: timm still adds the decay there (quadra's file covers it)
        case("two-groups-no-momentum", dict(lr=1.0, weight_decay=0.01), groups=[(TWO_GROUPS[0], {}),
             (TWO_GROUPS[1], dict(weight_decay=0.0, lr=0.05))]),
        case("nesterov-spike", dict(lr=1.0, momentum=0.9, nesterov=True, weight_decay=1e-3, trust_coefficient=0.01),
             spike=12),
        case("dampening-none-grads", dict(lr=1.0, momentum=0.9, dampening=0.5, weight_decay=1e-3, eps=1e-3),
             none_grad={2: LATE}),
        case("trust-clip", dict(lr=0.01, momentum=0.9, weight_decay=0.01, trust_coefficient=0.1, trust_clip=True),
             scales=[1.0, 0.01, 30.0, 0.5]),  # clips params 0, 1, 3; param 2 from step 16 on
        case("always-adapt-wd0", dict(lr=1.0, momentum=0.5, always_adapt=True)),
    ],
    "quadra_lars.pt": [  # trust_coefficient and eps are per optimizer in quadra, not per group
        case("two-groups-no-momentum", dict(lr=1.0, weight_decay=0.01), groups=[(TWO_GROUPS[0], {}),
             (TWO_GROUPS[1], dict(weight_decay=0.0, lr=0.05))]),
        case("momentum-spike", dict(lr=1.0, momentum=0.9, weight_decay=0.01, trust_coefficient=0.01, eps=1e-3),
             spike=12),
        case("nesterov-none-grads", dict(lr=1.0, momentum=0.9, nesterov=True, weight_decay=1e-3),
             none_grad={2: LATE}),
        case("dampening", dict(lr=1.0, momentum=0.9, dampening=0.5, weight_decay=1e-3)),
        case("zero-norm-and-zero-grads", dict(lr=1.0, momentum=0.9, weight_decay=0.01), **ZEROS),
    ],
    "torch_optimizer_lamb.pt": [  # adam and bias_correction (its debias) are per optimizer there
        case("defaults"),
        case("wd-bias-correction", dict(lr=0.01, weight_decay=0.01, bias_correction=True, betas=[0.8, 0.99])),
        case("adam", dict(lr=0.01, weight_decay=0.01, adam=True, bias_correction=True)),
        case("zero-norm-and-zero-grads-spike", dict(lr=0.01, weight_decay=0.01), spike=12, **ZEROS),
        case("two-groups-none-grads", dict(lr=0.01, weight_decay=0.01), none_grad={2: LATE},
             groups=[(TWO_GROUPS[0], {}), (TWO_GROUPS[1], dict(weight_decay=0.0, lr=0.05, eps=1e-4))]),
    ],
    "colossalai_lamb.pt": [
        case("defaults"),
        case("wd-bias-correction", dict(lr=0.01, weight_decay=0.01, bias_correction=True, betas=[0.8, 0.99])),
        case("adam", dict(lr=0.01, weight_decay=0.01, adam=True, bias_correction=True)),
        case("zero-norm-and-zero-grads-spike", dict(lr=0.01, weight_decay=0.01), spike=12, **ZEROS),
        case("two-groups-none-grads", dict(lr=0.01, weight_decay=0.01), none_grad={2: LATE},
             groups=[(TWO_GROUPS[0], {}),
                     (TWO_GROUPS[1], dict(weight_decay=0.0, lr=0.05, bias_correction=True, eps=1e-4))]),
    ],
    "colossalai_lars.pt": [
        case("defaults"),
        case("wd-momentum-zero-norm-and-zero-grads",
             dict(lr=0.1, momentum=0.9, weight_decay=0.01, eeta=0.01, epsilon=1e-3), **ZEROS),
        case("trust-ratio-clamp-50-none-grads",  # params 0 and 2 hit the clamp
             dict(lr=1e-3, momentum=0.5, eeta=1.0, weight_decay=1e-4), scales=[1e-3, 1.0, 1e-3, 0.1],
             none_grad={2: LATE}),
        case("grad-clamp-10-spike", dict(lr=0.1, momentum=0.9, eeta=0.5), scales=[20.0, 1.0, 5.0, 0.5], spike=12),
        case("three-groups-lars-false-wd0", dict(lr=0.1, momentum=0.9, weight_decay=0.01, eeta=0.01),
             groups=[([0], {}), ([1, 3], dict(lars=False, lr=0.05)),
                     ([2], dict(weight_decay=0.0, lr=0.5, momentum=0.5))]),
    ],
    "mlbench_signsgd.pt": [
        case("defaults", dict(lr=0.01)),
        case("wd-momentum-dampening-none-grads", dict(lr=0.01, momentum=0.9, dampening=0.3, weight_decay=0.01),
             none_grad={2: LATE}),
        case("nesterov-spike", dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3), spike=12),
        case("momentum-zero-norm-and-zero-grads", dict(lr=0.01, momentum=0.9),
             zero_init=[1], zero_grad={0: [3, 4, 5, 20], 1: ALL, 3: ALL}),
        case("two-groups", dict(lr=0.01, momentum=0.9, weight_decay=0.01), groups=[(TWO_GROUPS[0], {}),
             (TWO_GROUPS[1], dict(weight_decay=0.0, lr=0.05, momentum=0.5))]),
    ],
}

ESTIMATE_CASES = [dict(id="D20-k3", D=20, k=3), dict(id="D20-k5", D=20, k=5), dict(id="D7-k7", D=7, k=7)]


def make_data(seed, shapes=SHAPES, scales=(1.0, 0.1, 3.0, 0.5), init_scales=(0.5,) * 4,
              zero_init=(), zero_grad=None, none_grad=None, spike=None):
    """Initial params and STEPS steps of grads (float64). A grad is scale * (0.5 * drift + noise),
    with a fixed per-param drift so momentum and the moments build up."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=gen, dtype=torch.float64)  # noqa: E731
    init = [torch.zeros(s, dtype=torch.float64) if i in zero_init else init_scales[i] * randn(s)
            for i, s in enumerate(shapes)]
    drift = [randn(s) for s in shapes]
    grads = []
    for t in range(STEPS):
        step = []
        for i, s in enumerate(shapes):
            g = scales[i] * (0.5 * drift[i] + randn(s)) * (1e3 if t == spike else 1.0)
            if t in (zero_grad or {}).get(i, ()):
                g = torch.zeros(s, dtype=torch.float64)
            step.append(None if t in (none_grad or {}).get(i, ()) else g)
        grads.append(step)
    return init, grads


def run_case(file, c):
    """Run one case through its reference; returns the stored record."""
    _, ours, ref_cls, rename, extra = REFERENCES[file]
    ref_kw = lambda kw: {rename.get(k, k): tuple(v) if k == "betas" else v for k, v in kw.items()}  # noqa: E731
    init, grads = make_data(zlib.crc32(f"{file}/{c['id']}".encode()), **c["data"])
    params = [torch.nn.Parameter(p.clone()) for p in init]
    groups = [{"params": [params[i] for i in g["params"]], **ref_kw(g["options"])} for g in c["groups"]]
    opt = ref_cls()(groups, **ref_kw(c["defaults"]), **extra)
    for group, g in zip(opt.param_groups, groups):  # an option the reference keeps per optimizer would be lost
        assert set(g) <= set(group), f"{file} {c['id']}: {set(g) - set(group)} is not a group option there"
    expected = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()  # fresh clone: some references mutate p.grad
        opt.step()
        expected.append([p.detach().clone() for p in params])
    return {"id": c["id"], "optimizer": ours, "defaults": c["defaults"], "groups": c["groups"],
            "init": init, "grads": grads, "expected": expected}


def estimates_case(c):
    """mlbench SparsifiedSGD.update_estimated_weights(t, k) for t = 0..9 on one (1, D) param."""
    sparsified = load(SITE, "mlbench_core.optim.pytorch.optim").SparsifiedSGD
    gen = torch.Generator().manual_seed(zlib.crc32(c["id"].encode()))
    torch.manual_seed(0)  # its constructor re-initialises the params with the global RNG
    p = torch.nn.Parameter(torch.zeros(1, c["D"], dtype=torch.float64))
    opt = sparsified([p], lr=0.1, sparse_grad_size=c["k"])
    params, estimates = [], []
    for t in range(10):
        value = torch.randn(1, c["D"], generator=gen, dtype=torch.float64)
        p.data.copy_(value)
        opt.update_estimated_weights(t, c["k"])
        params.append([value])
        estimates.append([e.clone() for e in opt.get_estimated_weights()])
    return {**c, "params": params, "estimates": estimates}


# mlbench FP16Optimizer cases: ctor options (world_size=1), step() kwargs, the torch.optim optimizer over the
# flat master, and {step: (param index, value)} grads overwritten after backward_loss (overflow steps).
# Case 1: the scale grows every 2 steps to the max_scale cap (held there), falls on overflows (two in a row at 20, 21).
# Case 2: clips at about half the steps (grad_clip 0.12), average_custom by denom 4, multiplier 2, scale_window 3;
# the scale grows until the fp16 grads overflow by themselves (step 25).
FP16_CASES = [
    dict(id="sgd-momentum-overflows-max-scale", options=dict(init_scale=2048, scale_window=2, max_scale=4096,
                                                             average_world=True),
         step_kwargs={}, inner=dict(name="SGD", kwargs=dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
         bad={6: (0, float("inf")), 13: (3, float("nan")), 20: (1, float("inf")), 21: (2, -float("inf"))}),
    dict(id="sgd-clip-average-custom-multiplier",
         options=dict(grad_clip=0.12, init_scale=1024, scale_window=3, average_world=False, average_custom=True),
         step_kwargs=dict(multiplier=2.0, denom=4.0), inner=dict(name="SGD", kwargs=dict(lr=0.1)),
         bad={9: (0, float("inf"))}),
]


def fp16_optimizer_case(c):
    """STEPS steps of mlbench's FP16Optimizer (flat master) on Linear(5, 4)-Tanh-Linear(4, 3) in fp16: 39
    params, so the flat master's elementwise ops split into vector blocks and a scalar tail the same way
    for AVX2 and AVX-512 (39 mod 32 < 16; see tests/core/test_fp16_optimizer.py)."""
    for dependency in ["utils.pytorch.utils", "aggregation.pytorch.aggregation"]:  # (stubs for their packages)
        load(SITE, f"mlbench_core.{dependency}")
    fp16_optimizer = load(SITE, "mlbench_core.optim.pytorch.fp_optimizers").FP16Optimizer
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).half()
    params = list(model.parameters())
    init = [p.detach().clone() for p in params]
    opt = fp16_optimizer(model, world_size=1, **c["options"])
    opt.set_optimizer(getattr(torch.optim, c["inner"]["name"])([opt.fp32_params], **c["inner"]["kwargs"]))
    gen = torch.Generator().manual_seed(1)
    rows = {"grads": [], "masters": [], "params": []}
    scale, updated = [], []
    for t in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        opt.backward_loss(torch.nn.functional.mse_loss(model(x.half()).float(), y))
        if t in c["bad"]:
            i, value = c["bad"][t]
            params[i].grad.view(-1)[0] = value
        rows["grads"].append(torch.cat([p.grad.reshape(-1) for p in params]))  # (step() replaces p.grad)
        updated.append(opt.step(**c["step_kwargs"]))
        scale.append(float(opt.loss_scaler.loss_scale))
        rows["masters"].append(opt.fp32_params.detach().clone())
        rows["params"].append(torch.cat([p.detach().reshape(-1) for p in params]))
    return {"id": c["id"], "options": c["options"], "step_kwargs": c["step_kwargs"], "inner": c["inner"],
            "init": init, **{k: torch.stack(v) for k, v in rows.items()}, "scale": scale, "updated": updated}


def walk(obj, fn):
    """obj with fn applied to each tensor in it (nested lists and dicts)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, list):
        return [walk(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: walk(v, fn) for k, v in obj.items()}
    return obj


def one_storage(record):
    """The record with every tensor a view into one flat storage: torch.save then writes one storage
    instead of one per tensor (hundreds of tiny storages would make each file ~3x bigger)."""
    tensors = []
    walk(record, tensors.append)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    offset = 0

    def view(t):
        nonlocal offset
        offset += t.numel()
        return flat[offset - t.numel():offset].view(t.shape)

    return walk(record, view)


def main(files):
    """Record the named files (all when none is named)."""
    estimates = "mlbench_sparsified_estimates.pt"
    fp16 = "mlbench_fp16_optimizer.pt"
    for file in files or [*CASES, estimates, fp16]:
        if file in CASES:
            data = {"reference": REFERENCES[file][0], "cases": [one_storage(run_case(file, c)) for c in CASES[file]]}
        elif file == estimates:
            data = {"reference": "mlbench-core 3.0.0 mlbench_core/optim/pytorch/optim.py "
                                 "SparsifiedSGD.update_estimated_weights / get_estimated_weights",
                    "cases": [one_storage(estimates_case(c)) for c in ESTIMATE_CASES]}
        elif file == fp16:
            data = {"reference": "mlbench-core 3.0.0 mlbench_core/optim/pytorch/fp_optimizers.py FP16Optimizer",
                    "cases": [fp16_optimizer_case(c) for c in FP16_CASES]}
        else:
            raise SystemExit(f"make_golden.py: unknown file {file!r}")
        torch.save(data, HERE / file)
    for path in sorted(HERE.glob("*.pt")):
        data = torch.load(path, weights_only=True)
        print(f"{path.name:32} {path.stat().st_size:7d} B  {[c['id'] for c in data['cases']]}")


if __name__ == "__main__":
    main(sys.argv[1:])
