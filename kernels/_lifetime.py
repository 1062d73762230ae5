"""Child processes that end with their parent and leave no folder behind.

:func:`start_supervised` runs a command under a supervisor: this file run as a script by a new
Python process (``python -I -S``, the standard library only) that never runs anyone's code but its
own. The supervisor starts the command in a process group of its own and waits for it. When the
process that started the supervisor dies, however it dies (SIGKILL, ``os._exit``, a SIGTERM at its
default action), the supervisor is sent SIGTERM (``prctl(PR_SET_PDEATHSIG)`` on Linux, a check of
its parent every 0.2 s elsewhere): it kills the command's whole process group, waits until no
process of it is left, removes the command's folder and exits. Asked to stop by its caller
(:func:`stop_supervised`, SIGUSR1), it does the same but leaves the folder to the caller, which
reads what the command left there and removes it. The command itself is killed (SIGKILL) if the supervisor
dies.

A supervisor, not the command, does this because a command that runs someone's kernel may never
reach Python code again (a loop in C that holds the GIL): only a process whose code is known can be
relied on to clean up. The command ends the way it ended for its caller: the supervisor exits with
its status, or is killed by the signal that killed it, so ``Popen.returncode`` reads as the
command's own.

Only the standard library is imported here: the supervisor starts in tens of milliseconds, and
:func:`kernels._util.end_with_launcher` arms the same parent-death signal with
:func:`arm_parent_death`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["arm_parent_death", "start_supervised", "stop_supervised"]

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2  # how often a supervisor without prctl looks at its parent, and at a dying group
_GROUP_GONE_S = 10.0  # the longest a supervisor waits for a killed group's processes to go


def arm_parent_death(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent thread ends (Linux); False elsewhere.

    The signal comes when the thread that started this process ends, so a process started from a
    thread that returns early would get it then: every caller here starts its child from the thread
    that then waits for it.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_supervised(argv: list[str], folder: str | os.PathLike, **popen_kwargs) -> subprocess.Popen:
    """Start ``argv`` under a supervisor in a new session; the Popen is the supervisor's.

    Parameters
    ----------
    argv : list of str
        The command.
    folder : path
        Removed by the supervisor when it stops the command for any reason but
        :func:`stop_supervised` (the caller's death above all); left for the caller to read and
        remove when the command ends by itself or :func:`stop_supervised` stops it.
    **popen_kwargs
        ``env``, ``stdin``, ``stdout``, ``stderr``… for :class:`subprocess.Popen`; the command
        inherits them. ``start_new_session`` is always set: a Ctrl-C at the caller's terminal
        reaches the caller, which stops the command.

    Returns
    -------
    subprocess.Popen
        Its ``returncode`` is the command's (negative: the signal that killed it).
    """
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, "-I", "-S", script, str(os.getpid()), os.fspath(folder), *argv]
    return subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)


def stop_supervised(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a command :func:`start_supervised` started, with every process of its group.

    Nothing happens if it has ended. The supervisor is asked (SIGTERM) and waited for; one that
    does not end within ``timeout`` s is killed, and its command dies by the parent-death signal.
    The folder stays for the caller.
    """
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGUSR1)  # the caller's request: the folder stays for it
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- the supervisor


class _Stop(Exception):
    """A signal asked the supervisor to stop the command."""


def _stop(signum, frame) -> None:
    raise _Stop(signum)


def _live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are not zombies (Linux: /proc; elsewhere, whether the group exists)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def _kill_group(pgid: int, child: subprocess.Popen) -> None:
    """SIGKILL every process of group ``pgid`` until none is left (a dying process may fork once more)."""
    import time

    deadline = time.monotonic() + _GROUP_GONE_S
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        child.poll()  # reap the command itself; the others are reaped by whoever adopted them
        if not _live_members(pgid) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _exit_like(returncode: int) -> None:
    """End this process as the command ended: its exit status, or killed by its signal."""
    if returncode < 0:
        sig = -returncode
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's action cannot be set, nor need be
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to end a process
    os._exit(returncode)


def _watch_parent(parent: int) -> None:
    """Where prctl is missing: SIGTERM to this process once its parent is gone."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _child_setup() -> None:
    # In the command, between fork and exec: die with the supervisor, with no signal blocked.
    arm_parent_death(signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _supervise(parent: int, folder: str, argv: list[str]) -> None:
    """The supervisor's main: run ``argv``; stop it when asked, or when ``parent`` dies (then ``folder`` goes too).

    SIGUSR1 is the caller's request (:func:`stop_supervised`): the folder stays for it. Any other
    request (the parent-death SIGTERM, SIGHUP, SIGINT, a SIGTERM from anyone) removes the folder:
    which of the caller's threads is alive cannot be told from here, since a parent whose threads
    die one by one hands this process to a sibling thread (``getppid`` unchanged) as it dies.
    """
    import shutil

    asks = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}
    for sig in asks:
        signal.signal(sig, _stop)
    child = None
    try:
        # A request that comes while the command starts is taken once ``child`` names it.
        signal.pthread_sigmask(signal.SIG_BLOCK, asks)
        if not arm_parent_death(signal.SIGTERM):
            _watch_parent(parent)
        if os.getppid() != parent:  # the parent died before the signal was armed
            raise _Stop(signal.SIGTERM)
        child = subprocess.Popen(argv, process_group=0, preexec_fn=_child_setup)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, asks)
        returncode = child.wait()
    except _Stop as stop:
        signal.pthread_sigmask(signal.SIG_BLOCK, asks)  # the cleanup runs to its end
        if child is not None:
            _kill_group(child.pid, child)
        caller_reads = stop.args[0] == signal.SIGUSR1 and not (signal.sigpending() & (asks - {signal.SIGUSR1}))
        if not caller_reads:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(128 + signal.SIGTERM)
    # The command ended by itself: whatever it left running in its group goes; its folder stays for the caller.
    _kill_group(child.pid, child)
    _exit_like(returncode)


if __name__ == "__main__":
    _supervise(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
