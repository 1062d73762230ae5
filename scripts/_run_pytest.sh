# Shared by scripts/test.sh and scripts/test_fast.sh; sourced, not run.
# pytest_status ARGS...: "$PY" -m pytest ARGS and its status, where collecting no tests (pytest's 5)
# counts as a failure (1). run_pytest ARGS...: the same, then exit with that status.
# The test processes share the machine's cores (pytest-xdist workers, the children tests start). A GNU
# OpenMP pool spin-waits between parallel regions by default and so takes the cores the other processes
# need: the CPU kernel tests ran 13-24 % longer on 2 cores without this. The workbench's launcher sets
# the same for its servers (workbench/cli.py).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
pytest_status() {
    set +e
    "$PY" -m pytest "$@"
    local status=$?
    set -e
    if [ "$status" -eq 5 ]; then
        echo "pytest collected no tests: that is a failure" >&2
        status=1
    fi
    return "$status"
}
run_pytest() {
    local status=0
    pytest_status "$@" || status=$?
    exit "$status"
}
