"""The checks themselves, run in this process: every check of every structure (:func:`_run_checks`).

Uninitialised memory is poisoned while a backend runs (``torch.use_deterministic_algorithms`` with
``fill_uninitialized_memory``: every ``torch.empty`` is NaN), so a kernel that reads or returns
memory it never wrote fails the same way on every machine, with or without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from kernels.checking.compare import (
    GEMMI_ATOL,
    GEMMI_RTOL,
    GPU_REPEAT_RTOL,
    MAP_RTOL,
    _compare_maps,
    _fd_check,
    _gradient_check,
    _grads,
    _leaf,
    _map_check,
)
from kernels.checking.processes import _fresh_process, _raised
from kernels.checking.report import Check
from kernels.crystal import GridSpec, Model, example_structure, read_model
from kernels.density import splat_density
from kernels.dispatch import get_backend

#: The structures checked when none are given: the bundled examples.
DEFAULT_STRUCTURES = ("1orc", "1pfe", "1aki")

# ---------------------------------------------------------------------------- inputs


@dataclasses.dataclass(eq=False)
class _Case:
    name: str
    model: Model
    grid: GridSpec
    path: Path | None


def _load(structure, spacing: float, anisotropic: bool) -> _Case:
    """The structure as the backend will get it: isotropic when the backend does not declare anisotropic atoms.

    A file is read keeping its ANISOU, with atoms whose U is not positive definite at their B
    (``on_bad_adp="iso"``; gemmi is then set up the same way, :func:`kernels.testing.gemmi_density_of_model`).
    """
    if isinstance(structure, Model):
        model, name = structure, structure.path.name if structure.path else "<memory>"
    else:
        key = str(structure)
        path = example_structure(key) if key.lower() in DEFAULT_STRUCTURES else Path(key)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "(?s).*not positive definite", UserWarning)
            model, name = read_model(path, on_bad_adp="iso"), key
    if not anisotropic and model.atoms.u_aniso is not None:
        model = dataclasses.replace(model, atoms=model.atoms.replace(u_aniso=None, aniso=None))
    grid = GridSpec.for_spacing(model.cell, spacing, model.spacegroup)
    return _Case(name.split("/")[-1], model, grid, model.path)


@contextlib.contextmanager
def _poisoned() -> Iterator[None]:
    """``torch.empty`` returns NaN inside: memory a kernel never writes shows, on every machine."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _announce(progress):
    """The ``on_step(check, structure, checks)`` of :func:`_run_checks` that calls ``progress(check, structure)``."""
    if progress is None:
        return None
    return lambda step, structure, checks: progress(step, structure)


def _run_checks(op, name, cases, caps, settings, on_step) -> list[Check]:
    """Every check of every case, in this process.

    ``on_step(check, structure, checks)`` is called before each check with the checks done so far.
    Everything the backend raises, ``SystemExit`` included, fails the check it was raised in;
    ``KeyboardInterrupt`` stops the whole check.
    """
    device, radius, cutoff = settings["device"], settings["radius"], settings["cutoff"]
    checks: list[Check] = []
    contract = f"float32 contract: {MAP_RTOL:g}·max|ref| + {MAP_RTOL:g}·|ref|"
    repeat_tol = (
        "bitwise" if device.type == "cpu" else f"{GPU_REPEAT_RTOL:g}·max|ρ| + {GPU_REPEAT_RTOL:g}·|ρ| (GPU atomics)"
    )

    def step(what, case):
        if on_step is not None:
            on_step(what, case.name, checks)

    for n, case in enumerate(cases):
        atoms32 = case.model.atoms.to(device, torch.float32)
        atoms64 = atoms32.to("cpu", torch.float64)  # the same input values as the backend gets

        def call(atoms, case=case):
            return splat_density(atoms, case.grid, radius=radius, cutoff=cutoff, backend=name)

        def ref_call(atoms, case=case):
            return splat_density(atoms, case.grid, radius=radius, cutoff=cutoff, backend="reference")

        with torch.no_grad():
            ref = ref_call(atoms64)
        times = []
        step("runs", case)
        try:
            with _poisoned(), torch.no_grad():
                outs = []
                for _ in range(4):  # call 1 warms up; the steady state is what the map checks judge
                    _sync(device)
                    start = time.perf_counter()
                    outs.append(call(atoms32).detach())
                    _sync(device)
                    times.append(time.perf_counter() - start)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - anything the user's function raises (sys.exit too) is the finding
            checks.append(Check("runs", case.name, "fail", "no exception", f"call {len(times) + 1}: {_raised(exc)}"))
            continue
        out = outs[1]
        step("reference", case)
        checks.append(_map_check("reference", case, out, ref, atoms64, contract, MAP_RTOL, MAP_RTOL))

        step("gemmi", case)
        if case.path is None:
            checks.append(Check("gemmi", case.name, "skipped", "", "a model without a file: gemmi reads files"))
        elif radius is not None:
            checks.append(Check("gemmi", case.name, "skipped", "", "gemmi ends atoms at a cutoff, not a fixed radius"))
        else:
            from kernels.testing import gemmi_density_of_model

            g = torch.from_numpy(gemmi_density_of_model(case.model, settings["spacing"], cutoff))
            if tuple(g.shape) != tuple(case.grid.shape):
                checks.append(
                    Check("gemmi", case.name, "skipped", "", f"gemmi's grid {tuple(g.shape)} ≠ {case.grid.shape}")
                )
            else:
                tol = f"{GEMMI_ATOL:g} e/Å³ + {GEMMI_RTOL:g}·|gemmi| (gemmi sums in float32)"
                checks.append(_map_check("gemmi", case, out, g, atoms64, tol, 0.0, GEMMI_RTOL, GEMMI_ATOL))

        if n == 0:
            step("first call", case)
            if not settings["fresh_process"]:
                checks.append(Check("first call", case.name, "skipped", "", "fresh_process=False"))
            else:
                checks.append(
                    _first_call_check(op, name, case, atoms32, atoms64, device, radius, cutoff, settings["timeout"])
                )

        step("determinism", case)
        checks.append(_repeat_check(case, outs[1:], atoms64, device, repeat_tol))

        step("gradients", case)
        if not caps.gradients:
            for what in ("gradients", "finite differences"):
                checks.append(Check(what, case.name, "skipped", "", "registered with capabilities gradients=False"))
        else:
            checks.extend(
                _gradient_checks(
                    case, atoms32, atoms64, call, ref_call, lambda case=case: step("finite differences", case)
                )
            )

        if settings["timing"]:
            step("speed", case)
            checks.append(_speed_check(case, atoms32, device, times[1:], radius, cutoff, name))
    return checks


