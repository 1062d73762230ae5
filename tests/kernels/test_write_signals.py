"""write_map under signals the process does not end on: the map is written all the same.

A signal the process ignores (SIGHUP under ``nohup``, SIGINT in a background job) or handles in
Python without raising must change nothing: the temporary file stays and is renamed onto the map.
The writer is a fresh interpreter sent the signal while a write is under way (a ``.tmp`` file exists).
And a signal that does end it the moment the temporary file is made, before the writer knows its name,
leaves no file behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kernels
from tests.signals import default_action

ROOT = Path(__file__).resolve().parents[2]

WRITER = """
import signal, sys, torch, kernels
from kernels.crystal import Cell, GridSpec
how = sys.argv[2]
sig = getattr(signal, sys.argv[3])
if how == "ignored":
    signal.signal(sig, signal.SIG_IGN)
else:  # a handler that notes the signal and returns
    signal.signal(sig, lambda *_: print("handled", flush=True))
grid = GridSpec(Cell.from_parameters(100.0, 100.0, 100.0, 90.0, 90.0, 90.0), (400, 400, 400))
rho = torch.ones(grid.shape)
print("ready", flush=True)
for _ in range(3):
    kernels.write_map(sys.argv[1], rho, grid)
print("wrote", flush=True)
"""


@pytest.mark.parametrize(("how", "sig"), [("ignored", "SIGHUP"), ("ignored", "SIGINT"), ("handled", "SIGTERM")])
def test_a_signal_that_does_not_end_the_process_leaves_the_write_alone(tmp_path, how, sig):
    out = tmp_path / "map.ccp4"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out), how, sig], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 120
        while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):  # a write is under way
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.005)
        proc.send_signal(getattr(signal, sig))
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert b"wrote" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.ccp4"]
    back, grid = kernels.read_map(out)
    assert grid.shape == (400, 400, 400) and bool((back == 1).all())


# A signal that comes the moment the temporary file exists, before write_map knows its name: sent from inside
# mkstemp, after the file is made. SIGTERM at its default action ends the process; SIGINT raises KeyboardInterrupt.
RACE = """
import os, signal, sys, tempfile, torch, kernels
from kernels.crystal import Cell, GridSpec
sig = getattr(signal, sys.argv[2])
real_mkstemp = tempfile.mkstemp

def mkstemp(*args, **kwargs):
    made = real_mkstemp(*args, **kwargs)
    os.kill(os.getpid(), sig)
    return made

tempfile.mkstemp = mkstemp
grid = GridSpec(Cell.from_parameters(10.0, 10.0, 10.0, 90.0, 90.0, 90.0), (8, 8, 8))
try:
    kernels.write_map(sys.argv[1], torch.ones(grid.shape), grid)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
print("wrote", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_as_the_temporary_file_is_made_leaves_no_file(tmp_path, sig):
    out = tmp_path / "map.ccp4"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", RACE, str(out), sig],
        capture_output=True,
        env=env,
        timeout=300,
        check=False,
        preexec_fn=default_action(getattr(signal, sig)),  # not as the launcher left it (nohup, a background job)
    )
    expected = -signal.SIGTERM if sig == "SIGTERM" else 3  # ended by the signal / KeyboardInterrupt raised
    assert done.returncode == expected, done.stderr.decode()[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a temporary file or a map was left"
