"""Debouncing with a fake clock, batching, and the worker thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from workbench.scheduler import Debouncer, Scheduler

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_debouncer_waits_for_a_quiet_period_and_fires_once():
    clock = FakeClock()
    d = Debouncer(0.05, clock)
    assert not d.pending and not d.due() and d.take() is None
    for _ in range(3):
        d.trigger()
        clock.t += 0.01
    # last trigger at 100.02; now 100.03: 0.01 s of quiet
    assert d.pending and not d.due()
    assert d.remaining() == pytest.approx(0.04)
    clock.t = 100.069
    assert not d.due()
    clock.t = 100.0701
    assert d.due()
    assert d.take() == pytest.approx(100.0)  # when the first coalesced change happened
    assert not d.pending and d.take() is None


def test_debouncer_max_wait_keeps_a_long_drag_live():
    clock = FakeClock()
    d = Debouncer(0.05, clock, max_wait=0.25)
    fired = []
    for _ in range(100):  # a change every 10 ms for a second: never 50 ms of quiet
        d.trigger()
        clock.t += 0.01
        if d.take() is not None:
            fired.append(round(clock.t - 100.0, 3))
    assert fired == [0.25, 0.5, 0.75, 1.0]  # every max_wait, counted from the first change it coalesced
    with pytest.raises(ValueError, match="max_wait"):
        Debouncer(0.1, clock, max_wait=0.05)
    with pytest.raises(ValueError, match="delay"):
        Debouncer(-1.0, clock)


def test_unthreaded_scheduler_runs_only_when_polled_after_the_delay():
    clock = FakeClock()
    runs = []
    s = Scheduler(runs.append, delay=0.05, threaded=False, clock=clock)
    for _ in range(5):
        s.changed()
        clock.t += 0.01
    assert not s.poll() and runs == []
    clock.t += 0.05
    assert s.poll()
    assert runs == [5]  # one run, for the newest generation
    assert not s.poll()
    s.changed()
    s.flush()  # flush runs a pending change without waiting for the clock
    assert runs == [5, 6]


def test_batch_counts_as_one_change():
    runs = []
    s = Scheduler(runs.append, delay=0)
    with s.batch():
        s.changed()
        with s.batch():
            s.changed()
        assert runs == []
    assert runs == [1]
    s.changed()
    assert runs == [1, 2]


def test_threaded_scheduler_coalesces_a_burst_and_runs_off_the_caller_thread():
    threads = []
    done = threading.Event()

    def recompute(gen):
        threads.append(threading.current_thread().name)
        done.set()

    s = Scheduler(recompute, delay=0.05, max_wait=10.0)
    try:
        for _ in range(50):
            s.changed()
        s.flush(timeout=30)
        assert done.is_set()
        assert 1 <= len(threads) < 50
        assert set(threads) == {"workbench-recompute"}
        jobs = []
        s.submit(lambda: jobs.append(threading.current_thread().name))
        s.flush(timeout=30)
        assert jobs == ["workbench-recompute"]
    finally:
        s.close()


_EXIT_SCRIPT = """
import sys, torch
from workbench.scheduler import LatestOnly, Scheduler

def busy():  # torch calls that release the GIL, for about a second
    x = torch.ones(1_000_000)
    for _ in range(400):
        x = x.to(torch.float64).to(torch.float32)

sched = Scheduler(lambda gen: None, delay=0.01)
sched.submit(busy)
draw = LatestOnly(lambda item: busy())
draw.put(1)
print("script done", flush=True)
"""


@pytest.mark.parametrize("run", range(3))
def test_a_script_that_ends_while_the_threads_work_exits_cleanly(run):
    # The interpreter ends while both threads are inside torch calls: without the exit handler
    # each thread is ended by pthread_exit inside a C++ destructor and the process aborts (134).
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "script done" in done.stdout
    assert "terminate called" not in done.stderr
