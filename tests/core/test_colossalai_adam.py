"""ColossalAI's CPUAdam / HybridAdam beyond their equality with torch.optim (test_against_torch):
``step(div_scale=...)``, the state in memory-mapped files (``nvme_offload_fraction``) with save,
resume and ``weights_only`` loads, ColossalAI's int step counters, and the mmengine drop-in
(``ColossalAIOptimWrapper`` and the seven optimizer names its docstring lists)."""

import copy
import gc
import inspect
import io
import warnings

import numpy as np
import pytest
import torch

import fused_optim
from mmengine_optim import ColossalAIOptimWrapper
from mmengine_optim.colossalai_wrapper import COLOSSALAI_OPTIMIZERS
from mmengine_optim.registry import OPTIM_WRAPPERS, OPTIMIZERS
from utils import params_of


def _params(sizes=(7, 130, 1, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]


def _grads(step, params, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt, steps, start=0, scale=1.0, **step_kw):
    for step in range(start, start + steps):
        for p, g in zip(params_of(opt), _grads(step, params_of(opt))):
            p.grad = g * scale
        opt.step(**step_kw)


def _same(a, b):
    """Bitwise: the same kernels on the same values (offloading and div_scale by a power of two
    change no arithmetic)."""
    for p, q in zip(params_of(a), params_of(b)):
        assert torch.equal(p, q)
        assert a.state[p].keys() == b.state[q].keys()
        for key in a.state[p]:
            assert torch.equal(a.state[p][key], b.state[q][key]), key


@pytest.mark.parametrize("cls", [fused_optim.CPUAdam, fused_optim.HybridAdam])
def test_div_scale_divides_the_grads(cls):
    """ColossalAI's loss-scale divisor: grads 8·g with div_scale=8 step exactly as g (÷8 is exact)."""
    scaled, plain = cls(_params(), lr=0.01, weight_decay=0.1), cls(_params(), lr=0.01, weight_decay=0.1)
    _run(scaled, 5, scale=8.0, div_scale=8)
    _run(plain, 5)
    _same(scaled, plain)


def test_div_scale_combines_with_grad_scalers_scale():
    combined, plain = fused_optim.CPUAdam(_params(), lr=0.01), fused_optim.CPUAdam(_params(), lr=0.01)
    combined.grad_scale = torch.tensor(2.0)  # what GradScaler hands a step
    _run(combined, 3, scale=8.0, div_scale=4)
    _run(plain, 3)
    _same(combined, plain)


@pytest.mark.parametrize("cls", [fused_optim.CPUAdam, fused_optim.HybridAdam])
def test_div_scale_leaves_the_grads_and_grad_scale_unscales_them(cls):
    """ColossalAI's kernels divide a register copy of each grad by div_scale: ``p.grad`` is as it
    was after ``step(div_scale=d)``. Under GradScaler too, div_scale is never taken out of the
    grads written back: they end as g/s, what GradScaler's unscale_ makes of them (s = 2 and
    d = 3 here: g·(1/2) is exact, and no division by 3 may show)."""
    opt = cls(_params(), lr=0.01)
    _run(opt, 1)  # (state made: the steps below take the plan's fast path)
    grads = _grads(1, params_of(opt))
    for p, g in zip(params_of(opt), grads):
        p.grad = g.clone()
    opt.step(div_scale=3)
    assert all(torch.equal(p.grad, g) for p, g in zip(params_of(opt), grads))
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(0.0)
    opt.step(div_scale=3)
    assert all(torch.equal(p.grad, g * 0.5) for p, g in zip(params_of(opt), grads))


@pytest.mark.parametrize("bad", [0, -2, float("nan"), float("inf"), "8", None, True])
def test_a_bad_div_scale_is_refused_and_changes_nothing(bad):
    opt = fused_optim.CPUAdam(_params(), lr=0.01)
    _run(opt, 2)
    before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params_of(opt)]
    with pytest.raises(ValueError, match=r"Invalid div_scale value: .*a finite number > 0, or -1 for none"):
        opt.step(div_scale=bad)
    assert all(torch.equal(p, q) for p, q in zip(params_of(opt), before[1]))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], before[0]["state"][i][k]) for i in after for k in after[i])


def _mapped_file(t: torch.Tensor):
    return getattr(t.untyped_storage(), "filename", None)


