"""The update math of csrc/shared compiles without torch: each header on its own, with the system
C++ compiler, no include path but the compiler's own (CPATH and friends cleared), warnings as
errors. nvcc compiles the CUDA kernels without torch headers (tests/test_cuda_compile.py), and the
rules are the same code on both devices only while this holds; the helpers that use ATen live in
csrc/host. A header that reached ATen, c10 or torch, directly or through another, fails here
naming what it included, even where such headers are on the compiler's default path.

The rules are templates, so a header alone checks only what does not depend on the value type;
one more unit instantiates every rule's factory and update for float and double, the CUDA kernels'
types (the CPU's Vectorized types come with ATen: the CPU build and tests/test_isa_paths.py)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from fused_optim import _build

MATH = _build.CSRC / "shared"
HEADERS = sorted(MATH.glob("*.h"))
COMPILER = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension builds the CPU library with
FLAGS = ["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-x", "c++"]
TORCH_PARTS = {"ATen", "c10", "torch"}
TIMEOUT = 120  # catches a hang only: each compile takes well under a second

# Every rule's factory, its update and its per-tensor step, on the types of the CUDA kernels.
RULES_UNIT = """
#include "adam_math.h"
#include "lamb_math.h"
#include "sgd_math.h"
#include "trust_ratio.h"

namespace fused_optim {
template <typename V>
V step_all(V p, V g, V m, V v, V vmax, V buf) {
  const AdamStep s = adam_step(1e-3, bias_correction(0.9, 0.999, 1.0, true));
  adam_rule<V>(1e-3, 0.9, 0.999, 1e-8, 0.01, true, false, 1.0).for_tensor(s).apply(p, g, m, v, vmax);
  const LambOptions o = lamb_options(0.9, 0.999, 1e-6, 0.01, true, true, true, 1.0, false, false);
  const LambRule<V> lamb = lamb_rule<V>(o, lamb_grad_multiplier(1.0, 2.0, 1.0), lamb_tensor(1e-3, {}, false));
  lamb.moments(p, g, m, v);
  LambRule<V>::apply(p, from_double<V>(-1e-3 * lamb_trust_ratio(1.0, 2.0, false)), lamb.direction(p, m, v));
  const LarsTensor lars = lars_tensor(1.0, 2.0, 1.0, 0.1, 1e-3, 1e-4, 1e-8, true);
  sgd_rule<V, SgdDirection::kPlain>({lars.grad_mul, lars.weight_decay, 0.1}, 0.9, 0.0, 0.0, true, false, false)
      .apply(p, g, buf);
  sgd_rule<V, SgdDirection::kSign>({1.0, 0.0, 0.1}, 0.0, 0.0, 0.0, false, false, false).apply(p, g);
  sgd_rule<V, SgdDirection::kClamp>({1.0, 1e-4, colossal_lars_lr(1.0, 2.0, 0.1, 1e-3, 1e-4, 1e-8)}, 0.9, 0.0,
                                    kColossalLarsGradClamp, false, false, true)
      .apply(p, g, buf);
  return p;
}
template float step_all(float, float, float, float, float, float);
template double step_all(double, double, double, double, double, double);
}  // namespace fused_optim
"""


def _compile(source: str, *args: str) -> subprocess.CompletedProcess:
    """The compiler on the unit ``source`` (read from stdin) with FLAGS, ``args`` and -H (which
    lists every header the unit opens on stderr), without the environment's include paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH")}
    return subprocess.run([COMPILER, *FLAGS, "-H", *args, "-"], input=source, capture_output=True, text=True,
                          env=env, timeout=TIMEOUT)


def _including(header: Path) -> str:
    return f'#include "{header}"\n'


def _torch_headers(stderr: str) -> list[str]:
    """The headers in -H's list (lines of dots, then a path) that are ATen's, c10's or torch's."""
    opened = re.findall(r"^\.+ (.+)$", stderr, flags=re.M)
    return [h for h in opened if TORCH_PARTS & set(Path(h).parts)]


def test_the_math_headers_are_the_rules_and_formats():
    """The folder holds the headers the kernels' update math needs (a rename here must update the
    kernels' includes, docs/design.md and this list)."""
    assert {h.name for h in HEADERS} >= {"adam_math.h", "lamb_math.h", "primitives.h", "sgd_math.h",
                                        "state_codes.h", "trust_ratio.h"}


@pytest.mark.slow
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h.name)
def test_math_header_compiles_alone_without_torch(header):
    out = _compile(_including(header))
    assert out.returncode == 0, f"{header.name} does not compile without torch:\n{out.stderr[-4000:]}"
    assert _torch_headers(out.stderr) == [], f"{header.name} includes torch's headers"


@pytest.mark.slow
def test_every_rule_factory_instantiates_without_torch():
    out = _compile(RULES_UNIT, "-I", str(MATH))
    assert out.returncode == 0, out.stderr[-4000:]
    assert _torch_headers(out.stderr) == []


@pytest.mark.slow
def test_a_header_that_reaches_torch_fails_the_check(tmp_path):
    """The check itself: a header including one of torch's is reported, whether or not the
    compiler finds it (here it does: torch's include path is given)."""
    from torch.utils import cpp_extension

    header = tmp_path / "leaky.h"
    header.write_text('#pragma once\n#include "primitives.h"\n#include <c10/macros/Macros.h>\n')
    torch_includes = [f for p in cpp_extension.include_paths() for f in ("-isystem", p)]
    out = _compile(_including(header), "-I", str(MATH), *torch_includes)
    assert out.returncode == 0, out.stderr[-4000:]
    leaked = _torch_headers(out.stderr)
    assert leaked and Path(leaked[0]).parts[-3:] == ("c10", "macros", "Macros.h")
    assert _compile(_including(header), "-I", str(MATH)).returncode != 0
