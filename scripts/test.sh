#!/usr/bin/env bash
# Install everything the tests need and run them: the one test command (README, .ci/run).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/kernels -k cpu` (one run); without
# them every test runs: all but the browser tests over WORKERS processes, then the browser tests alone.
#   WORKERS=n   pytest-xdist worker processes (default 2, CI's cores; 0 runs in this process).
#               Each test file runs whole on one worker, so a file's module fixtures are made once.
# The development tier (no install, no slow or browser tests) is scripts/test_fast.sh.
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
source scripts/_run_pytest.sh
common=(-p no:cacheprovider --durations=15 --failures-now)
if [ "$#" -gt 0 ]; then
    run_pytest "${common[@]}" -n "${WORKERS:-2}" --dist loadfile "$@"
fi
# The browser tests time the workbench as a user feels it (Chromium, the kernel and the splat share
# the cores): they run after the others, alone, so no other test process competes for the cores.
status=0
pytest_status "${common[@]}" -n "${WORKERS:-2}" --dist loadfile -m "not browser" tests README.md docs || status=$?
echo "==> pytest -m browser (alone: its tests time what a user sees)"
pytest_status "${common[@]}" -m browser tests || status=$?
exit "$status"
