# The two commands of this repo: `make test` and `make demo` (and `make bench`). Each creates .venv if missing,
# installs torch 2.13.0 first (the local CPU wheel; a bare `torch` would pull CUDA packages), then
# this package non-editable with all extras, then runs. `make check-cuda-build` (below) checks the
# CUDA library's build in a second venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_INSTALL := -m pip install --quiet --disable-pip-version-check
PIP := $(PY) $(PIP_INSTALL)

DEMO_ARGS ?=
BENCH_ARGS ?=
# Measured on 2 idle cores, kernels cached (docs/design.md, "Tests"); printed by the targets.
TEST_MINUTES := about 14
FAST_MINUTES := about 3

.PHONY: test test-fast demo bench install check-cuda-build check-gpu torch-optim-tests

$(PY):
	python3 -m venv $(VENV)

# timm: the bench peers (Lamb, Lars); fairscale: AdaScale's numerical reference in the tests;
# --no-deps: never torchvision or another torch. build/ goes first: setuptools would put in the
# wheel the files it copied there for an earlier install, also those deleted from the sources since.
install: $(PY)
	$(PIP) torch==2.13.0 "setuptools>=64" wheel
	rm -rf build
	$(PIP) --no-build-isolation ".[all]"
	$(PIP) --no-deps "timm==1.0.31" "fairscale==0.4.13"

# pytest from the venv's bin (not `python -m pytest`) so tests import the installed package; skip
# reasons (-rs) and the slowest tests are listed. `make test`: every test (it must stay under 15
# minutes on a 2-core machine); `make test-fast`: the tests that neither compile nor start a
# process (not marked slow: tests/conftest.py enforces it), for the edit-test loop.
test: install
	$(VENV)/bin/fused-optim build
	@echo "make test: the whole suite, $(TEST_MINUTES) minutes on 2 idle cores (make test-fast: $(FAST_MINUTES))"
	$(VENV)/bin/pytest -q -rs --durations=15

test-fast: install
	$(VENV)/bin/fused-optim build
	@echo "make test-fast: the tests that neither compile nor start a process, $(FAST_MINUTES) minutes on 2 idle cores"
	$(VENV)/bin/pytest -q -rs -m "not slow" --durations=10

# `make demo DEMO_ARGS="--quick --framework mmengine"` passes options to `python -m examples.demo`;
# `make bench BENCH_ARGS="--quick"` to `python -m benchmarks`. Both live in this repository, not in
# the package: run from here, they import the checkout's examples/ and benchmarks/ (and its
# fused_optim). The build first (a no-op when the cache holds a build of the same sources): the
# wall times then show training (or stepping) only.
demo: install
	$(VENV)/bin/fused-optim build
	$(PY) -m examples.demo $(DEMO_ARGS)

bench: install
	$(VENV)/bin/fused-optim build
	$(PY) -m benchmarks $(BENCH_ARGS)

# `make check-cuda-build`: the CUDA library built, linked and loaded exactly as the first fused CUDA
# step builds it, on a machine without a GPU (docs/design.md, "CUDA build check"). Its own venv
# (.venv-cuda, ~5.5 GB) holds the CUDA build of torch 2.14.1, a second torch version for the CPU
# tests run there too. Needs nvcc of torch's CUDA major version (13) in CUDA_HOME.
CUDA_VENV ?= .venv-cuda
CUDA_HOME ?= /usr/local/cuda
CUDA_PY := $(CUDA_VENV)/bin/python

$(CUDA_PY):
	python3 -m venv $(CUDA_VENV)

# The tests: the CUDA build (tests/build/test_cuda_compile.py, less the per-file nvcc checks `make test` runs
# with the same nvcc), then the op-level tests and the build cache's fault tests on this torch.
check-cuda-build: $(CUDA_PY)
	@test -x "$(CUDA_HOME)/bin/nvcc" || { echo "check-cuda-build: no $(CUDA_HOME)/bin/nvcc: set CUDA_HOME to a CUDA 13 toolkit" >&2; exit 1; }
	$(CUDA_PY) $(PIP_INSTALL) torch==2.14.1 "setuptools>=64" wheel
	$(CUDA_PY) $(PIP_INSTALL) --no-build-isolation ".[test]"
	CUDA_HOME="$(CUDA_HOME)" $(CUDA_VENV)/bin/fused-optim build --cuda
	CUDA_HOME="$(CUDA_HOME)" $(CUDA_VENV)/bin/pytest -q --durations=10 -k "not compiles_for_every_arch" \
		tests/build/test_cuda_compile.py tests/kernels/test_ops.py tests/build/test_build_faults.py

# `make check-gpu`: on a machine with a GPU (no network needed), the CUDA kernels installed over the
# machine's own torch, built, tested, sanitized and benchmarked in under 8 minutes; a markdown and
# a JSON report under $(CHECK_GPU_OUT) (docs/gpu.md). Uses the machine's python3, not a venv:
# `make check-gpu PYTHON=/path/to/python CHECK_GPU_ARGS="--skip bench"`.
CHECK_GPU_OUT ?= $(if $(OUT),$(OUT),gpu-check)
CHECK_GPU_ARGS ?=
check-gpu:
	sh tools/check_gpu.sh "$(CHECK_GPU_OUT)" $(CHECK_GPU_ARGS)

# `make torch-optim-tests TORCH_TEST_OPTIM=/path/to/pytorch/test/test_optim.py`: torch's own optimizer
# tests (TestOptimRenewed, from torch's source tree of the installed version; not kept here) on our
# SGD / Adam / AdamW, CPU only, the documented refusals expected to fail (tools/torch_optim_tests.py,
# docs/design.md "Tests"); about 3 minutes on 2 cores.
TORCH_TEST_OPTIM ?=
torch-optim-tests: install
	@test -f "$(TORCH_TEST_OPTIM)" || { echo "torch-optim-tests: set TORCH_TEST_OPTIM to torch's test/test_optim.py" >&2; exit 2; }
	$(PY) tools/torch_optim_tests.py "$(TORCH_TEST_OPTIM)" -q -rfxX
