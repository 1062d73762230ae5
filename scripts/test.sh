#!/usr/bin/env bash
# Install everything the tests need and run them: the one test command (README, .ci/run).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/kernels -k cpu`.
set -euo pipefail
EXTRAS="[test]"
TRITON_SPEC="${TRITON_SPEC-triton==3.7.1}"   # the Triton interpreter runs the tests without a GPU
source "$(dirname "${BASH_SOURCE[0]}")/_install.sh"
if [ -f scripts/ci-setup.sh ]; then
    bash scripts/ci-setup.sh   # Chromium (Debian) + 3Dmol.js (npm) for the browser tests
fi
echo "==> ruff"
"$PY" -m ruff check kernels workbench tests benchmarks
echo "==> pytest"
set +e
"$PY" -m pytest -p no:cacheprovider --durations=15 "${@:-tests}"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
