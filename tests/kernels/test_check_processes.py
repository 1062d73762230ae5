"""A check's child processes end with the check, and its ``check-backend-*`` folders go, however it ends.

The caller of :func:`kernels.check_backend` is a fresh interpreter whose backend hangs, either in
the check's own child process (``isolate=True``) or in the first-call process, started by that
child or by the caller itself (``isolate=False``). The caller is then killed (SIGKILL, SIGTERM),
interrupted (SIGINT, at its default action whatever the launcher left) or left to reach its
timeout. Every process it started must be gone soon after, and its temporary directory (a
``TMPDIR`` of its own) empty.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.signals import default_action

ROOT = Path(__file__).resolve().parents[2]

CALLER = """
import sys
import kernels
from tests.kernels import user_backends as ub
fn, where, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
kernels.register_backend("density", fn, getattr(ub, fn), devices=("cpu",), capabilities={"gradients": False})
report = kernels.check_backend(  # the small model of test_register_backend: seconds per check
    "density", fn, structures=[ub.example_atoms()], spacing=1.0, isolate=where == "isolated", timing=False,
    timeout=timeout, progress=lambda check, structure: print("step", check, flush=True),
)
print("report", "ok" if report.ok else "failed", flush=True)
"""

# (backend, where the check runs, the check's timeout in the "timeout" case): the hang is in the check's
# child process, in the first-call process that child starts, or in the first-call process the caller starts.
# The timeouts leave the processes time to start and reach the hang on a loaded 2-core machine.
HANGS = {
    "check process": ("never_returns", "isolated", 20.0),
    "first call under the check process": ("never_returns_in_a_new_process", "isolated", 30.0),
    "first call under the caller": ("never_returns_in_a_new_process", "in-process", 15.0),
}
ENDED_BY = {"SIGKILL": -signal.SIGKILL, "SIGTERM": -signal.SIGTERM, "SIGINT": -signal.SIGINT, "timeout": 0}


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _folders(tmp: Path) -> list[str]:
    """The check's folders in ``tmp`` (torch may keep caches of its own there)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("check-backend-"))


def _running(pids: set[int]) -> list[str]:
    """The command lines of the processes of ``pids`` still running (a zombie has ended)."""
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {' '.join(p.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("how", list(ENDED_BY))
@pytest.mark.parametrize("hang", list(HANGS))
def test_no_process_and_no_folder_outlive_the_check(tmp_path, hang, how):
    fn, where, timeout = HANGS[hang]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    pid_file = tmp_path / "pid"
    env = dict(
        os.environ,
        TMPDIR=str(tmp),
        USER_BACKENDS_PID_FILE=str(pid_file),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, fn, where, str(timeout if how == "timeout" else 600.0)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_action(signal.SIGINT, signal.SIGTERM),  # not as the launcher left them
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(caller.stdout, lines), daemon=True).start()
    out: list[str] = []
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        # the backend hangs: in the check's process once it has started the first calls; in a first-call
        # process once that process has written its pid
        while how != "timeout":
            assert time.monotonic() < deadline and caller.poll() is None, "".join(out)
            started |= _descendants(caller.pid)
            if (fn == "never_returns" and "step runs\n" in out) or pid_file.is_file():
                time.sleep(0.5)  # into the backend's call
                break
            with contextlib.suppress(queue.Empty):
                if (line := lines.get(timeout=0.1)) is not None:
                    out.append(line)
        started |= _descendants(caller.pid)
        if how != "timeout":
            assert started, "the check started no process"
            caller.send_signal(getattr(signal, how))
        while caller.poll() is None:  # the timeout case: every process the check starts until it ends
            assert time.monotonic() < deadline, "".join(out)
            started |= _descendants(caller.pid)
            time.sleep(0.1)
    finally:
        if caller.poll() is None:
            caller.kill()
        caller.wait()
    while (line := lines.get(timeout=10)) is not None:
        out.append(line)
    assert caller.returncode == ENDED_BY[how], "".join(out)
    if how == "timeout":
        assert "report failed\n" in out, "".join(out)
    assert started, "the check started no process"
    deadline = time.monotonic() + 30  # a supervisor learns of its parent's death and cleans up
    while (_running(started) or _folders(tmp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(started) == [], f"still running after the check's caller ended ({how})"
    assert _folders(tmp) == [], f"left in the temporary directory ({how})"
