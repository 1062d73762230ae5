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

The HTML page draws its pictures with the small PNG writer of this module, not the
workbench's renderer: ``kernels`` never imports ``workbench``, and a check run in a user's
CI needs neither widgets nor matplotlib.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import html
import importlib
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from kernels._util import positive_number
from kernels.crystal import AtomSet, GridSpec, Model, example_structure, read_model
from kernels.density import DEFAULT_CUTOFF, splat_density
from kernels.dispatch import _REGISTERED, BACKENDS, BackendError, backend_capabilities, get_backend
from kernels.dispatch import _load as _load_backend

__all__ = ["Check", "CheckReport", "Worst", "check_backend", "DEFAULT_STRUCTURES"]

#: The structures checked when none are given: the bundled examples.
DEFAULT_STRUCTURES = ("1orc", "1pfe", "1aki")

# docs/kernels.md's float32 contract: |out − ref| ≤ 1e-5·max|ref| + 1e-5·|ref|.
MAP_RTOL = 1e-5
# gemmi sums in float32 with a fast exp (docs/kernels.md, tolerances in the tests).
GEMMI_ATOL, GEMMI_RTOL = 1e-4, 1e-5
# Gradients of Σ w·ρ sum thousands of float32 voxel terms per atom: 1e-4 of the largest
# gradient (our cpu backend stays below 2e-6 on the bundled structures).
GRAD_RTOL = 1e-4
# Finite differences: central, step FD_STEP Å, of the loss summed in float64 from the float32
# map; the step's truncation error and the map's rounding stay below 1e-3 of the largest
# gradient of the atoms probed (ours: below 3e-4), while a wrong sign or a missing term is 100 %.
FD_STEP = 1e-2
FD_RTOL = 1e-2
FD_ATOMS = 3
# GPU atomics reorder float32 sums between calls: within the float32 contract, not bitwise.
GPU_REPEAT_RTOL = 1e-5

_EXIT_IMPORT = 3  # the fresh process could not import the function


@dataclasses.dataclass(frozen=True)
class Worst:
    """Where a check found its largest deviation.

    Attributes
    ----------
    index : tuple of int
        Voxel (i, j, k) of the map, or (atom, component) of a gradient.
    got, expected : float
    position : tuple of 3 float or None
        Cartesian position of the voxel in Å.
    atom : str
        Label of the nearest atom (periodic images included) or of the atom itself.
    distance : float or None
        Å from the voxel to that atom.
    """

    index: tuple[int, ...]
    got: float
    expected: float
    position: tuple[float, float, float] | None = None
    atom: str = ""
    distance: float | None = None

    def describe(self) -> str:
        where = f"voxel {self.index}" if self.position is not None else f"{self.index}"
        near = ""
        if self.atom and self.distance is not None:
            near = f", {self.distance:.2f} Å from atom {self.atom}"
        elif self.atom:
            near = f" (atom {self.atom})"
        return f"{where}{near}: got {self.got:.6g}, expected {self.expected:.6g}"


@dataclasses.dataclass(eq=False)
class Check:
    """One check on one structure.

    Attributes
    ----------
    name : str
        ``reference``, ``gemmi``, ``first call``, ``determinism``, ``gradients``,
        ``finite differences``, ``speed`` or ``runs`` (the backend raised).
    structure : str
    status : {"pass", "fail", "skipped", "info"}
        ``info`` is never a failure (speed).
    tolerance : str
        The tolerance used, in words.
    summary : str
        What was measured (or why the check was skipped).
    metrics : dict of str to float
        ``rel_l2``, ``max_abs``, ``n_over`` … as measured.
    worst : Worst or None
    section : numpy.ndarray or None, shape (nx, ny), float32
        The map difference (out − expected) on the section ⊥ c through the worst voxel.
    over : numpy.ndarray or None, shape (nx, ny), bool
        Voxels of that section over tolerance.
    """

    name: str
    structure: str
    status: str
    tolerance: str
    summary: str
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    worst: Worst | None = None
    section: np.ndarray | None = None
    over: np.ndarray | None = None

    @property
    def failed(self) -> bool:
        return self.status == "fail"


