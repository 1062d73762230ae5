"""The tests that send signals pass when pytest runs as ``nohup … &`` does: SIGINT, SIGQUIT and SIGHUP ignored.

A background job starts with SIGINT and SIGQUIT ignored and ``nohup`` ignores SIGHUP; every child
inherits that across ``exec``. Each test here that signals a child sets that signal's action in
the child (:func:`tests.signals.default_action`); this runs a set of them in a pytest started
that way, so one that relies on the launcher's actions fails here and not only on someone's
``nohup bash scripts/test.sh &``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.signals import LAUNCH_IGNORED

ROOT = Path(__file__).resolve().parents[2]

# Quick ones of each kind: a child that gets SIGINT from the test (the Ctrl-C of `workbench check`,
# an interrupted write_map) and one that signals itself at a chosen moment.
SIGNAL_TESTS = [
    "tests/kernels/test_write_signals.py",
    "tests/kernels/test_bad_kernel_inputs.py::test_write_map_interrupted_leaves_no_temporary_file",
    "tests/workbench/test_check_cli.py::test_ctrl_c_during_a_hanging_kernel_exits_130_and_leaves_no_process",
]


def _as_a_background_job() -> None:
    for sig in LAUNCH_IGNORED:
        signal.signal(sig, signal.SIG_IGN)


def test_signal_tests_pass_with_the_signals_a_background_job_ignores():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", *SIGNAL_TESTS],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=_as_a_background_job,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
