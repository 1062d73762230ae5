"""Signal actions for the child processes a test starts and then signals.

A background job (``cmd &``) starts with SIGINT and SIGQUIT ignored, ``nohup`` ignores SIGHUP, and an
ignored signal stays ignored across ``exec``: Python then installs no KeyboardInterrupt handler, and
a SIGINT the test sends does nothing. A test that sends a signal to a child it starts passes
``preexec_fn=default_action(sig, ...)``, so the child starts with the action the test expects
however pytest was launched (foreground, ``nohup … &``, CI).

Standard library only: the browser and notebook tests use it without importing torch.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

__all__ = ["default_action", "LAUNCH_IGNORED"]

#: The signals a launcher may leave ignored: a background job's SIGINT and SIGQUIT, nohup's SIGHUP.
LAUNCH_IGNORED = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


def default_action(*signals: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn`` that gives ``signals`` their default action, unblocked, in the child before it runs.

    Parameters
    ----------
    *signals : signal.Signals
        The signals the test sends (SIGKILL and SIGSTOP need none: their action cannot change).

    Returns
    -------
    callable
        For :class:`subprocess.Popen`'s ``preexec_fn``; it runs in the child between fork and exec.
    """
    chosen = tuple(signals)

    def reset() -> None:
        for sig in chosen:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, chosen)

    return reset
