"""Judge a density backend, ours or a user's, the way our own kernels are judged.

:func:`check_backend` runs a backend registered with :func:`kernels.register_backend`
(or a built-in one) on a few structures and checks its map against the float64
reference and against gemmi, its first call in a fresh process against later calls, its
repeatability, its gradients against the reference's autograd and against its own finite
differences, and times it against our backend (for information). The :class:`CheckReport`
says pass / fail / skipped per check with the tolerance used, renders as a table in a
notebook and writes a self-contained HTML page (:meth:`CheckReport.save`).

Uninitialised memory is poisoned while a backend runs here and in the fresh process
(``torch.use_deterministic_algorithms`` with ``fill_uninitialized_memory``: every
``torch.empty`` is NaN), so a kernel that reads or returns memory it never wrote fails
the same way on every machine, with or without a GPU.

One concern per module:

- :mod:`kernels.checking.report`: the report, its table and its HTML page (with a small PNG
  writer of its own: ``kernels`` never imports ``workbench``);
- :mod:`kernels.checking.compare`: the tolerances and the comparisons of maps and gradients;
- :mod:`kernels.checking.checks`: the checks of every structure, run in the current process;
- :mod:`kernels.checking.processes`: finding the backend again in a new process, the first-call
  process, and the lifetime of every child (it ends with its parent, its folder is removed);
- :mod:`kernels.checking.isolated`: the whole check in a child process, under a timeout;
- here: :func:`check_backend`, which checks its arguments and picks where the checks run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

from kernels._util import positive_number
from kernels.checking.checks import DEFAULT_STRUCTURES, _announce, _load, _run_checks
from kernels.checking.isolated import _run_isolated
from kernels.checking.processes import _function_path
from kernels.checking.report import Check, CheckReport, Worst
from kernels.crystal import Model
from kernels.density import DEFAULT_CUTOFF
from kernels.dispatch import BackendError, backend_capabilities, get_backend

__all__ = ["Check", "CheckReport", "Worst", "check_backend", "DEFAULT_STRUCTURES"]


def check_backend(
    op: str,
    name: str,
    *,
    structures: str | os.PathLike | Model | Iterable[str | os.PathLike | Model] | None = None,
    device: str | torch.device = "cpu",
    spacing: float = 2.0 / 3.0,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    fresh_process: bool = True,
    timing: bool = True,
    timeout: float = 600.0,
    isolate: bool = True,
    progress: Callable[[str, str], None] | None = None,
) -> CheckReport:
    """Check backend ``name`` of ``op`` the way our own kernels are checked.

    Parameters
    ----------
    op : {"density"}
        The op; only density backends have checks so far.
    name : str
        A backend registered with :func:`kernels.register_backend`, or a built-in one.
    structures : str, path, Model, or an iterable of them, optional
        Bundled example names (``"1orc"``), model files, or models already read (one, or
        several); default :data:`DEFAULT_STRUCTURES`.
    device : str or torch.device
        Where the backend runs (``"cpu"`` or ``"cuda"``); the reference always runs in
        float64 on the CPU.
    spacing : float
        Grid spacing in Å (``GridSpec.for_spacing`` of each structure's cell).
    radius, cutoff : float
        As for :func:`kernels.splat_density`; gemmi is compared only with ``radius=None``.
    fresh_process : bool
        Run the first-call check (a new Python process, an empty Triton cache).
    timing : bool
        Time the backend against our own (informational).
    timeout : float
        Seconds, > 0: the limit on the whole check when it runs in its own process
        (``isolate``), and on the first-call process in any case.
    isolate : bool
        Run the checks in a child process that imports the backend (as the first-call check
        does), so that a backend that hangs, ends or kills its process, or closes its output
        fails a check instead of taking the caller down. A backend no new process can import
        (defined in a notebook cell, ``__main__`` or a function), or ``isolate=False``, is
        checked in this process: there a hang has no timeout, ``os._exit`` ends the caller,
        and the report's ``notes`` say so.
    progress : callable, optional
        ``progress(check, structure)`` is called as each check starts (``"runs"`` for the
        backend's first four calls), so a caller can show which one is running.

    Returns
    -------
    CheckReport
        One :class:`Check` per check and structure: ``runs`` (only when the backend raised or
        ended its process), ``reference``, ``gemmi``, ``first call`` (first structure only),
        ``determinism``, ``gradients``, ``finite differences``, ``speed``. A check stopped by
        the timeout, or during which the backend's process ended, fails under its own name
        and ends the report.

    Raises
    ------
    BackendError
        ``op`` has no checks, or the backend cannot run on ``device``.
    TypeError, ValueError
        An argument of the wrong type or out of range (the message names it).
    KeyboardInterrupt
        Ctrl-C (or a backend raising it) stops the whole check.
    """
    if not isinstance(op, str) or op != "density":
        raise BackendError(f"check_backend checks density backends; {op!r} has no checks yet")
    if not isinstance(name, str):
        raise TypeError(f"name must be a backend's name (a str), got {type(name).__name__}")
    device = _device(device)
    spacing = positive_number(spacing, "spacing", "Å")
    radius = None if radius is None else positive_number(radius, "radius", "Å")
    cutoff = positive_number(cutoff, "cutoff", "e/Å³")
    timeout = positive_number(timeout, "timeout", "s")
    for flag, value in (("fresh_process", fresh_process), ("timing", timing), ("isolate", isolate)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be True or False, got {value!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable progress(check, structure) or None, got {progress!r}")
    structures = _structures(structures)
    get_backend(op, device, name)  # raises with the reason when it cannot run here
    caps = backend_capabilities(op, name)
    cases = [_load(s, spacing, caps.anisotropic) for s in structures]
    settings = {
        "device": device,
        "spacing": spacing,
        "radius": radius,
        "cutoff": cutoff,
        "fresh_process": fresh_process,
        "timing": timing,
        "timeout": timeout,
    }
    where = _function_path(op, name) if isolate else "isolate=False"
    if isinstance(where, str):
        note = f"ran in the caller's process, without a timeout: {where}"
        checks = _run_checks(op, name, cases, caps, settings, _announce(progress))
        return CheckReport(op, name, str(device), [c.name for c in cases], checks, [note])
    return _run_isolated(op, name, where, cases, caps, settings, progress)


def _device(device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a str or torch.device ('cpu', 'cuda'), got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a torch device; use 'cpu' or 'cuda' ({exc})") from None


def _structures(structures) -> list:
    """The structures as a list; one str, path or Model is one structure, not an iterable of characters."""
    if structures is None:
        return list(DEFAULT_STRUCTURES)
    if isinstance(structures, (str, os.PathLike, Model)):
        return [structures]
    if not isinstance(structures, Iterable):
        raise TypeError(
            f"structures must be a structure (a bundled name, a model file or a Model) or an iterable of them, "
            f"got {type(structures).__name__}"
        )
    out = list(structures)
    if not out:
        raise ValueError("structures is empty; pass at least one structure or None for the bundled ones")
    bad = [s for s in out if not isinstance(s, (str, os.PathLike, Model))]
    if bad:
        raise TypeError(
            f"each structure is a bundled name such as '1orc', a model file or a kernels.Model; got {bad[0]!r}"
        )
    return out
