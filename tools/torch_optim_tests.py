"""torch's own optimizer tests (``TestOptimRenewed`` in torch's ``test/test_optim.py``) run on
``fused_optim.SGD`` / ``Adam`` / ``AdamW``, unmodified, in this process, with pytest::

    python tools/torch_optim_tests.py PATH/TO/pytorch/test/test_optim.py [--torch] [pytest options]

torch's test file is not kept in this repository: give the path of a copy from torch's source
tree of the installed version (docs/design.md, "Tests", says which one was run and the result).
Its tests take their optimizers from ``optim_db`` (``torch.testing._internal.common_optimizers``,
shipped in torch's wheel); before the file is imported, that list is replaced by copies of its
``SGD``, ``Adam`` and ``AdamW`` entries whose ``optim_cls`` is ours (``--torch``: torch's own
classes, the baseline). Everything else of an entry (configs, error inputs, flags) stays torch's.
Only the CPU device is instantiated (``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu``), in the dtypes each
test names; the tests that take no entry (they build torch's classes themselves) are deselected,
and so are the file's imports of its sibling test files (scheduler, SWA and differentiable tests
of other classes), which are not needed here.

A test whose entry asks for something this package refuses by design (:data:`REFUSALS`) is
expected to fail, strictly (it fails the run if it passes), and only with that refusal's error:
failing with any other error fails the run. A refusal of ``differentiable=True`` stops a test at
the first config that sets it, so those tests run a second time on a copy of the entry that
states the limit (no ``differentiable`` in its ``supported_impls``; the test ids end in
``_nondifferentiable``): there every other config must pass.

Exit status: pytest's (0 when every case passed or failed only as expected).
"""

from __future__ import annotations

import copy
import os
import re
import sys
import types
import unittest
from dataclasses import dataclass
from pathlib import Path

import pytest

NAMES = ("SGD", "Adam", "AdamW")
STATED = "_nondifferentiable"


@dataclass(frozen=True)
class Refusal:
    """Something the classes refuse by design (docs/design.md says so): the tests it stops, and
    the error it stops them with (type, and a regex its message matches)."""

    reason: str
    error: type[Exception]
    message: str
    tests: tuple[str, ...]


COMPLEX = Refusal("complex params are refused (docs/design.md): the kernels are real; pass torch.view_as_real(p)",
                  ValueError, "does not support complex parameters", ("test_complex", "test_complex_2d"))
SPARSE = Refusal("sparse gradients are refused (docs/design.md): the kernels take dense grads",
                 RuntimeError, "sparse gradient", ("test_rosenbrock_sparse",))
DIFFERENTIABLE = Refusal(
    "differentiable=True is refused (docs/design.md): the kernels update params out of autograd's sight",
    ValueError, "Invalid differentiable value: True",
    ("test_step_is_noop_when_params_have_no_grad", "test_step_is_noop_for_zero_grads",
     "test_grads_are_never_inplaced_into", "test_optimizer_can_be_printed", "test_state_dict_pre_hook",
     "test_state_dict_post_hook", "test_state_dict_pre_post_hook", "test_load_state_dict_pre_hook_and_prepend",
     "test_load_state_dict_post_hook", "test_load_state_dict_pre_post_hook", "test_step_post_hook",
     "test_step_pre_hook", "test_step_all_hooks"))
REFUSALS = (COMPLEX, SPARSE, DIFFERENTIABLE)

# A generated test's name: the test, its @parametrize values, the entry's name, device and dtype
# (test_rosenbrock_sparse_with_lrsched_False_SGD_cpu_float64).
_CASE = re.compile(rf"^(?P<test>test_\w+?)(?P<params>(_(with_lrsched|contiguous|num_dim|is_named_optim\d?|impl)_[A-Za-z0-9]+)*)"
                   rf"_(?P<optim>{'|'.join(NAMES)})(?P<stated>{STATED})?_cpu_[a-z0-9]+$")