@dataclasses.dataclass(eq=False, repr=False)
class CheckReport:
    """What :func:`check_backend` found.

    Attributes
    ----------
    op, backend, device : str
    structures : list of str
    checks : list of Check
    notes : list of str
        How the check ran where that limits it (in the caller's process, without a timeout).
    """

    op: str
    backend: str
    device: str
    structures: list[str]
    checks: list[Check]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped and informational checks do not fail)."""
        return not any(c.failed for c in self.checks)

    def failures(self) -> list[Check]:
        """The failed checks."""
        return [c for c in self.checks if c.failed]

    def __getitem__(self, name: str) -> list[Check]:
        """The checks called ``name`` (one per structure)."""
        found = [c for c in self.checks if c.name == name]
        if not found:
            raise KeyError(f"no check {name!r}; checks: {sorted({c.name for c in self.checks})}")
        return found

    def status(self, name: str) -> str:
        """``fail`` if any ``name`` check failed, else ``pass`` if any passed, else its one status."""
        states = {c.status for c in self[name]}
        for s in ("fail", "pass", "info"):
            if s in states:
                return s
        return "skipped"

    def __str__(self) -> str:
        head = f"{self.op} backend {self.backend!r} on {self.device}: {'OK' if self.ok else 'FAILED'}"
        lines = [head, *(f"  note: {n}" for n in self.notes)]
        for c in self.checks:
            where = f" — worst at {c.worst.describe()}" if c.worst is not None and c.status == "fail" else ""
            tol = f" [{c.tolerance}]" if c.tolerance else ""
            lines.append(f"  {c.status.upper():7} {c.name:18} {c.structure:8} {c.summary}{tol}{where}")
        return "\n".join(lines)

    __repr__ = __str__

    def _table(self) -> str:
        colours = {"pass": "#1a7f37", "fail": "#cf222e", "skipped": "#9a6700", "info": "#0969da"}
        rows = []
        for c in self.checks:
            worst = html.escape(c.worst.describe()) if c.worst is not None else ""
            rows.append(
                f"<tr><td>{html.escape(c.name)}</td><td>{html.escape(c.structure)}</td>"
                f"<td style='color:{colours[c.status]};font-weight:bold'>{c.status}</td>"
                f"<td>{html.escape(c.summary)}</td><td>{html.escape(c.tolerance)}</td><td>{worst}</td></tr>"
            )
        verdict = "all checks pass" if self.ok else f"{len(self.failures())} check(s) failed"
        return (
            f"<p><b>{html.escape(self.op)} backend {html.escape(self.backend)!s} on {html.escape(self.device)}</b>: "
            f"{verdict}</p>"
            + "".join(f"<p>note: {html.escape(n)}</p>" for n in self.notes)
            + "<table><tr><th>check</th><th>structure</th><th>status</th><th>measured</th>"
            "<th>tolerance</th><th>worst</th></tr>" + "".join(rows) + "</table>"
        )

    def _repr_html_(self) -> str:
        return self._table()

    def save(self, path: str | os.PathLike) -> Path:
        """Write a self-contained HTML page: the table and the worst sections of failed map checks.

        Each failed map check (``reference``, ``gemmi``, ``first call``) gets the section ⊥ c
        through its worst voxel: out − expected in a blue–white–red scale, and beside it the
        voxels over tolerance in black. Pictures are inline PNG; the page needs no other file.

        The page is written as :func:`kernels.write_map` writes a map: complete or not at all, and
        only to a regular file or a new path (a device, pipe or socket is refused).

        Returns
        -------
        pathlib.Path
            The path written.

        Raises
        ------
        ValueError
            ``path`` is not a regular file or a new path (the message says what it is).
        FileNotFoundError
            Its folder does not exist.
        """
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>check of {html.escape(self.op)} backend {html.escape(self.backend)}</title>",
            "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}img{image-rendering:pixelated}</style>",
            "</head><body>",
            self._table(),
        ]
        for c in self.checks:
            if c.section is None or not c.failed:
                continue
            png = _section_png(c.section, c.over)
            scale = float(np.nanmax(np.abs(c.section))) if np.isfinite(c.section).any() else float("nan")
            parts.append(
                f"<h3>{html.escape(c.name)} on {html.escape(c.structure)}</h3><p>{html.escape(c.summary)}; worst at "
                f"{html.escape(c.worst.describe() if c.worst else '')}</p>"
                f"<p>section ⊥ c through the worst voxel (a down, b across). Left: out − expected, "
                f"±{scale:.3g} e/Å³ blue → white → red; right: black where over tolerance; magenta: not finite</p>"
                f"<img width='{6 * (2 * c.section.shape[1] + 2)}' "
                f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            )
        parts.append("</body></html>")
        from kernels.mapio import write_output

        text = "\n".join(parts).encode("utf-8")
        return write_output(path, lambda tmp: Path(tmp).write_bytes(text))


def _png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an (h, w, 3) uint8 image."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[i].tobytes() for i in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def _section_png(diff: np.ndarray, over: np.ndarray | None) -> bytes:
    """Two panels side by side: out − expected (blue < 0 < red, white 0) and the voxels over tolerance (black)."""
    finite = np.isfinite(diff)
    scale = float(np.abs(diff[finite]).max()) if finite.any() else 1.0
    t = np.clip(np.where(finite, diff, 0.0) / (scale or 1.0), -1.0, 1.0)
    rgb = np.empty((*diff.shape, 3), dtype=np.float64)
    rgb[..., 0] = np.where(t > 0, 1.0, 1.0 + t)
    rgb[..., 1] = 1.0 - np.abs(t)
    rgb[..., 2] = np.where(t < 0, 1.0, 1.0 - t)
    mask = np.ones_like(rgb)
    if over is not None:
        mask[over] = 0.0
    for panel in (rgb, mask):
        panel[~finite] = (1.0, 0.0, 1.0)
    gap = np.full((diff.shape[0], 2, 3), 0.5)
    both = np.concatenate([rgb, gap, mask], axis=1)
    return _png(np.ascontiguousarray((both * 255).round().astype(np.uint8)))


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


def _voxel_where(grid: GridSpec, atoms: AtomSet, index: tuple[int, int, int]) -> tuple[tuple, str, float]:
    """Position of voxel ``index`` in Å, the nearest atom (periodic images included) and its distance."""
    frac = torch.tensor([(o + i) / m for i, o, m in zip(index, grid.origin, grid.sampling)], dtype=torch.float64)
    xyz = atoms.xyz.detach().to("cpu", torch.float64)
    if len(xyz) == 0:
        pos = grid.cell.orth @ frac
        return tuple(float(v) for v in pos), "", float("nan")
    d = (xyz @ grid.cell.frac.T) - frac  # fractional differences, (N, 3)
    d = d - d.round()
    shifts = torch.tensor([(i, j, k) for i in (-1, 0, 1) for j in (-1, 0, 1) for k in (-1, 0, 1)], dtype=torch.float64)
    cart = (d[:, None, :] + shifts[None]) @ grid.cell.orth.T  # (N, 27, 3): images next to the minimum one
    dist = cart.norm(dim=-1).min(dim=1).values
    k = int(dist.argmin())
    pos = grid.cell.orth @ frac
    return tuple(float(v) for v in pos), str(atoms.labels[k]), float(dist[k])


def _compare_maps(
    out: torch.Tensor,
    ref: torch.Tensor,
    atoms: AtomSet,
    grid: GridSpec,
    atol_rel: float,
    rtol: float,
    atol: float = 0.0,
) -> tuple[dict, Worst | None, np.ndarray, np.ndarray, bool]:
    """Compare maps under ``|out − ref| ≤ atol + atol_rel·max|ref| + rtol·|ref|``."""
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    finite = torch.isfinite(o)
    diff = torch.where(finite, (o - r).abs(), torch.full_like(o, math.inf))
    max_ref = float(r.abs().max()) if r.numel() else 0.0
    limit = atol + atol_rel * max_ref + rtol * r.abs()
    over = diff > limit
    norm = float(torch.linalg.norm(r))
    err = torch.where(finite, o - r, torch.zeros_like(o))
    n_bad = int((~finite).sum())
    metrics = {
        "rel_l2": (float(torch.linalg.norm(err)) / norm if norm > 0 else float(torch.linalg.norm(err)))
        if n_bad == 0
        else math.inf,
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "max_ref": max_ref,
        "n_over": int(over.sum()),
        "n_nonfinite": n_bad,
        "n_voxels": diff.numel(),
    }
    if diff.numel() == 0:
        return metrics, None, np.zeros((0, 0), np.float32), np.zeros((0, 0), bool), True
    flat = int(torch.where(over, diff, torch.zeros_like(diff)).argmax()) if bool(over.any()) else int(diff.argmax())
    index = tuple(int(i) for i in np.unravel_index(flat, tuple(o.shape)))
    pos, atom, dist = _voxel_where(grid, atoms, index)
    worst = Worst(index, float(o.reshape(-1)[flat]), float(r.reshape(-1)[flat]), pos, atom, dist)
    k = index[2]
    section = (o[:, :, k] - r[:, :, k]).numpy().astype(np.float32)
    return metrics, worst, section, over[:, :, k].numpy(), not bool(over.any())


def _map_summary(m: dict) -> str:
    if m["n_nonfinite"]:
        return f"{m['n_nonfinite']} of {m['n_voxels']} voxels not finite"
    return (
        f"rel L2 {m['rel_l2']:.2e}, max |Δ| {m['max_abs']:.2e} e/Å³ (max |ρ| {m['max_ref']:.3g}), "
        f"{m['n_over']} of {m['n_voxels']} voxels over"
    )


def _map_check(name, case, out, ref, atoms, tolerance, atol_rel, rtol, atol=0.0) -> Check:
    metrics, worst, section, over, ok = _compare_maps(out, ref, atoms, case.grid, atol_rel, rtol, atol)
    return Check(
        name, case.name, "pass" if ok else "fail", tolerance, _map_summary(metrics), metrics, worst, section, over
    )


# ---------------------------------------------------------------------------- child processes

_EXIT_RAISED = 5  # the backend raised (SystemExit included) in the fresh process

_FRESH_SCRIPT = (
    textwrap.dedent(
        """
    import sys, warnings
    import torch
    from kernels.checking import _import_backend
    args = torch.load(sys.argv[1], weights_only=False)
    try:
        fn = _import_backend(args)
    except Exception as exc:
        print(f"cannot import {args['module']}:{args['qualname']} in a new process: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        sys.exit(EXIT_IMPORT)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
    atoms = args["atoms"].to(args["device"])
    outs = []
    try:
        for _ in range(3):
            out = fn(atoms, args["grid"], radius=args["radius"], cutoff=args["cutoff"])
            outs.append(out.detach().to("cpu"))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        from kernels.checking import _raised
        print(f"call {len(outs) + 1}: {_raised(exc)}", file=sys.stderr)
        sys.exit(EXIT_RAISED)
    torch.save(outs, sys.argv[2])
    """
    )
    .replace("EXIT_IMPORT", str(_EXIT_IMPORT))
    .replace("EXIT_RAISED", str(_EXIT_RAISED))
)


def _raised(exc: BaseException) -> str:
    """What the backend raised, in words; SystemExit (``sys.exit``) is named as the attempt to end the process it is."""
    if isinstance(exc, SystemExit):
        return (
            f"the backend raised SystemExit({exc.code!r}) (sys.exit or exit): a backend returns its map, "
            "it does not end the process"
        )
    return f"{type(exc).__name__}: {exc}"


def _ended(returncode: int) -> str:
    """How a child process ended, in words: its exit status or the signal that killed it."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _attribute(module, path: str):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _function_path(op: str, name: str) -> tuple[str, str] | str:
    """(module, attribute path) a new process imports the backend from, or why it cannot.

    The path is the function's qualified name where that leads back to the very function,
    else a module-level name bound to it (``splat = make_kernel()``); a function that neither
    finds (a notebook cell, ``__main__``, a closure, a decorator's wrapper kept under another
    name) cannot be imported by a new process.
    """
    if name in BACKENDS[op]:
        module, func = BACKENDS[op][name].split(":")
        return module, func
    fn = _REGISTERED[op][name].fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module:
        return f"{fn!r} has no module a new process could import it from"
    if module == "__main__":
        return (
            f"{module}.{qualname} is defined in a notebook cell or a script's __main__, which no new process can "
            "import; put it in a module to have it checked in a new process"
        )
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any error importing the user's module again is the reason
        return f"module {module} cannot be imported again ({type(exc).__name__}: {exc})"
    if getattr(mod, "__file__", None) is None:
        return f"module {module} has no file a new process could import"
    if qualname and "<" not in qualname:
        with contextlib.suppress(AttributeError):
            if _attribute(mod, qualname) is fn:
                return module, qualname
    for key, value in vars(mod).items():
        if value is fn:
            return module, key
    return (
        f"{module}.{qualname} is not reachable by a name in module {module} (defined in a function or replaced "
        "by a decorator), so no new process can import it; bind it to a module-level name to have it checked in "
        "a new process"
    )


def _backend_spec(op: str, name: str, where: tuple[str, str]) -> dict:
    """What a child process needs to call backend ``name`` as this process does (see :func:`_import_backend`)."""
    entry = _REGISTERED.get(op, {}).get(name)
    return {
        "op": op,
        "name": name,
        "module": where[0],
        "qualname": where[1],
        "devices": None if entry is None else entry.devices,
        "capabilities": None if entry is None else dataclasses.asdict(entry.capabilities),
    }


def _import_backend(spec: dict):
    """In a child process: import the backend :func:`_backend_spec` describes, registered as in the parent.

    Returns the function dispatch calls (a registered backend with its output checks).
    """
    fn = _attribute(importlib.import_module(spec["module"]), spec["qualname"])
    if spec["devices"] is None:
        return fn
    from kernels.dispatch import register_backend

    register_backend(spec["op"], spec["name"], fn, devices=spec["devices"], capabilities=spec["capabilities"])
    return _load_backend(spec["op"], spec["name"])


def _child_env() -> dict:
    env = dict(os.environ)
    # the parent's import path, its current folder ("" on sys.path) spelled out: a child's script runs elsewhere
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return env


def _fresh_process(op, name, case, atoms32, device, radius, cutoff, timeout) -> tuple[list[torch.Tensor] | None, str]:
    """The backend's first three calls in a new Python process (empty Triton cache); (outs, why not)."""
    where = _function_path(op, name)
    if isinstance(where, str):
        return None, where
    with tempfile.TemporaryDirectory(prefix="check-backend-") as tmp:
        tmp = Path(tmp)
        spec = _backend_spec(op, name, where)
        spec.update(atoms=atoms32.to("cpu"), grid=case.grid, device=str(device), radius=radius, cutoff=cutoff)
        torch.save(spec, tmp / "in.pt")
        env = _child_env()
        env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")  # empty: the first call compiles
        script = tmp / "fresh.py"
        script.write_text(_FRESH_SCRIPT)
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp / "in.pt"), str(tmp / "out.pt")],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode == -signal.SIGINT:
            raise KeyboardInterrupt("the first-call process was interrupted")
        lines = proc.stderr.strip().splitlines()
        if proc.returncode == _EXIT_IMPORT:
            return None, lines[-1]
        if proc.returncode == _EXIT_RAISED:
            raise RuntimeError(f"in a new process, {lines[-1]}")
        if proc.returncode != 0 or not (tmp / "out.pt").is_file():
            tail = "\n".join(lines[-3:])
            raise RuntimeError(
                f"the new process ended ({_ended(proc.returncode)}) before the backend returned its three maps: "
                "the backend ended or killed its process" + (f"; its last words: {tail}" if tail else "")
            )
        return torch.load(tmp / "out.pt", weights_only=False), ""


