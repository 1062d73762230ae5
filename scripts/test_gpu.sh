#!/usr/bin/env bash
# The GPU tier: every test that exercises a GPU path (`pytest -m gpu`, marked by conftest.py),
# on a machine with a CUDA GPU and the project's dependencies already installed (torch with
# Triton, gemmi, the widget stack, pytest-xdist, nanobind). Builds the C++ modules in place
# (scripts/build.sh: CMake + ninja, incremental; cmake and ninja from .whl/build/ where the machine
# lacks them), runs the tier over pytest-xdist workers and prints each failure the moment it happens.
#
#   bash scripts/test_gpu.sh                 # the tier over tests/kernels, tests/workbench, tests/distributed,
#                                            # tests/docs and the Python blocks of README.md and docs/*.md
#   bash scripts/test_gpu.sh -k ensemble     # extra arguments go to pytest
#
#   WORKERS=n   pytest-xdist workers (default: half the cores, at most 8)
#   LOG=path    also write the whole output there
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'the GPU tier needs a CUDA GPU; none is visible')"
PYTHON="$PY" bash scripts/build.sh > /tmp/test_gpu_build.log 2>&1 || { tail -n 30 /tmp/test_gpu_build.log; exit 1; }
cores=$(nproc)
workers="${WORKERS:-$(( cores / 2 < 8 ? (cores / 2 > 0 ? cores / 2 : 1) : 8 ))}"
xdist=()
if "$PY" -c "import xdist" >/dev/null 2>&1; then
    xdist=(-n "$workers")
fi
set +e
"$PY" -m pytest -m gpu -p no:cacheprovider -q --failures-now -o addopts="-ra" "${xdist[@]}" \
    tests/kernels tests/workbench tests/distributed tests/docs README.md docs "$@" 2>&1 | tee "${LOG:-/dev/null}"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -eq 5 ]; then
    echo "the GPU tier collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
