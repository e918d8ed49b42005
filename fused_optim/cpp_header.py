"""The C++ side of the op specs: ``csrc/host/update_ops.h``, generated from
:data:`fused_optim.specs.SPECS` so that C++ never spells an op's argument list by hand.

The header declares, for every update op ``<name>_``, its CPU kernel ``<name>_cpu`` (defined,
and registered with its bucket twin, in its file of ``csrc/cpu``) with the schema's arguments in
the schema's order, and the X-macro ``FUSED_OPTIM_UPDATE_OPS(X)`` that calls ``X(<name>)`` for
every op, from which ``csrc/cuda/binding.cpp`` registers its ``<name>_cuda`` kernels.
Registration checks each kernel's C++ signature against the schema, so loading a library whose
kernel takes other arguments fails naming the op; a CPU definition that differs from its
declaration does not compile (its registration names an overloaded function).

The header is generated into the source tree (and shipped) rather than at build time, so every
build — the JIT ones, the nvcc compile check, a reader's editor — sees the same file;
``tests/kernels/test_specs.py`` fails when it is out of date. Regenerate after editing a spec::

    python -m fused_optim.cpp_header
"""

from __future__ import annotations

import re
from pathlib import Path

from .spec import OpSpec
from .specs import SPECS

HEADER = Path("host") / "update_ops.h"  # relative to the kernel sources' root (_build.CSRC)

# Schema type -> C++ parameter type of the kernel function (what the dispatcher passes).
_CPP_TYPES = {
    "Tensor[]": "at::TensorList",
    "bool[]": "const c10::List<bool>&",
    "float": "double",
    "int": "int64_t",
    "int[]": "c10::IntArrayRef",
    "bool": "bool",
    "Tensor?": "const std::optional<at::Tensor>&",
    "Generator?": "const std::optional<at::Generator>&",
}


def _cpp_type(schema_type: str) -> str:
    plain = re.sub(r"\([a-z]!?\)", "", schema_type)  # Tensor(a!)[] -> Tensor[]
    try:
        return _CPP_TYPES[plain]
    except KeyError:
        raise ValueError(f"schema type {schema_type!r} has no C++ kernel type; add it to _CPP_TYPES") from None


def parameters(spec: OpSpec, schema: str | None = None) -> list[str]:
    """The kernel function's parameters (``type name``), in the list op's (or ``schema``'s) order."""
    arguments, _, _ = (schema or spec.schemas()[""]).rpartition(" -> ")
    inside = arguments[1:-1]
    params = []
    for arg in inside.split(", "):
        if arg == "*":
            continue
        type_, name = arg.split(" ")
        params.append(f"{_cpp_type(type_)} {name.split('=')[0]}")
    return params


def _declaration(spec: OpSpec, suffix: str, compact: bool = False) -> str:
    head = f"void {spec.compact_name if compact else spec.name}{suffix}("
    params = parameters(spec, spec.compact_schemas()[""] if compact else None)
    lines, line = [], head
    for i, param in enumerate(params):
        piece = param + (", " if i + 1 < len(params) else ");")
        if len(line) + len(piece.rstrip()) > 118:
            lines.append(line.rstrip())
            line = " " * len(head)
        line += piece
    lines.append(line)
    return "\n".join(lines)


def render(specs: dict[str, OpSpec] = SPECS) -> str:
    names = " \\\n".join(f"  X({name[:-1]})" for name in specs)
    compact = [spec for spec in specs.values() if spec.compact]
    compact_names = " \\\n".join(f"  X({spec.name[:-1]})" for spec in compact)
    declarations = "\n".join([*(_declaration(spec, "cpu") for spec in specs.values()),
                              *(_declaration(spec, "cpu", compact=True) for spec in compact)])
    return f"""\
// Generated from the op specs (fused_optim/specs.py) by `python -m fused_optim.cpp_header`: do not
// edit. The CPU kernel of every update op (csrc/cpu), with the schema's arguments in its order.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

// X(name) for every update op `name_`: binding.cpp registers its CUDA kernels.
#define FUSED_OPTIM_UPDATE_OPS(X) \\
{names}

// X(name) for every update op with a compact twin `name_compact_` (binding.cpp).
#define FUSED_OPTIM_COMPACT_OPS(X) \\
{compact_names}

namespace fused_optim {{

{declarations}

}}  // namespace fused_optim
"""


def main() -> None:
    from ._build import CSRC

    path = CSRC / HEADER
    path.write_text(render())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
