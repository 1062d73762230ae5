#!/usr/bin/env bash
# The development tier: ruff and every test not marked `slow` or `browser`, in the environment
# that scripts/test.sh (or scripts/start.sh) installed; nothing is installed here, but the C++
# modules an edit touched are rebuilt first (scripts/build.sh, in the build folder that install
# made; nothing to do takes a fraction of a second). Aimed at five minutes on 2 cores. The full suite (CI, `bash .ci/run`) is scripts/test.sh; the GPU tier is
# scripts/test_gpu.sh.
#
#   bash scripts/test_fast.sh                     # the tier over tests/
#   bash scripts/test_fast.sh tests/kernels -k cpu   # extra arguments go to pytest
#
#   PYTHON=path   the interpreter (default: .venv/bin/python when there is one, else python3)
#   WORKERS=n     pytest-xdist workers (default 2; 0, or an environment without pytest-xdist,
#                 runs in one process)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PYTHON=.venv/bin/python
fi
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
build_dir="build/$("$PY" -c 'import sys; print(sys.implementation.cache_tag)')"
if [ -f "$build_dir/build.ninja" ] || [ -f "$build_dir/Makefile" ]; then
    echo "==> C++ modules (scripts/build.sh)"
    PYTHON="$PY" BUILD_DIR="$build_dir" bash scripts/build.sh
fi
echo "==> ruff"
"$PY" -m ruff check kernels workbench tests benchmarks
echo "==> pytest -m 'not slow and not browser'"
xdist=()
if [ "${WORKERS:-2}" != "0" ] && "$PY" -c "import xdist" >/dev/null 2>&1; then
    xdist=(-n "${WORKERS:-2}" --dist loadfile)
else
    echo "    in one process (WORKERS=0, or no pytest-xdist in $PY)"
fi
source scripts/_run_pytest.sh
paths=("$@")
[ "${#paths[@]}" -gt 0 ] || paths=(tests README.md docs)   # the docs' Python blocks are tests too
run_pytest -m "not slow and not browser" -p no:cacheprovider -q --durations=10 "${xdist[@]}" "${paths[@]}"
