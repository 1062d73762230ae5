# Shared by scripts/test.sh and scripts/test_fast.sh; sourced, not run.
# run_pytest ARGS...: "$PY" -m pytest ARGS, then exit with its status, where collecting no tests
# (pytest's 5) is a failure too.
run_pytest() {
    set +e
    "$PY" -m pytest "$@"
    local status=$?
    set -e
    if [ "$status" -eq 5 ]; then
        echo "pytest collected no tests: that is a failure" >&2
        exit 1
    fi
    exit "$status"
}
