# The two commands of this repo: `make test` and `make demo`. Each creates .venv if missing,
# installs torch 2.13.0 first (the local CPU wheel; a bare `torch` would pull CUDA packages), then
# this package non-editable with all extras, then runs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

DEMO_ARGS ?=

.PHONY: test demo install

$(PY):
	python3 -m venv $(VENV)

# timm: the bench peers (Lamb, Lars); fairscale: AdaScale's numerical reference in the tests;
# --no-deps: never torchvision or another torch.
install: $(PY)
	$(PIP) torch==2.13.0 "setuptools>=64" wheel
	$(PIP) --no-build-isolation ".[all]"
	$(PIP) --no-deps "timm==1.0.31" "fairscale==0.4.13"

# pytest from the venv's bin (not `python -m pytest`) so tests import the installed package; the
# slowest tests are listed (the suite must stay under 10 minutes on a 2-core machine).
test: install
	$(VENV)/bin/fused-optim build
	$(VENV)/bin/pytest -q --durations=15

# `make demo DEMO_ARGS="--quick --framework mmengine"` passes options to `fused-optim demo`.
# The build first (a no-op when the cache holds a build of the same sources): the demo's wall times
# then show training only.
demo: install
	$(VENV)/bin/fused-optim build
	$(VENV)/bin/fused-optim demo $(DEMO_ARGS)
