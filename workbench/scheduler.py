"""Debounced, cancellable recomputation off the notebook's main thread.

:class:`Debouncer` is a pure clock-driven state machine (tested with a fake clock);
:class:`Scheduler` owns one worker thread that waits for the debouncer, then runs the
recompute, and runs queued one-off jobs (compare backends, timings) in between. The
kernel's main thread only records that something changed, so a slider dragged for
ten seconds never blocks it (and, through ``max_wait``, still shows a result every
quarter second). Each change bumps ``generation``; the app applies a result only if no
newer one has been shown (see :meth:`workbench.Workbench._recompute`).

The threads are daemons, so a notebook kernel or a script may end without closing its workbench;
at interpreter exit every thread still open is asked to stop and joined (:func:`_close_at_exit`).
A daemon thread left inside a torch call while the interpreter finalises would be ended by
``pthread_exit`` inside a C++ destructor, which aborts the process ("terminate called without an
active exception", exit status 134) after the script's own work has succeeded.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["Debouncer", "LatestOnly", "Scheduler"]

log = logging.getLogger("workbench")


def _wait_while(cond: threading.Condition, busy: Callable[[], object], timeout: float) -> bool:
    """With ``cond`` held, wait while ``busy()`` is true; False if it still is after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while busy():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        cond.wait(min(left, 0.05))
    return True


#: Seconds the exit handler waits for a thread's current piece of work (a recompute or a job stops at
#: its next stage boundary once cancelled; a drawing thread finishes the frame it is sending).
EXIT_JOIN_S = 60.0

_open_threads: weakref.WeakSet = weakref.WeakSet()  # Schedulers and LatestOnlys with a live thread


def _stop_thread(owner, timeout: float = 5.0) -> None:
    """Set ``owner._stop`` under ``owner._cond``, wake its thread and join it (if it has one)."""
    with owner._cond:
        owner._stop = True
        owner._cond.notify_all()
    if owner._thread is not None:
        owner._thread.join(timeout=timeout)
        if not owner._thread.is_alive():
            _open_threads.discard(owner)


def _close_at_exit() -> None:
    """Stop and join every workbench thread still running (registered with :mod:`atexit`)."""
    for owner in list(_open_threads):
        if isinstance(owner, Scheduler):
            owner.cancel()
        _stop_thread(owner, timeout=EXIT_JOIN_S)


atexit.register(_close_at_exit)


class Debouncer:
    """Fires once a quiet period of ``delay`` seconds follows the last :meth:`trigger`,
    or ``max_wait`` seconds after the first trigger it coalesces, whichever is first.

    The second rule keeps a long drag live (a result at least every ``max_wait``)
    instead of showing nothing until the pointer is released.

    Parameters
    ----------
    delay : float
        Seconds of quiet before :meth:`due` becomes true.
    max_wait : float or None
        Longest a trigger waits while new triggers keep arriving (None: no limit).
    clock : callable returning float
        Monotonic seconds (``time.monotonic``; a fake clock in tests).
    """

    def __init__(self, delay: float, clock: Callable[[], float] = time.monotonic, max_wait: float | None = None):
        if not delay >= 0:
            raise ValueError(f"debounce delay must be ≥ 0 seconds, got {delay!r}")
        if max_wait is not None and not max_wait >= delay:
            raise ValueError(f"max_wait must be ≥ the delay ({delay} s), got {max_wait!r}")
        self.delay = float(delay)
        self.max_wait = max_wait
        self.clock = clock
        self._last: float | None = None
        self._first: float | None = None

    @property
    def pending(self) -> bool:
        """A trigger has not been taken yet."""
        return self._last is not None

    def trigger(self) -> None:
        """Record a change now (restarts the quiet period)."""
        now = self.clock()
        if self._last is None:
            self._first = now
        self._last = now

    def _due_at(self) -> float:
        at = self._last + self.delay
        if self.max_wait is not None:
            at = min(at, self._first + self.max_wait)
        return at

    def remaining(self) -> float:
        """Seconds until due (0 when due or nothing pending)."""
        if self._last is None:
            return 0.0
        return max(0.0, self._due_at() - self.clock())

    def due(self) -> bool:
        """Pending, and quiet for ``delay`` seconds or waiting for ``max_wait``."""
        return self._last is not None and self.clock() >= self._due_at()

    def take(self) -> float | None:
        """If due, clear and return when the first coalesced trigger happened; else None."""
        if not self.due():
            return None
        first = self._first
        self._last = self._first = None
        return first

    def force(self) -> None:
        """Make a pending trigger due now (flush)."""
        if self._last is not None:
            self._last = self.clock() - self.delay
            self._first = min(self._first, self._last)


