"""The window counters the gradient hooks share with Python (``GradientStatistics._counts``, read
at the named positions of fused_optim/adascale.py), with the C++ hooks and with the Python hooks
that replace them where the kernels do not serve the params; and a state dict written in the
format AdaScale has always saved loads."""

import copy

import pytest
import torch

import fused_optim.adascale
from adascale_loops import micro_batch, model_and_groups
from fused_optim import AdaScale
from fused_optim.adascale import HANDLE, LAST_TASK, PASSES, WINDOW_PASSES


def _backward(model, micro: int) -> None:
    x, y = micro_batch(0, micro)
    (((model(x) - y) ** 2).mean() / 3).backward()


@pytest.mark.parametrize("native", [True, False], ids=["cpp_hooks", "python_hooks"])
def test_the_hooks_count_passes_and_end_the_window(native, monkeypatch):
    if not native:
        monkeypatch.setattr(fused_optim.adascale, "_native_hooks_work", lambda params: False)
    model, groups = model_and_groups(False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=3)
    counts = opt._counts
    assert fused_optim.adascale._WINDOW_OWNERS[int(counts[HANDLE])] is opt
    assert (int(counts[PASSES]), int(counts[LAST_TASK]), int(counts[WINDOW_PASSES])) == (0, -1, 3)
    tasks = set()
    for micro in range(3):
        assert opt._pending is None  # the window ends in the pass that completes it, not before
        _backward(model, micro)
        assert int(counts[PASSES]) == micro + 1
        tasks.add(int(counts[LAST_TASK]))
    assert len(tasks) == 3  # each backward pass is its own graph task
    assert opt._pending is not None and opt._pending.passes == 3
    opt.step()
    assert int(counts[PASSES]) == 0 and opt._pending is None
    opt.set_num_gradients_to_accumulate(2)
    assert int(counts[WINDOW_PASSES]) == 2


def test_a_copy_gets_its_own_handle():
    model, groups = model_and_groups(False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    dup = copy.deepcopy(opt)
    assert int(dup._counts[HANDLE]) != int(opt._counts[HANDLE])
    assert fused_optim.adascale._WINDOW_OWNERS[int(dup._counts[HANDLE])] is dup


def test_a_saved_state_dict_with_a_window_in_progress_loads():
    """The ``"adascale"`` entry as AdaScale writes it: the averages as float64 tensors, the window's
    micro-batch sums and passes, scale, smoothing, accumulation count and τ."""
    model, groups = model_and_groups(False)
    opt = AdaScale(torch.optim.SGD(groups, lr=0.1), world_size=1, num_gradients_to_accumulate=2)
    saved = {**torch.optim.SGD(model_and_groups(False)[1], lr=0.1).state_dict(), "adascale": {
        "grad_sqr_avg": torch.tensor([0.5], dtype=torch.float64),
        "grad_var_avg": torch.tensor([2.0], dtype=torch.float64),
        "grad_sqr_avg_biased": torch.tensor([0.25], dtype=torch.float64),
        "grad_sqr_avg_unbias": torch.tensor([0.5], dtype=torch.float64),
        "grad_var_avg_biased": torch.tensor([1.0], dtype=torch.float64),
        "grad_var_avg_unbias": torch.tensor([0.5], dtype=torch.float64),
        "local": torch.tensor([3.0], dtype=torch.float64), "backwards": 1, "scale": 2.0, "smoothing": 0.5,
        "num_gradients_to_accumulate": 2, "scale_invariant_steps": 7.5}}
    opt.load_state_dict(saved)
    assert int(opt._counts[PASSES]) == 1 and int(opt._counts[WINDOW_PASSES]) == 2
    assert opt._local.tolist() == [3.0] and opt.scale_invariant_steps == 7.5
    # var 2, sqr 0.5 at S = 2: gain (2 + 0.5)/(2/2 + 0.5)
    assert opt.gain() == 2.5 / 1.5
    _backward(model, 0)  # the window's second pass ends it
    assert opt._pending is not None and opt._pending.passes == 2