def test_offloaded_state_lives_in_files_and_steps_bitwise_as_in_memory(tmp_path):
    """nvme_offload_fraction=0.5 of 202 elements: the params that fit in 101, in group order."""
    offloaded = fused_optim.CPUAdam(_params(), lr=0.01, weight_decay=0.1, nvme_offload_fraction=0.5,
                                    nvme_offload_dir=str(tmp_path))
    in_memory = fused_optim.CPUAdam(_params(), lr=0.01, weight_decay=0.1)
    _run(offloaded, 6)
    _run(in_memory, 6)
    _same(offloaded, in_memory)
    params = params_of(offloaded)
    # budget floor(0.5 · 202) = 101: param 0 (7) fits, param 1 (130) does not, 2 (1) and 3 (64) do
    assert [bool(offloaded.state_files.files_of(p)) for p in params] == [True, False, True, True]
    for p in params:
        files = offloaded.state_files.files_of(p)
        for key, path in zip(("exp_avg", "exp_avg_sq"), files):
            assert path.parent.parent == tmp_path and _mapped_file(offloaded.state[p][key]) == str(path)
            assert np.array_equal(np.fromfile(path, dtype=np.float32), offloaded.state[p][key].numpy())
        if not files:
            assert _mapped_file(offloaded.state[p]["exp_avg"]) is None


def test_offloaded_state_saves_resumes_exactly_and_loads_weights_only(tmp_path):
    kw = dict(lr=0.01, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path))
    straight = fused_optim.CPUAdam(_params(), **kw)
    _run(straight, 8)
    first = fused_optim.CPUAdam(_params(), **kw)
    _run(first, 4)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params_of(first)], "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = fused_optim.CPUAdam([torch.nn.Parameter(p.clone()) for p in checkpoint["params"]], **kw)
    resumed.load_state_dict(checkpoint["optimizer"])
    _run(resumed, 4, start=4)
    _same(resumed, straight)
    p0 = params_of(resumed)[0]
    assert _mapped_file(resumed.state[p0]["exp_avg"]) == str(resumed.state_files.files_of(p0)[0])


def test_the_offload_folder_goes_with_the_optimizer(tmp_path):
    opt = fused_optim.CPUAdam(_params(), nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    _run(opt, 1)
    folder = opt.state_files.directory
    assert folder.parent == tmp_path and len(list(folder.glob("*.bin"))) == 8
    copy_ = copy.deepcopy(opt)  # a copy gets files of its own
    _run(copy_, 1)
    assert copy_.state_files.directory not in (None, folder) and len(list(copy_.state_files.directory.glob("*.bin"))) == 8
    del opt
    gc.collect()
    assert not folder.exists()


@pytest.mark.parametrize("kw, pattern", [
    (dict(nvme_offload_fraction=1.5), r"Invalid nvme_offload_fraction value: 1.5 \(a fraction .* in \[0, 1\]"),
    (dict(nvme_offload_fraction="half"), r"Invalid nvme_offload_fraction value: 'half'"),
    (dict(nvme_offload_fraction=0.5, nvme_offload_dir=3), r"Invalid nvme_offload_dir value: 3 \(a folder path"),
    (dict(adamw_mode="yes"), r"adamw_mode"),
])
def test_bad_offload_arguments_name_the_parameter(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        fused_optim.CPUAdam(_params(), **kw)


def test_an_unwritable_offload_folder_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"Invalid nvme_offload_dir value: .*cannot create a folder there"):
        fused_optim.CPUAdam(_params(), nvme_offload_fraction=0.5, nvme_offload_dir=str(blocker / "sub"))


def test_a_colossalai_state_dict_with_int_steps_loads():
    """ColossalAI's CPUAdam keeps ``step`` as an int; our counters are 0-dim tensors."""
    ours = fused_optim.CPUAdam(_params(), lr=0.01)
    _run(ours, 3)
    state = copy.deepcopy(ours.state_dict())
    for s in state["state"].values():
        s["step"] = int(s["step"].item())
    loaded = fused_optim.HybridAdam([torch.nn.Parameter(p.detach().clone()) for p in params_of(ours)], lr=0.01)
    loaded.load_state_dict(state)
    _run(ours, 2, start=3)
    _run(loaded, 2, start=3)
    _same(loaded, ours)


def test_the_seven_colossalai_names_resolve_in_our_scope_with_colossalai_signatures():
    """mmengine's ColossalAIOptimWrapper list; the first parameter as ColossalAI names it (mmengine
    fills it with the model's params by name)."""
    first = {"CPUAdam": "model_params", "HybridAdam": "model_params"}
    for name in COLOSSALAI_OPTIMIZERS:
        cls = OPTIMIZERS.get(name)
        assert cls is getattr(fused_optim, name)
        assert next(iter(inspect.signature(cls).parameters)) == first.get(name, "params")
    assert OPTIM_WRAPPERS.get("ColossalAIOptimWrapper") is ColossalAIOptimWrapper


def test_colossalai_wrapper_ignores_a_booster_with_one_warning_and_accumulates():
    model = torch.nn.Linear(4, 2)
    opt = fused_optim.CPUAdam(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"the booster \(object\) is ignored"):
        wrapper = ColossalAIOptimWrapper(opt, booster=object(), accumulative_counts=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = [p.detach().clone() for p in model.parameters()]
        wrapper.update_params(model(torch.ones(3, 4)).sum())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # mid-window: no step
        wrapper.update_params(model(torch.ones(3, 4)).sum())
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))

