"""tools/torch_optim_tests.py, the runner of torch's own optimizer tests on our SGD / Adam / AdamW.

torch's test file is not kept here, so the runner is checked on a stand-in written below in the
shape of torch's (``@optims(optim_db)`` tests of a ``TestOptimRenewed`` case, instantiated per
device): which tests it keeps, which it expects to fail, and that an expected failure with
another error, or one that passes, fails the run. The refusals it expects are checked against
the classes themselves, so the table cannot drift from the errors they raise.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn import Parameter

pytest.importorskip("expecttest", reason="torch.testing._internal imports expecttest: pip install 'fused-optim[test]'")
from torch.testing._internal.common_optimizers import optim_db  # noqa: E402

import fused_optim  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "torch_optim_tests.py"


@functools.cache
def tool():
    """tools/torch_optim_tests.py imported by path (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("torch_optim_tests", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("test_id, case", [
    ("test_state_dict_pre_hook_SGD_cpu_float32", ("test_state_dict_pre_hook", "SGD", False)),
    ("test_complex_2d_AdamW_cpu_complex64", ("test_complex_2d", "AdamW", False)),
    ("test_rosenbrock_sparse_with_lrsched_False_SGD_cpu_float64", ("test_rosenbrock_sparse", "SGD", False)),
    ("test_state_dict_deterministic_is_named_optim0_True_is_named_optim1_False_Adam_cpu_float32",
     ("test_state_dict_deterministic", "Adam", False)),
    ("test_forloop_goes_right_direction_contiguous_True_with_lrsched_False_AdamW_cpu_float32",
     ("test_forloop_goes_right_direction", "AdamW", False)),
    ("test_step_pre_hook_Adam_nondifferentiable_cpu_float32", ("test_step_pre_hook", "Adam", True)),
    ("test_adamw_serialization_cpu", None),
    ("test_state_dict_pre_hook_RMSprop_cpu_float32", None),
])
def test_a_test_id_names_its_test_entry_and_variant(test_id, case):
    parsed = tool().Case.parse(test_id)
    assert (parsed and (parsed.test, parsed.optim, parsed.stated)) == case


def test_entries_are_torchs_with_our_classes_then_with_the_differentiable_refusal_stated():
    theirs = {i.name: i for i in optim_db if i.name in ("SGD", "Adam", "AdamW")}
    before = [(i.name, i.optim_cls, i.supported_impls) for i in optim_db]
    made = tool().entries(optim_db, {n: getattr(fused_optim, n) for n in theirs})
    assert [i.name for i in made] == ["Adam", "AdamW", "SGD",
                                      "Adam_nondifferentiable", "AdamW_nondifferentiable", "SGD_nondifferentiable"]
    for info in made:
        name = info.optim_cls.__name__
        assert info.optim_cls is getattr(fused_optim, name)
        torchs = theirs[name]
        assert info.optim_inputs_func is torchs.optim_inputs_func
        assert (info.supports_complex, info.supports_sparse) == (torchs.supports_complex, torchs.supports_sparse)
        expected_impls = torchs.supported_impls if info.name == name else \
            tuple(x for x in torchs.supported_impls if x != "differentiable")
        assert info.supported_impls == expected_impls and "differentiable" in torchs.supported_impls
    assert [(i.name, i.optim_cls, i.supported_impls) for i in optim_db] == before  # torch's list untouched


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_each_expected_refusal_is_the_error_our_class_raises(name):
    t, cls = tool(), getattr(fused_optim, name)
    with pytest.raises(t.COMPLEX.error, match=t.COMPLEX.message):
        cls([torch.zeros(2, dtype=torch.complex64, requires_grad=True)])
    with pytest.raises(t.DIFFERENTIABLE.error, match=t.DIFFERENTIABLE.message):
        cls([Parameter(torch.zeros(2))], differentiable=True)
    p = Parameter(torch.zeros(2))
    opt = cls([p])
    p.grad = torch.ones(2).to_sparse()
    with pytest.raises(t.SPARSE.error, match=t.SPARSE.message):
        opt.step()


# A stand-in for torch's test file: each test's name is one of torch's, its body what the case needs.
STAND_IN = '''
import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_optimizers import (
    _get_optim_inputs_including_global_cliquey_kwargs, optim_db, optims)
from torch.testing._internal.common_utils import TestCase


def construct_every_config(device, dtype, optim_info):
    for config in _get_optim_inputs_including_global_cliquey_kwargs(device, dtype, optim_info):
        optim_info.optim_cls([torch.zeros(2, device=device, requires_grad=True)], **config.kwargs)


class TestOptimRenewed(TestCase):
    @optims([o for o in optim_db if o.supports_complex], dtypes=[torch.complex64])
    def test_complex(self, device, dtype, optim_info):  # refused: an expected failure
        optim_info.optim_cls([torch.zeros(2, device=device, dtype=dtype, requires_grad=True)])

    @optims(optim_db, dtypes=[torch.float32])
    def test_state_dict_pre_hook(self, device, dtype, optim_info):  # stopped by differentiable=True
        construct_every_config(device, dtype, optim_info)

    @optims(optim_db, dtypes=[torch.float32])
    def test_step_pre_hook(self, device, dtype, optim_info):  # listed, but fails otherwise
        raise ValueError("a failure that is no refusal")

    @optims(optim_db, dtypes=[torch.float32])
    def test_optimizer_can_be_printed(self, device, dtype, optim_info):  # listed, but passes
        repr(optim_info.optim_cls([torch.zeros(2, requires_grad=True)]))

    @optims(optim_db, dtypes=[torch.float32])
    def test_forloop_goes_right_direction(self, device, dtype, optim_info):
        assert device == "cpu" and optim_info.optim_cls.__module__.startswith(CLASSES), optim_info.optim_cls

    def test_adamw_serialization(self, device):  # takes no entry: deselected
        raise AssertionError("ran a test that takes no entry")


instantiate_device_type_tests(TestOptimRenewed, globals())
'''


def _outcomes(tmp_path, *options):
    """{test id: outcome} of the runner on the stand-in (``-rA``'s summary), and its exit code."""
    path = tmp_path / "test_optim.py"
    path.write_text(STAND_IN.replace("CLASSES", repr("torch.optim" if "--torch" in options else "fused_optim")))
    out = subprocess.run([sys.executable, str(TOOL), str(path), "-q", "-rA", "-W", "ignore", *options],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    found = dict(reversed(m.groups()) for m in re.finditer(r"^(PASSED|FAILED|XFAIL|XPASS|SKIPPED) \S*::(\w+)",
                                                            out.stdout, re.M))
    return found, out.returncode, out.stdout[-3000:]


@pytest.mark.slow
def test_the_runner_expects_exactly_the_refusals_and_fails_on_anything_else(tmp_path):
    outcomes, code, log = _outcomes(tmp_path)
    expected = {}
    for name in ("SGD", "Adam", "AdamW"):
        expected |= {f"test_complex_{name}_cpu_complex64": "XFAIL",
                     f"test_state_dict_pre_hook_{name}_cpu_float32": "XFAIL",
                     f"test_state_dict_pre_hook_{name}_nondifferentiable_cpu_float32": "PASSED",
                     f"test_step_pre_hook_{name}_cpu_float32": "FAILED",
                     f"test_step_pre_hook_{name}_nondifferentiable_cpu_float32": "FAILED",
                     f"test_optimizer_can_be_printed_{name}_cpu_float32": "FAILED",  # XPASS(strict)
                     f"test_optimizer_can_be_printed_{name}_nondifferentiable_cpu_float32": "PASSED",
                     f"test_forloop_goes_right_direction_{name}_cpu_float32": "PASSED"}
    assert outcomes == expected, log
    assert code == 1


@pytest.mark.slow
def test_the_baseline_runs_torchs_classes_with_nothing_expected_to_fail(tmp_path):
    outcomes, code, log = _outcomes(tmp_path, "--torch")
    assert set(outcomes.values()) == {"PASSED", "FAILED"}, log
    assert {t for t, o in outcomes.items() if o == "FAILED"} == {
        f"test_step_pre_hook_{n}{v}_cpu_float32" for n in ("SGD", "Adam", "AdamW") for v in ("", "_nondifferentiable")}
    assert len(outcomes) == 8 * 3 and code == 1