# ---------------------------------------------------------------------------- the checks


_GRAD_FIELDS = ("xyz", "b_iso", "occ", "u_aniso")


def _leaf(atoms: AtomSet) -> AtomSet:
    u = None if atoms.u_aniso is None else atoms.u_aniso.detach().clone().requires_grad_(True)
    return AtomSet(
        atoms.xyz.detach().clone().requires_grad_(True),
        atoms.b_iso.detach().clone().requires_grad_(True),
        atoms.occ.detach().clone().requires_grad_(True),
        atoms.a,
        atoms.b,
        atoms.elements,
        atoms.labels,
        u,
        atoms.aniso,
        radiation=atoms.radiation,
        _validate=False,
    )


def _grads(leaf: AtomSet) -> tuple:
    """The gradients of the leaf's differentiable fields (``u_aniso`` only for an anisotropic set)."""
    return tuple(getattr(leaf, f).grad for f in _GRAD_FIELDS if getattr(leaf, f) is not None)


def _gradient_check(case, atoms, out_grads, ref_grads) -> Check:
    worst_val, worst, n_over, parts = -1.0, None, 0, []
    for field, g, r in zip(_GRAD_FIELDS, out_grads, ref_grads):
        if g is None:
            return Check(
                "gradients",
                case.name,
                "fail",
                f"{GRAD_RTOL:g}·max|ref| + {GRAD_RTOL:g}·|ref| per element",
                f"no gradient reached atoms.{field}: the output is not differentiable with respect to it "
                "(register with capabilities={'gradients': False} if it is not meant to be)",
            )
        g = g.detach().to("cpu", torch.float64)
        r = r.detach().to("cpu", torch.float64)
        if g.shape != r.shape:
            g = g.reshape(r.shape)
        diff = torch.where(torch.isfinite(g), (g - r).abs(), torch.full_like(g, math.inf))
        scale = float(r.abs().max()) if r.numel() else 0.0
        over = diff > GRAD_RTOL * scale + GRAD_RTOL * r.abs()
        n_over += int(over.sum())
        if diff.numel():
            rel = diff / (scale or 1.0)
            flat = int(rel.argmax())
            parts.append(f"{field} max |Δ|/max|ref| {float(rel.reshape(-1)[flat]):.1e}")
            if float(rel.reshape(-1)[flat]) > worst_val:
                worst_val = float(rel.reshape(-1)[flat])
                idx = tuple(int(i) for i in np.unravel_index(flat, tuple(r.shape)))
                comp = f" {'xyz'[idx[1]]}" if field == "xyz" else ""
                worst = Worst(
                    (idx[0],) + idx[1:],
                    float(g.reshape(-1)[flat]),
                    float(r.reshape(-1)[flat]),
                    atom=f"{atoms.labels[idx[0]]} ∂/∂{field}{comp}",
                )
    return Check(
        "gradients",
        case.name,
        "pass" if n_over == 0 else "fail",
        f"{GRAD_RTOL:g}·max|ref| + {GRAD_RTOL:g}·|ref| per element of ∂(Σ w·ρ)/∂(xyz, B, occ"
        + (", U)" if len(ref_grads) == 4 else ")"),
        ", ".join(parts) + f"; {n_over} elements over",
        {"n_over": n_over, "max_rel": worst_val},
        worst,
    )