class Scheduler:
    """Runs ``recompute(generation)`` debounced, and queued jobs, on one worker thread.

    Parameters
    ----------
    recompute : callable(int)
        Called with the generation it computes for.
    delay : float
        Debounce delay in seconds; 0 runs ``recompute`` synchronously inside :meth:`changed`.
    max_wait : float
        During a continuous drag, recompute at least this often (seconds).
    threaded : bool
        With ``False`` (tests) nothing runs until :meth:`poll` or :meth:`flush` is called.
    clock : callable
        Monotonic seconds.
    """

    def __init__(
        self,
        recompute: Callable[[int], None],
        *,
        delay: float = 0.03,
        max_wait: float = 0.25,
        threaded: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.recompute = recompute
        self.debouncer = Debouncer(delay, clock, max_wait=max(max_wait, delay))
        self.generation = 0
        self.n_runs = 0
        self.cancel_requested = False
        self._jobs: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self._batch_depth = 0
        self._batch_dirty = False
        self._thread = None
        self.synchronous = delay == 0
        if threaded and not self.synchronous:
            self._thread = threading.Thread(target=self._loop, name="workbench-recompute", daemon=True)
            self._thread.start()
            _open_threads.add(self)

    @property
    def threaded(self) -> bool:
        """Work runs on the worker thread (False: synchronous, or run by :meth:`poll`/:meth:`flush`)."""
        return self._thread is not None

    # ------------------------------------------------------------------ producer side (main thread)

    @contextlib.contextmanager
    def batch(self):
        """Changes inside count as one (e.g. a slider that also switches its mode)."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if self._batch_depth == 0 and self._batch_dirty:
                self._batch_dirty = False
                self.changed()

    def changed(self) -> None:
        """A setting changed: bump the generation and (re)start the quiet period."""
        if self._batch_depth:
            self._batch_dirty = True
            return
        with self._cond:
            self.generation += 1
            self.cancel_requested = False
            if self.synchronous:
                gen = self.generation
            else:
                self.debouncer.trigger()
                self._cond.notify_all()
                return
        self._run(gen)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` once on the worker (immediately when synchronous or not threaded)."""
        if self._thread is None:
            job()
            return
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def cancel(self) -> None:
        """Ask the running computation to stop at its next stage boundary."""
        self.cancel_requested = True

    def poll(self) -> bool:
        """Run a due recompute in the caller's thread (unthreaded mode); True if one ran."""
        with self._cond:
            if self.debouncer.take() is None:
                return False
            gen = self.generation
        self._run(gen)
        return True

    def flush(self, timeout: float = 120.0) -> None:
        """Run anything pending now and wait until the worker is idle."""
        if self._thread is None:
            for _ in range(100):  # a run may itself change a setting (e.g. clamp the slice index)
                with self._cond:
                    if not self.debouncer.pending:
                        return
                    self.debouncer.force()
                self.poll()
            raise RuntimeError("the workbench kept changing its own settings: 100 recomputes in one flush")
        with self._cond:
            self.debouncer.force()
            self._cond.notify_all()
            if not _wait_while(self._cond, lambda: self.debouncer.pending or self._busy or self._jobs, timeout):
                raise TimeoutError(f"the workbench did not finish within {timeout:g} s")

    def close(self) -> None:
        """Stop the worker thread."""
        _stop_thread(self)

    # ------------------------------------------------------------------ worker side

    def _run(self, gen: int) -> None:
        self.n_runs += 1
        self.recompute(gen)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.debouncer.pending and not self._jobs:
                    self._cond.wait()
                if self._stop:
                    return
                if self.debouncer.pending:
                    wait = self.debouncer.remaining()
                    if wait > 0:
                        self._cond.wait(wait)
                        continue
                    self.debouncer.take()
                    task = ("recompute", self.generation)
                else:
                    task = ("job", self._jobs.popleft())
                self._busy = True
            try:
                if task[0] == "recompute":
                    self._run(task[1])
                else:
                    task[1]()
            except Exception:  # the app reports its own errors; never let the worker die silently
                log.exception("workbench worker: unhandled error")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class LatestOnly:
    """Hands the newest of a stream of items to a slow consumer: at most one ``show`` in flight.

    :meth:`put` never waits: it replaces the item not yet shown (counted in ``n_dropped``) and
    wakes the drawing thread. The drawing thread shows the newest item, one at a time, so when
    the consumer (a browser re-rendering the 3D view) is slower than the producer (the fit loop),
    no queue builds up and the view is at most one item behind the newest.

    Parameters
    ----------
    show : callable(item)
        Draws one item; errors are logged, never raised into the producer.
    threaded : bool
        With ``False`` (tests, scripts) :meth:`put` shows the item in the caller's thread.
    """

    def __init__(self, show: Callable[[object], None], *, threaded: bool = True):
        self.show = show
        self.n_put = 0
        self.n_shown = 0
        self.n_dropped = 0
        self._pending: list = []  # at most one item
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="workbench-draw", daemon=True)
            self._thread.start()
            _open_threads.add(self)

    def put(self, item) -> None:
        """Offer ``item``; an item still waiting is dropped for it."""
        with self._cond:
            self.n_put += 1
            if self._pending:
                self.n_dropped += 1
            self._pending[:] = [item]
            self._cond.notify_all()
        if self._thread is None:
            self._drain()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until every item offered is shown or dropped, or the drawing thread is closed; False on timeout."""
        with self._cond:
            return _wait_while(self._cond, lambda: (self._pending or self._busy) and not self._stop, timeout)

    def close(self) -> None:
        """Stop the drawing thread (an item still waiting is not shown)."""
        _stop_thread(self)

    def _drain(self) -> None:
        with self._cond:
            if not self._pending:
                return
            item = self._pending.pop()
            self._busy = True
        try:
            self.show(item)
            self.n_shown += 1
        except Exception:  # the producer must keep running; the drawing error goes to the log
            log.exception("workbench drawing: unhandled error")
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._pending:
                    self._cond.wait()
                if self._stop:
                    return
            self._drain()