def _first_call_check(op, name, case, atoms32, atoms64, device, radius, cutoff, timeout) -> Check:
    tol = "bitwise" if device.type == "cpu" else f"{GPU_REPEAT_RTOL:g}·max|ρ| + {GPU_REPEAT_RTOL:g}·|ρ|"
    tolerance = f"calls 1 and 3 against call 2, {tol}"
    try:
        outs, why = _fresh_process(op, name, case, atoms32, device, radius, cutoff, timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return Check("first call", case.name, "fail", tolerance, str(exc))
    if outs is None:
        return Check("first call", case.name, "skipped", tolerance, why)
    rtol = 0.0 if device.type == "cpu" else GPU_REPEAT_RTOL
    first = _compare_maps(outs[0], outs[1], atoms64, case.grid, rtol, rtol)
    third = _compare_maps(outs[2], outs[1], atoms64, case.grid, rtol, rtol)
    m1, m3 = first[0], third[0]
    bad = [i for i, r in ((1, first), (3, third)) if not r[4]]
    summary = (
        f"in a new process (empty Triton cache): call 1 differs from call 2 in {m1['n_over']} voxels "
        f"({m1['n_nonfinite']} not finite), call 3 in {m3['n_over']}"
    )
    metrics, worst, section, over = first[:4] if 1 in bad or not bad else third[:4]
    return Check(
        "first call",
        case.name,
        "fail" if bad else "pass",
        tolerance,
        summary,
        {"n_over_call1": m1["n_over"], "n_over_call3": m3["n_over"]},
        worst if bad else None,
        section,
        over,
    )


def _repeat_check(case, outs: Sequence[torch.Tensor], atoms64, device, tolerance) -> Check:
    rtol = 0.0 if device.type == "cpu" else GPU_REPEAT_RTOL
    results = [_compare_maps(o, outs[0], atoms64, case.grid, rtol, rtol) for o in outs[1:]]
    n_over = sum(r[0]["n_over"] for r in results)
    worst_r = max(results, key=lambda r: r[0]["max_abs"])
    return Check(
        "determinism",
        case.name,
        "pass" if n_over == 0 else "fail",
        tolerance,
        f"calls 3 and 4 against call 2: {n_over} voxels differ, max |Δ| {worst_r[0]['max_abs']:.2e} e/Å³",
        {"n_over": n_over, "max_abs": worst_r[0]["max_abs"]},
        worst_r[1] if n_over else None,
        worst_r[2],
        worst_r[3],
    )


def _gradient_checks(case, atoms32, atoms64, call, ref_call, before_fd=None) -> list[Check]:
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(case.grid.shape, generator=gen, dtype=torch.float64)
    ref_leaf = _leaf(atoms64)
    (ref_call(ref_leaf) * weights).sum().backward()
    ref_grads = _grads(ref_leaf)
    leaf32 = _leaf(atoms32)
    try:
        with _poisoned():
            rho = call(leaf32)
            if not rho.requires_grad:
                return [
                    Check(
                        "gradients",
                        case.name,
                        "fail",
                        "",
                        "the map has no grad_fn: the backend is not differentiable "
                        "(register with capabilities={'gradients': False} if it is not meant to be)",
                    ),
                    Check("finite differences", case.name, "skipped", "", "no autograd gradient to compare"),
                ]
            (rho.to(torch.float64) * weights.to(rho.device)).sum().backward()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the backend's forward or backward failing (sys.exit too) is the finding
        return [
            Check("gradients", case.name, "fail", "no exception", f"with gradients: {_raised(exc)}"),
            Check("finite differences", case.name, "skipped", "", "the backward raised"),
        ]
    grads = _grads(leaf32)
    out = [_gradient_check(case, atoms64, grads, ref_grads)]
    if grads[0] is None:
        out.append(Check("finite differences", case.name, "skipped", "", "no autograd gradient for xyz"))
    else:
        if before_fd is not None:
            before_fd()
        try:
            with _poisoned():
                out.append(_fd_check(case, atoms32, grads[0], ref_grads[0], weights, call))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the backend failing on a shifted atom is the finding
            out.append(Check("finite differences", case.name, "fail", "no exception", _raised(exc)))
    return out


#: The speed check alternates the two backends' calls until each has run _SPEED_SECONDS in all, or the pairs
#: have taken _SPEED_BUDGET (at least one pair, at most _SPEED_MAX_PAIRS): a fast kernel is timed over many
#: pairs, whose median repeats; a slow one's single call is long enough to time.
_SPEED_SECONDS, _SPEED_BUDGET, _SPEED_MAX_PAIRS = 0.5, 2.0, 200


def _speed_check(case, atoms32, device, times, radius, cutoff, name) -> Check:
    """Our backend against ``name``: alternating pairs of calls, the median of their time ratios.

    On the CPU the ratio is of the process's CPU time (every thread's), which other processes' load
    does not change: on a shared machine the wall time of one call varies by more than two kernels
    differ. On a GPU it is of the wall time between synchronisations. Each call's median wall time is
    given too.
    """
    ours, _ = get_backend("density", device, "auto")
    if ours == name:
        return Check(
            "speed", case.name, "info", "informational", f"{min(times) * 1e3:.2f} ms per call (our own backend)"
        )
    on_cpu = device.type == "cpu"

    def timed(backend) -> tuple[float, float]:
        """(wall seconds, the seconds the ratio compares) of one call."""
        _sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        splat_density(atoms32, case.grid, radius=radius, cutoff=cutoff, backend=backend)
        _sync(device)
        wall = time.perf_counter() - start
        return wall, (time.process_time() - cpu) if on_cpu else wall

    mine, theirs = [], []
    with _poisoned(), torch.no_grad():  # as the backend was timed: under the same switches
        timed(ours)  # our backend's first call (its plan, its caches) is not timed
        start = time.perf_counter()
        while not mine or (
            len(mine) < _SPEED_MAX_PAIRS
            and min(sum(w for w, _ in mine), sum(w for w, _ in theirs)) < _SPEED_SECONDS
            and time.perf_counter() - start < _SPEED_BUDGET
        ):
            # alternating, so that a change of the machine's load falls on both alike, and in turn first
            # (the second call of a pair finds the caches the first warmed)
            if len(mine) % 2:
                theirs.append(timed(ours))
                mine.append(timed(name))
            else:
                mine.append(timed(name))
                theirs.append(timed(ours))
    mine_a, theirs_a = np.asarray(mine), np.asarray(theirs)
    t, t_ours = float(np.median(mine_a[:, 0])), float(np.median(theirs_a[:, 0]))
    ratio = float(np.median(mine_a[:, 1] / np.maximum(theirs_a[:, 1], 1e-9)))
    how = "slower" if ratio > 1.05 else "faster" if ratio < 0.95 else "about as fast"
    measure = "CPU time" if on_cpu else "time"
    return Check(
        "speed",
        case.name,
        "info",
        "informational, never a failure",
        f"{t * 1e3:.2f} ms per call; our {ours} backend {t_ours * 1e3:.2f} ms: yours takes {ratio:.2f}× our "
        f"{measure} ({how}; the median of {len(mine)} alternating calls of each)",
        {"seconds": t, "ours_seconds": t_ours, "ratio": ratio, "calls": len(mine)},
    )
