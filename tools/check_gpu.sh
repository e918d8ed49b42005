#!/bin/sh
# `make check-gpu`: tools/check_gpu.py (its docstring, and docs/gpu.md, say what it checks) run by
# $PYTHON (default python3: the Python whose torch the GPU machine has).
exec "${PYTHON:-python3}" "$(dirname "$0")/check_gpu.py" "$@"
