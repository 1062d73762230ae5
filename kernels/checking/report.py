"""What a check found: :class:`Check`, :class:`Worst` and the :class:`CheckReport` with its renderings.

The report prints as a table, shows as HTML in a notebook and saves as a self-contained page
(:meth:`CheckReport.save`) whose pictures come from the small PNG writer here, not the
workbench's renderer: ``kernels`` never imports ``workbench``, and a check run in a user's CI
needs neither widgets nor matplotlib.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import os
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["Check", "CheckReport", "Worst"]


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