@dataclass(frozen=True)
class Case:
    test: str
    optim: str
    stated: bool

    @classmethod
    def parse(cls, name: str) -> Case | None:
        """The case a generated test id names; None for a test that takes no entry."""
        m = _CASE.match(name)
        return m and cls(m["test"], m["optim"], bool(m["stated"]))

    @property
    def refusal(self) -> Refusal | None:
        return next((r for r in REFUSALS if self.test in r.tests), None)


def entries(optim_db, classes):
    """Copies of torch's SGD / Adam / AdamW entries with ``classes[name]`` as ``optim_cls``, then
    the same with the ``differentiable=True`` refusal stated (named ``<name>_nondifferentiable``)."""
    ours = []
    for info in (i for i in optim_db if i.name in NAMES):
        mine = copy.copy(info)
        mine.optim_cls = classes[info.name]
        ours.append(mine)
    stated = []
    for info in ours:
        limited = copy.copy(info)
        limited.__class__ = _stated_class(type(info))
        limited.supported_impls = tuple(x for x in info.supported_impls if x != "differentiable")
        stated.append(limited)
    return ours + stated


def _stated_class(base):
    """``base`` (torch's OptimizerInfo) whose ``name`` (the test ids' part) ends in STATED."""
    return type(f"Stated{base.__name__}", (base,), {"name": property(lambda self: self.optim_cls.__name__ + STATED)})


_REFUSAL = pytest.StashKey[Refusal]()


class Expectations:
    """pytest plugin: keeps the cases of our entries, marks the refused ones as strict xfails,
    and fails an expected failure whose error is not its refusal's."""

    def __init__(self, refusals: bool = True):
        self.refusals = refusals

    def pytest_configure(self, config):
        config.addinivalue_line("markers", "serial: torch's marker for tests that must run alone")

    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            case = Case.parse(item.name)
            wanted = case is not None and (not case.stated or case.refusal is DIFFERENTIABLE)
            (keep if wanted else drop).append(item)
            if wanted and self.refusals and not case.stated and case.refusal:
                refusal = case.refusal
                item.stash[_REFUSAL] = refusal
                item.add_marker(pytest.mark.xfail(strict=True, raises=refusal.error, reason=refusal.reason))
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        refusal = item.stash.get(_REFUSAL, None)
        if refusal and hasattr(report, "wasxfail") and call.excinfo is not None \
                and not re.search(refusal.message, str(call.excinfo.value)):
            report.outcome = "failed"
            del report.wasxfail


def _stub_sibling_test_files():
    """torch's file imports three TestCase classes from its sibling files (``optim/``); they test
    other things (schedulers, SWA, differentiable updates of torch's classes): empty stand-ins."""
    sys.modules.setdefault("optim", types.ModuleType("optim"))
    for module, cls in (("test_lrscheduler", "TestLRScheduler"), ("test_optim", "TestDifferentiableOptimizer"),
                        ("test_swa_utils", "TestSWAUtils")):
        stand_in = types.ModuleType(f"optim.{module}")
        setattr(stand_in, cls, type(cls, (unittest.TestCase,), {}))
        sys.modules[f"optim.{module}"] = stand_in


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    theirs = "--torch" in argv
    argv = [a for a in argv if a != "--torch"]
    if not argv or not Path(argv[0]).is_file():
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        print("give the path of torch's test/test_optim.py first", file=sys.stderr)
        return 2
    os.environ["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "cpu"
    import torch.optim
    import torch.testing._internal.common_optimizers as common_optimizers

    import fused_optim

    source = torch.optim if theirs else fused_optim
    common_optimizers.optim_db[:] = entries(common_optimizers.optim_db, {n: getattr(source, n) for n in NAMES})
    _stub_sibling_test_files()
    path, *options = argv
    return pytest.main([path, "-p", "no:cacheprovider", "-k", "TestOptimRenewed", *options],
                       plugins=[Expectations(refusals=not theirs)])


if __name__ == "__main__":
    sys.exit(main())