def _fd_check(case, atoms32, grad_xyz, ref_grad_xyz, weights, call) -> Check:
    """∂(Σ w·ρ)/∂xyz of the backend's autograd against its own central differences at a few atoms."""
    strength = ref_grad_xyz.detach().norm(dim=1)
    picks = [int(i) for i in strength.argsort(descending=True)[:FD_ATOMS]]
    w = weights.to(atoms32.device, torch.float64)
    worst, worst_rel, n_over, rows = None, -1.0, 0, []
    ad = grad_xyz.detach().to("cpu", torch.float64)
    scale = float(ad[picks].abs().max()) if picks else 0.0
    for i in picks:
        for c in range(3):
            losses = []
            for sign in (1.0, -1.0):
                xyz = atoms32.xyz.detach().clone()
                xyz[i, c] += sign * FD_STEP
                with torch.no_grad():
                    rho = call(atoms32.replace(xyz=xyz))
                losses.append(float((rho.detach().to(torch.float64) * w).sum()))
            fd = (losses[0] - losses[1]) / (2 * FD_STEP)
            err = abs(fd - float(ad[i, c]))
            rel = err / (scale or 1.0)
            if not math.isfinite(fd) or not math.isfinite(float(ad[i, c])):
                rel = math.inf
            if rel > FD_RTOL:
                n_over += 1
            if rel > worst_rel:
                worst_rel = rel
                worst = Worst((i, c), float(ad[i, c]), fd, atom=f"{atoms32.labels[i]} ∂/∂{'xyz'[c]}")
            rows.append(rel)
    return Check(
        "finite differences",
        case.name,
        "pass" if n_over == 0 else "fail",
        f"|autograd − central difference (h = {FD_STEP:g} Å)| ≤ {FD_RTOL:g}·max|autograd| of the {len(picks)} atoms",
        f"{len(picks)} atoms × 3 components, worst |Δ|/max {worst_rel:.1e}; {n_over} over",
        {"n_over": n_over, "max_rel": worst_rel},
        worst,
    )


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


