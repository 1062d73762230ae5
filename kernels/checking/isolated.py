"""The whole check in a child process that imports the backend, stopped after a timeout.

The parent follows the child's progress through files in a ``check-backend-*`` folder; a child that
times out, ends or is killed leaves the checks done so far, and the step it was in fails with how
it ended. The child runs under a supervisor (:mod:`kernels._lifetime`): it dies with the caller,
and the folder is removed on every way out, the caller's death included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from kernels._lifetime import start_supervised, stop_supervised
from kernels.checking.checks import _announce, _run_checks
from kernels.checking.processes import (
    _EXIT_IMPORT,
    _backend_spec,
    _check_folder,
    _child_env,
    _ended,
    _import_backend,
)
from kernels.checking.report import Check, CheckReport
from kernels.dispatch import backend_capabilities

_CHILD_POLL_S = 0.05  # how often the parent looks at the child's progress


def _run_isolated(op, name, where, cases, caps, settings, progress) -> CheckReport:
    """:func:`_run_checks` in a child process that imports the backend, stopped after ``settings["timeout"]`` s.

    The child writes the checks done so far before each step; a child that times out, ends
    or is killed leaves them, and the step it was in fails with how it ended.
    """
    timeout = settings["timeout"]
    with _check_folder() as tmp:
        spec = _backend_spec(op, name, where)
        spec.update(cases=cases, settings={**settings, "device": str(settings["device"])})
        torch.save(spec, tmp / "in.pt")
        paths = [str(tmp / f) for f in ("in.pt", "done.pt", "partial.pt", "steps.txt")]
        with open(tmp / "stderr.txt", "wb") as err:
            proc = start_supervised(
                [
                    sys.executable,
                    "-c",
                    "import sys; from kernels.checking.isolated import _child_main; _child_main(*sys.argv[1:])",
                    *paths,
                ],
                tmp,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        deadline = time.monotonic() + timeout
        seen, timed_out = 0, False
        try:
            while proc.poll() is None:
                seen = _follow(tmp / "steps.txt", seen, progress)
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(_CHILD_POLL_S)
        finally:  # timed out, Ctrl-C or any exception here: the child goes, with every process it started
            stop_supervised(proc)
        _follow(tmp / "steps.txt", seen, progress)
        if proc.returncode == -signal.SIGINT:
            raise KeyboardInterrupt("the check's process was interrupted")
        if (tmp / "done.pt").is_file():
            checks = torch.load(tmp / "done.pt", weights_only=False)
            return CheckReport(op, name, str(settings["device"]), [c.name for c in cases], checks)
        # the folder is gone when someone else stopped the supervisor (it then removes the folder)
        err_file = tmp / "stderr.txt"
        stderr = err_file.read_text(errors="replace").strip().splitlines() if err_file.is_file() else []
        if proc.returncode == _EXIT_IMPORT and not timed_out:  # the parent imports it; an odd child may not
            note = f"ran in the caller's process, without a timeout: {stderr[-1] if stderr else 'no new process'}"
            checks = _run_checks(op, name, cases, caps, settings, _announce(progress))
            return CheckReport(op, name, str(settings["device"]), [c.name for c in cases], checks, [note])
        checks = torch.load(tmp / "partial.pt", weights_only=False) if (tmp / "partial.pt").is_file() else []
        steps = (tmp / "steps.txt").read_text().splitlines() if (tmp / "steps.txt").is_file() else []
        check, structure = steps[-1].split("\t", 1) if steps else ("runs", cases[0].name)
        if timed_out:
            tol = f"the whole check within timeout={timeout:g} s"
            why = f"still running after {timeout:g} s: stopped here (a backend that never returns, or raise timeout=)"
        else:
            tol = "the backend returns, leaving its process running"
            tail = "; ".join(stderr[-2:])
            why = (
                f"the check's process ended ({_ended(proc.returncode)}) during this check: the backend ended or killed "
                "its process (os._exit, a signal, a crash)" + (f"; its stderr ended: {tail}" if tail else "")
            )
        checks.append(Check(check, structure, "fail", tol, why))
        return CheckReport(op, name, str(settings["device"]), [c.name for c in cases], checks)


def _follow(steps: Path, seen: int, progress) -> int:
    """Call ``progress`` for the steps the child wrote after the first ``seen``; the new count."""
    if not steps.is_file():
        return seen
    text = steps.read_text(encoding="utf-8")
    complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    for line in complete[seen:]:
        if progress is not None:
            progress(*line.split("\t", 1))
    return max(seen, len(complete))


def _child_main(inp: str, done: str, partial: str, steps: str) -> None:
    """The child of :func:`_run_isolated`: import the backend, run the checks, write them to ``done``."""
    spec = torch.load(inp, weights_only=False)
    try:
        _import_backend(spec)
    except Exception as exc:  # noqa: BLE001 - the parent runs the check itself then, saying why
        print(f"cannot import {spec['module']}:{spec['qualname']} in a new process: {exc}", file=sys.stderr)
        sys.exit(_EXIT_IMPORT)
    settings = {**spec["settings"], "device": torch.device(spec["settings"]["device"])}

    def on_step(step, structure, checks):
        torch.save(checks, partial + ".tmp")
        os.replace(partial + ".tmp", partial)
        with open(steps, "a", encoding="utf-8") as f:
            f.write(f"{step}\t{structure}\n")

    caps = backend_capabilities(spec["op"], spec["name"])
    checks = _run_checks(spec["op"], spec["name"], spec["cases"], caps, settings, on_step)
    torch.save(checks, done + ".tmp")
    os.replace(done + ".tmp", done)
    # Leave at once: whatever the backend left behind (threads, atexit handlers) cannot change the result.
    os._exit(0)
