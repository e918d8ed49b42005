"""Every registered optimizer is complete: its op is declared (fused_optim/specs.py), has a
reference, a schema, a CPU kernel and op-level tests, and the adapters can name its class and
its registry entry. Parametrized by ``list_optimizers()``: a new registry entry is checked
without being listed here."""

import pytest
import torch

import fused_optim
import mmengine_optim  # noqa: F401 - registers every optimizer in mmengine_optim's scope
from fused_optim import _build, _reference
from fused_optim.optimizer import FusedOptimizer
from fused_optim.registry import get_spec, list_optimizers
from fused_optim.specs import SPECS
from mmengine_optim.registry import OPTIMIZERS
from test_ops import SCALARS


def op_spec(name: str):
    """The OpSpec of the op that registry entry ``name``'s class calls."""
    cls = get_spec(name).cls
    assert issubclass(cls, FusedOptimizer), f"{name}: {cls.__name__} is not a FusedOptimizer"
    assert cls.op_name in SPECS, f"{name}: {cls.__name__}.op_name {cls.op_name!r} is not declared in specs.py"
    return SPECS[cls.op_name]


@pytest.mark.parametrize("name", list_optimizers())
def test_the_op_has_a_reference_a_schema_a_cpu_kernel_and_op_tests(name):
    spec = op_spec(name)
    assert spec.reference is getattr(_reference, spec.name)
    _build.load("cpu")
    ops = {spec.name: spec.schemas()}  # the list op and its twin, and the compact twin and its twin
    if spec.compact:
        ops[spec.compact_name] = spec.compact_schemas()
    for op_name, schemas in ops.items():
        for suffix, schema in schemas.items():
            qualified = f"fused_optim::{op_name}{suffix}"
            op = getattr(torch.ops.fused_optim, op_name + suffix).default
            assert op._schema == torch._C.parse_schema(qualified + schema)
            # the list op's kernel is CPU's; the twin is registered for every backend
            key = "CPU" if suffix == "" else "CompositeExplicitAutograd"
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key), f"{qualified} has no {key} kernel"
    assert spec.name in SCALARS  # enrolled in every op-level test of test_ops.py (and CUDA, Tensor lr)


@pytest.mark.parametrize("name", list_optimizers())
def test_the_adapters_can_name_the_class_and_the_entry(name):
    entry = get_spec(name)
    # mmengine: the class under its class name, the entry (class + defaults) under its name
    assert OPTIMIZERS.get(entry.cls.__name__) is entry.cls
    assert OPTIMIZERS.get(entry.name).entry == entry.name
    opt = OPTIMIZERS.get(entry.name)([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert type(opt) is entry.cls and all(opt.defaults[k] == v for k, v in entry.defaults.items())
    # Lightning's CLI resolves a class path: fused_optim.<class name>
    assert getattr(fused_optim, entry.cls.__name__) is entry.cls and entry.cls.__name__ in fused_optim.__all__


@pytest.mark.parametrize("name", list_optimizers())
def test_the_state_an_optimizer_keeps_is_named_in_its_op_spec(name):
    """After a step (with momentum where the group has it, so that SGD keeps a buffer) every
    state key is the torch.optim name of one of the op's state lists."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = fused_optim.create_optimizer(name, [p], lr=0.1)
    if "momentum" in opt.param_groups[0]:
        opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    assert opt.state[p] and set(opt.state[p]) <= {st.state_key for st in op_spec(name).state}


def test_every_declared_op_is_called_by_a_registered_optimizer():
    """No spec without an optimizer (a left-over op nothing can reach)."""
    assert {op_spec(name).name for name in list_optimizers()} == set(SPECS)


def test_the_generated_cpp_header_matches_the_specs():
    """csrc/host/update_ops.h is generated from the specs (fused_optim/cpp_header.py): after an
    edit of specs.py, `python -m fused_optim.cpp_header` must be run, or the C++ kernels would be
    declared and registered with stale argument lists."""
    from fused_optim import cpp_header

    assert (_build.CSRC / cpp_header.HEADER).read_text() == cpp_header.render(), (
        "csrc/host/update_ops.h is out of date: run `python -m fused_optim.cpp_header`")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_declared_kernel_takes_the_schema_arguments_in_order(name):
    """The declaration's parameter names are the schema's argument names, in order (what the
    dispatcher passes the kernel positionally)."""
    from fused_optim import cpp_header

    schema = torch._C.parse_schema(f"fused_optim::{name}{SPECS[name].schemas()['']}")
    declared = [param.rsplit(" ", 1)[1] for param in cpp_header.parameters(SPECS[name])]
    assert declared == [arg.name for arg in schema.arguments]