_CHILD_POLL_S = 0.05  # how often the parent looks at the child's progress


def _run_isolated(op, name, where, cases, caps, settings, progress) -> CheckReport:
    """:func:`_run_checks` in a child process that imports the backend, stopped after ``settings["timeout"]`` s.

    The child writes the checks done so far before each step; a child that times out, ends
    or is killed leaves them, and the step it was in fails with how it ended.
    """
    timeout = settings["timeout"]
    with tempfile.TemporaryDirectory(prefix="check-backend-") as tmp:
        tmp = Path(tmp)
        spec = _backend_spec(op, name, where)
        spec.update(cases=cases, settings={**settings, "device": str(settings["device"])})
        torch.save(spec, tmp / "in.pt")
        paths = [str(tmp / f) for f in ("in.pt", "done.pt", "partial.pt", "steps.txt")]
        with open(tmp / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys; from kernels.checking import _child_main; _child_main(*sys.argv[1:])",
                    *paths,
                ],
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,  # its own process group: stopping it stops its first-call process too
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
        finally:  # timed out, or Ctrl-C here: the child goes, with any process it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _follow(tmp / "steps.txt", seen, progress)
        if proc.returncode == -signal.SIGINT:
            raise KeyboardInterrupt("the check's process was interrupted")
        if (tmp / "done.pt").is_file():
            checks = torch.load(tmp / "done.pt", weights_only=False)
            return CheckReport(op, name, str(settings["device"]), [c.name for c in cases], checks)
        stderr = (tmp / "stderr.txt").read_text(errors="replace").strip().splitlines()
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
