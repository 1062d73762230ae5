"""Pure computations behind the workbench: settings → maps, gradients, samples, timings.

Nothing here knows a widget exists. Every function takes tensors, a :class:`kernels.Model`
or a :class:`~workbench.state.Settings` snapshot and returns plain data; the views only
draw what these return. :class:`Pipeline` chains them for one snapshot and memoises each
stage on its inputs, so moving the slice slider re-renders without re-splatting, and
changing a B-factor re-splats without re-reading the file.

Errors meant for a person are :class:`WorkbenchError` (the message says what is wrong
and what to do); the app shows them in its status line.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import kernels
from kernels import AtomSet, GridSpec, Model
from workbench.state import EXAMPLES, Settings

__all__ = [
    "BOX_PADDING",
    "Cancelled",
    "Comparison",
    "DifferenceResult",
    "GradientResult",
    "Pipeline",
    "Result",
    "Section",
    "WorkbenchError",
    "atoms_near_section",
    "central_index",
    "compare_arrays",
    "compare_backends",
    "density_at_points",
    "density_fit_gradient",
    "density_map",
    "distortion",
    "gradients_csv",
    "line_profile",
    "load_model",
    "map_statistics",
    "map_ccp4_bytes",
    "model_pdb",
    "planarity_gradient",
    "prepare_atoms",
    "region_box",
    "residue_keys",
    "section",
    "time_backends",
]

# Å of padding around a model whose file has no unit cell (its P 1 box); said in a note.
BOX_PADDING = 5.0
# Largest box sent to the 3D view: 4 M float32 voxels = 16 MB per update.
MAX_VIEW_VOXELS = 4_000_000
# Boxes above this are subsampled for the 3D view: 3Dmol.js contours in the browser's
# main thread, and a 260k-voxel box held a headless (software WebGL) page for ~2 s.
VIEW_VOXELS = 150_000


class WorkbenchError(Exception):
    """A problem a person can fix: the message says what is wrong and what to do."""


class Cancelled(Exception):
    """The computation was cancelled, or superseded by newer settings."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


# --------------------------------------------------------------------------- model and atoms


def _sentence(exc: BaseException) -> str:
    """An error's text ending in exactly one full stop or question mark (messages are joined as sentences)."""
    text = " ".join(str(exc).split()).rstrip(" ;:,")
    return text if text.endswith((".", "?", "!")) else f"{text}."


def load_model(source: str | os.PathLike | Model) -> Model:
    """Read a structure: a :class:`kernels.Model`, a bundled example name or a file path.

    A file without a unit cell is read into a P 1 box with :data:`BOX_PADDING` Å of
    margin (the model's ``notes`` say so) rather than refused.

    Raises
    ------
    WorkbenchError
        The file is missing, truncated or not a model, with what to do.
    """
    if isinstance(source, Model):
        return source
    text = str(source).strip()
    if not text:
        raise WorkbenchError(f"no structure given: choose a bundled example ({', '.join(EXAMPLES)}) or type a path")
    path = kernels.example_structure(text) if text.lower() in EXAMPLES else Path(text).expanduser()
    try:
        return kernels.read_model(path, box_padding=BOX_PADDING)
    except kernels.ModelError as exc:
        raise WorkbenchError(f"{_sentence(exc)} Choose another file or a bundled example.") from exc


def save_upload(name: str, content: bytes, folder: str | os.PathLike) -> Path:
    """Write an uploaded file's bytes to ``folder`` under its own (sanitised) name."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(name).name) or "upload.pdb"
    path = Path(folder) / safe
    path.write_bytes(bytes(content))
    return path


def distortion(n_atoms: int, amplitude: float, seed: int) -> torch.Tensor:
    """Random displacements, shape (n_atoms, 3), float64, Å: N(0, amplitude²) per coordinate.

    Seeded with its own generator, so the same seed gives the same displacement on any
    device or backend (the physics must not depend on them).
    """
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn((n_atoms, 3), generator=gen, dtype=torch.float64) * float(amplitude)


def prepare_atoms(model: Model, settings: Settings, *, distorted: bool = True) -> AtomSet:
    """The model's atoms with the B-factor mode applied and (optionally) the distortion.

    Returns
    -------
    AtomSet
        float64 on the CPU (moved to the compute device by the caller).

    Raises
    ------
    WorkbenchError
        The B settings give some atom B ≤ 0.
    """
    atoms = model.atoms
    b = atoms.b_iso
    if settings.b_mode == "global":
        b = torch.full_like(b, settings.b_global)
    elif settings.b_mode == "offset":
        b = b + settings.b_offset
        if not bool((b > 0).all()):
            low = float(atoms.b_iso.min())
            raise WorkbenchError(
                f"B offset {settings.b_offset:g} Å² makes B ≤ 0 for {int((b <= 0).sum())} atoms (lowest model B is "
                f"{low:.2f} Å²): set the offset above {-low:.2f} Å²"
            )
    xyz = atoms.xyz
    if distorted and settings.distort_amplitude > 0:
        xyz = xyz + distortion(len(atoms), settings.distort_amplitude, settings.distort_seed)
    return AtomSet(xyz, b, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, _validate=False)


def residue_keys(model: Model) -> list[tuple[str, str]]:
    """``(key, label)`` of every residue, key ``"chain/seq[icode]"`` as the region trait takes."""
    seen: dict[str, str] = {}
    for lab in model.atoms.labels:
        key = f"{lab.chain}/{lab.seq_num}{lab.icode.strip()}"
        if key not in seen:
            seen[key] = f"{lab.chain}/{lab.res_name} {lab.seq_num}{lab.icode.strip()}"
    return list(seen.items())


def region_atoms(model: Model, region: str) -> np.ndarray:
    """Indices of the atoms of residue ``region`` (``"chain/seq"``), all atoms for ''."""
    if not region:
        return np.arange(len(model))
    idx = [i for i, lab in enumerate(model.atoms.labels) if f"{lab.chain}/{lab.seq_num}{lab.icode.strip()}" == region]
    if not idx:
        raise WorkbenchError(f"no residue {region!r} in the model: pick one from the region list (chain/number)")
    return np.asarray(idx)


# --------------------------------------------------------------------------- maps and gradients


def _compute_atoms(atoms: AtomSet, device: str, backend: str, op: str) -> tuple[str, AtomSet]:
    try:
        name = kernels.resolve_backend(op, device, backend)
    except kernels.BackendError as exc:
        raise WorkbenchError(f"{op} backend {backend!r} on {device}: {_sentence(exc)} Choose backend 'auto'.") from exc
    dtype = torch.float64 if name == "reference" else torch.float32
    return name, atoms.to(device, dtype)


def _with_xyz(atoms: AtomSet, xyz: torch.Tensor) -> AtomSet:
    return AtomSet(xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, _validate=False)


def density_map(atoms: AtomSet, grid: GridSpec, settings: Settings, *, backend: str | None = None, device=None):
    """Splat ``atoms`` with the settings' radius rule on ``device`` with ``backend``.

    Returns
    -------
    rho : torch.Tensor, shape grid.shape
        float64 (reference) or float32, on the compute device.
    name : str
        The backend that ran.
    seconds : float
        Wall time of the splat (device synchronised).
    """
    device = torch.device(device or settings.device)
    name, catoms = _compute_atoms(atoms, device, backend or settings.backend, "density")
    try:
        rho, seconds = _timed(
            lambda: kernels.splat_density(
                catoms, grid, radius=settings.radius_arg, cutoff=settings.density_cutoff, backend=name
            ),
            device,
        )
    except kernels.GridError as exc:
        raise WorkbenchError(f"{exc}") from exc
    return rho, name, seconds


@dataclasses.dataclass
class GradientResult:
    """A loss and its gradient with respect to every atom position.

    Attributes
    ----------
    kind : str
        ``"planarity"`` or ``"density"``.
    loss : float
    grad : numpy.ndarray, shape (N, 3), float64
        ∂loss/∂xyz per atom (zero for atoms the loss does not involve).
    units : str
    backend : str
    forward_s, backward_s : float
    """

    kind: str
    loss: float
    grad: np.ndarray
    units: str
    backend: str
    forward_s: float
    backward_s: float


def density_fit_gradient(
    atoms: AtomSet, grid: GridSpec, target: torch.Tensor, settings: Settings, *, backend=None, device=None
) -> tuple[GradientResult, torch.Tensor]:
    """½‖ρ_model(xyz) − ρ_target‖² summed over voxels, and its gradient w.r.t. xyz.

    Returns the :class:`GradientResult` and the model map (same as :func:`density_map`).
    """
    device = torch.device(device or settings.device)
    name, catoms = _compute_atoms(atoms, device, backend or settings.backend, "density")
    xyz = catoms.xyz.detach().clone().requires_grad_(True)
    leaf = _with_xyz(catoms, xyz)
    tgt = target.to(device=device, dtype=catoms.dtype)
    rho, fwd = _timed(
        lambda: kernels.splat_density(
            leaf, grid, radius=settings.radius_arg, cutoff=settings.density_cutoff, backend=name
        ),
        device,
    )

    def backward():
        loss = 0.5 * ((rho - tgt) ** 2).sum()
        loss.backward()
        return loss

    loss, bwd = _timed(backward, device)
    grad = xyz.grad.detach().to("cpu", torch.float64).numpy()
    result = GradientResult("density", float(loss.detach()), grad, "(e/Å³)²/Å", name, fwd, bwd)
    return result, rho.detach()


def find_planes(model: Model):
    """The model's planar groups (:func:`kernels.find_planes`); raises WorkbenchError if unavailable."""
    try:
        from kernels import find_planes as _find
    except ImportError as exc:
        raise WorkbenchError("planarity is unavailable: kernels.find_planes is not in this install yet") from exc
    return _find(model, sigma=0.02)


def planarity_gradient(xyz: torch.Tensor, planes, settings: Settings, *, backend=None, device=None) -> GradientResult:
    """Planarity NLL of positions ``xyz`` (N, 3) Å and its gradient (:func:`kernels.planarity_nll`)."""
    try:
        from kernels import planarity_nll
    except ImportError as exc:
        raise WorkbenchError("planarity is unavailable: kernels.planarity_nll is not in this install yet") from exc
    device = torch.device(device or settings.device)
    try:
        name = kernels.resolve_backend("planarity", device, backend or settings.backend)
    except kernels.BackendError as exc:
        raise WorkbenchError(f"planarity backend on {device}: {_sentence(exc)} Choose backend 'auto'.") from exc
    dtype = torch.float64 if name == "reference" else torch.float32
    x = xyz.detach().to(device, dtype).clone().requires_grad_(True)
    p = planes.to(device) if hasattr(planes, "to") else planes
    nll, fwd = _timed(lambda: planarity_nll(x, p, backend=name), device)
    _, bwd = _timed(lambda: nll.backward(), device)
    grad = x.grad.detach().to("cpu", torch.float64).numpy()
    return GradientResult("planarity", float(nll.detach()), grad, "1/Å", name, fwd, bwd)


def _tricubic():
    try:
        from kernels import tricubic_sample
    except ImportError as exc:
        raise WorkbenchError(
            "tricubic sampling is unavailable: kernels.tricubic_sample is not in this install yet"
        ) from exc
    return tricubic_sample


def density_at_points(rho: torch.Tensor, grid: GridSpec, points: torch.Tensor, *, backend: str = "auto") -> np.ndarray:
    """Tricubic (Catmull-Rom, periodic) density at Cartesian ``points`` (..., 3) Å, as float64 numpy."""
    sample = _tricubic()
    pts = points.to(device=rho.device, dtype=rho.dtype)
    try:
        name = kernels.resolve_backend("tricubic", rho.device, backend)
    except kernels.BackendError:
        name = "auto"  # the splat backend need not exist for tricubic (e.g. none yet): let dispatch pick
    out = sample(rho, grid, pts, method="catmull-rom", mode="periodic", backend=name)
    return out.detach().to("cpu", torch.float64).numpy()


def line_profile(
    rho: torch.Tensor, grid: GridSpec, start, end, *, n: int = 121, backend: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Density along the segment start → end (Å), ``n`` tricubic samples.

    Returns
    -------
    distance : numpy.ndarray, shape (n,), Å from ``start``
    values : numpy.ndarray, shape (n,), e/Å³
    """
    p0 = torch.as_tensor(np.asarray(start, dtype=np.float64))
    p1 = torch.as_tensor(np.asarray(end, dtype=np.float64))
    t = torch.linspace(0.0, 1.0, n, dtype=torch.float64)
    points = p0 + t[:, None] * (p1 - p0)
    values = density_at_points(rho, grid, points, backend=backend)
    return (t * torch.linalg.norm(p1 - p0)).numpy(), values


# --------------------------------------------------------------------------- sections


def map_statistics(rho: torch.Tensor) -> tuple[float, float, float, float]:
    """Mean, standard deviation, minimum and maximum of ``rho`` in e/Å³.

    On the CPU the reductions run in numpy, single-threaded: torch's parallel
    reductions took 85–100 ms instead of 1 ms for a 466k-voxel map when the two cores
    were busy with other work (its threads wait on each other). On a GPU they stay
    there (one transfer of four numbers).
    """
    r = rho.detach()
    if r.device.type == "cpu":
        x = r.numpy()
        return float(x.mean(dtype=np.float64)), float(x.std(dtype=np.float64)), float(x.min()), float(x.max())
    stats = torch.stack([r.mean(), r.double().std().to(r.dtype), r.min(), r.max()]).tolist()
    return tuple(float(v) for v in stats)


@dataclasses.dataclass
class Section:
    """One grid section drawn in Å with the cell's true angles.

    Voxel (p, q) of ``values`` sits at ``p/n_u · e_u + q/n_v · e_v`` in the section's own
    2-D Cartesian frame (x along the first in-plane cell vector).

    Attributes
    ----------
    values : numpy.ndarray, shape (n_u, n_v), float32
    axis : int
        Cell axis perpendicular to the section.
    index : int
    in_plane : tuple of 2 int
        The two cell axes spanning the section.
    e_u, e_v : numpy.ndarray, shape (2,), Å
        The in-plane cell vectors in the section frame (e_u = (|u|, 0)).
    depth : float
        Distance in Å of the section from the origin plane along the plane normal.
    map_range : tuple of 2 float or None
        Minimum and maximum of the whole map (one colour scale for every section).
    """

    values: np.ndarray
    axis: int
    index: int
    in_plane: tuple[int, int]
    e_u: np.ndarray
    e_v: np.ndarray
    depth: float
    map_range: tuple[float, float] | None = None

    @property
    def corners(self) -> np.ndarray:
        """The four corners of the cell face (4, 2) in Å, for axis limits."""
        return np.array([[0, 0], self.e_u, self.e_u + self.e_v, self.e_v])


def _in_plane_frame(grid: GridSpec, axis: int):
    u, v = [k for k in range(3) if k != axis]
    orth = grid.cell.orth.numpy()
    a_u, a_v = orth[:, u], orth[:, v]
    len_u = float(np.linalg.norm(a_u))
    hat = a_u / len_u
    along = float(a_v @ hat)
    perp = float(np.linalg.norm(a_v - along * hat))
    return (u, v), np.array([len_u, 0.0]), np.array([along, perp])


def section(
    rho: torch.Tensor, grid: GridSpec, axis: int, index: int, map_range: tuple[float, float] | None = None
) -> Section:
    """The section ``index`` perpendicular to cell ``axis`` of a whole-cell map."""
    if not 0 <= index < grid.shape[axis]:
        raise WorkbenchError(f"slice index {index} outside [0, {grid.shape[axis] - 1}] for grid {grid.shape}")
    values = rho.detach().select(axis, index).to("cpu", torch.float32).numpy()
    in_plane, e_u, e_v = _in_plane_frame(grid, axis)
    depth = index / grid.sampling[axis] / grid.cell.reciprocal_lengths[axis]
    return Section(np.ascontiguousarray(values), axis, index, in_plane, e_u, e_v, depth, map_range)


def central_index(xyz: torch.Tensor, grid: GridSpec, axis: int) -> int:
    """Index of the section through the middle of the atoms along ``axis``.

    A circular mean of the fractional coordinates, so a model straddling the cell edge
    (or lying outside the first cell, as most do) still lands on its own middle.
    """
    f = (xyz.detach().to("cpu", torch.float64) @ grid.cell.frac.T)[:, axis].numpy()
    angle = math.atan2(float(np.sin(2 * np.pi * f).mean()), float(np.cos(2 * np.pi * f).mean()))
    return int(round(angle / (2 * np.pi) * grid.shape[axis])) % grid.shape[axis]


def atoms_near_section(xyz: torch.Tensor, grid: GridSpec, sec: Section, tolerance: float = 1.0):
    """Atoms within ``tolerance`` Å of the section plane (periodic images included).

    Returns
    -------
    index : numpy.ndarray, shape (M,), int
    uv : numpy.ndarray, shape (M, 2), Å in the section frame
    distance : numpy.ndarray, shape (M,), Å from the plane
    """
    frac = (xyz.detach().to("cpu", torch.float64) @ grid.cell.frac.T).numpy()
    k = sec.axis
    d = frac[:, k] - sec.index / grid.sampling[k]
    d = d - np.round(d)
    dist = np.abs(d) / grid.cell.reciprocal_lengths[k]
    idx = np.nonzero(dist <= tolerance)[0]
    u, v = sec.in_plane
    fu, fv = frac[idx, u] % 1.0, frac[idx, v] % 1.0
    uv = fu[:, None] * sec.e_u[None, :] + fv[:, None] * sec.e_v[None, :]
    return idx, uv, dist[idx]


# --------------------------------------------------------------------------- comparisons


@dataclasses.dataclass
class Comparison:
    """How far ``out`` is from ``ref`` under KERNELS.md's float32 contract.

    ``tolerance`` per element is ``1e-5·max|ref| + 1e-5·|ref|``.
    """

    max_abs: float
    max_ref: float
    rel_l2: float
    n_over: int
    n_total: int

    @property
    def ok(self) -> bool:
        return self.n_over == 0


def compare_arrays(out, ref) -> Comparison:
    """Max |out − ref|, relative L2 ‖out − ref‖/‖ref‖ and the elements over tolerance."""
    o = torch.as_tensor(out).detach().to("cpu", torch.float64)
    r = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    if o.shape != r.shape:
        raise WorkbenchError(f"cannot compare shapes {tuple(o.shape)} and {tuple(r.shape)}")
    diff = (o - r).abs()
    max_ref = float(r.abs().max()) if r.numel() else 0.0
    norm = float(torch.linalg.norm(r))
    over = diff > 1e-5 * max_ref + 1e-5 * r.abs()
    return Comparison(
        float(diff.max()) if diff.numel() else 0.0,
        max_ref,
        float(torch.linalg.norm(o - r)) / norm if norm > 0 else float(torch.linalg.norm(o - r)),
        int(over.sum()),
        diff.numel(),
    )


@dataclasses.dataclass
class DifferenceResult:
    """Two ``device:backend`` runs on the same inputs and how they differ."""

    a: str
    b: str
    map_a: torch.Tensor
    map_b: torch.Tensor
    maps: Comparison
    gradients: Comparison | None
    gradient_kind: str
    gradient_note: str
    section: Section


def _split(pair: str) -> tuple[str, str]:
    device, _, backend = pair.partition(":")
    return device, backend


def compare_backends(
    a: str,
    b: str,
    atoms: AtomSet,
    grid: GridSpec,
    settings: Settings,
    *,
    target: torch.Tensor | None = None,
    planes=None,
    check: Callable[[], None] = lambda: None,
) -> DifferenceResult:
    """Run the same splat (and gradient) as ``device:backend`` pairs ``a`` and ``b``; compare.

    ``target`` is ρ_target of the density-fit gradient; ``planes`` the planes of the
    planarity gradient. The section is of ``map_a − map_b`` at the settings' slice.
    When a float32 backend takes part, both runs get the atoms rounded to float32 first
    (the same input values, as the kernel tests compare them): otherwise the rounding
    of 40 Å coordinates alone (~2e-6 Å) moves a planarity gradient of d/σ² by ~5e-3,
    far above the float32 contract, and the view would blame the kernel for its input.
    """
    pairs = [_split(p) for p in (a, b)]
    if any(backend != "reference" for _, backend in pairs):
        atoms = atoms.to(dtype=torch.float32).to(dtype=torch.float64)
        target = target.float().double() if target is not None else None
    runs = []
    for device, backend in pairs:
        if settings.gradient_kind == "density" and target is not None:
            g, rho = density_fit_gradient(atoms, grid, target, settings, backend=backend, device=device)
        else:
            rho, _, _ = density_map(atoms, grid, settings, backend=backend, device=device)
            g = planarity_gradient(atoms.xyz, planes, settings, backend=backend, device=device) if planes else None
        runs.append((rho.detach().cpu(), g))
        check()
    (ra, ga), (rb, gb) = runs
    maps = compare_arrays(ra, rb)
    grads = compare_arrays(ga.grad, gb.grad) if ga is not None and gb is not None else None
    note = "" if grads is not None else "no gradient compared (planarity unavailable)"
    diff = (ra.double() - rb.double()).float()
    index = min(settings.slice_index, grid.shape[settings.axis] - 1)
    sec = section(diff, grid, settings.axis, index, (float(diff.min()), float(diff.max())))
    return DifferenceResult(a, b, ra, rb, maps, grads, ga.kind if ga else "", note, sec)


# --------------------------------------------------------------------------- 3D scene and export


def region_box(
    rho: torch.Tensor, grid: GridSpec, xyz: torch.Tensor, padding: float, *, max_voxels: int = VIEW_VOXELS
) -> tuple[torch.Tensor, GridSpec, int]:
    """The part of a periodic whole-cell map covering ``xyz`` (M, 3) Å plus ``padding`` Å.

    A box over ``max_voxels`` is subsampled: every ``stride``-th voxel along each axis
    (a stride dividing the cell sampling, so the box is still a grid of the cell), since
    3Dmol.js contours it in the browser's main thread on every update.

    Returns
    -------
    box : torch.Tensor, float32, CPU
    box_grid : GridSpec
        Origin in units of the (subsampled) cell sampling, possibly negative or past the
        cell: the periodic map is wrapped.
    stride : int
        1 for the full grid.
    """
    frac = (xyz.detach().to("cpu", torch.float64) @ grid.cell.frac.T).numpy()
    pad = padding * np.asarray(grid.cell.reciprocal_lengths)
    m = np.asarray(grid.sampling)
    lo = np.floor((frac.min(axis=0) - pad) * m).astype(int)
    hi = np.ceil((frac.max(axis=0) + pad) * m).astype(int)
    n_full = int(np.prod(hi - lo + 1))
    stride = 1
    while n_full / stride**3 > max_voxels:
        bigger = [s for s in range(stride + 1, 9) if all(int(v) % s == 0 for v in m)]
        if not bigger:
            break
        stride = bigger[0]
    lo_s, hi_s = np.floor_divide(lo, stride), -np.floor_divide(-hi, stride)
    shape = hi_s - lo_s + 1
    if int(np.prod(shape)) > MAX_VIEW_VOXELS:
        raise WorkbenchError(
            f"the 3D map box around the region would have {int(np.prod(shape)):,} voxels (limit "
            f"{MAX_VIEW_VOXELS:,}): choose a residue as region, or a coarser spacing"
        )
    full = rho.detach().to("cpu", torch.float32).numpy()
    idx = [(np.arange(lo_s[k], hi_s[k] + 1) * stride) % grid.shape[k] for k in range(3)]
    box = np.ascontiguousarray(full[np.ix_(*idx)])
    sampling = tuple(int(v) // stride for v in m)
    return torch.from_numpy(box), GridSpec(grid.cell, tuple(shape), tuple(lo_s), sampling), stride


def map_ccp4_bytes(rho: torch.Tensor, grid: GridSpec) -> bytes:
    """A map as the bytes of a CCP4/MRC file (:func:`kernels.write_map`)."""
    with tempfile.TemporaryDirectory(prefix="workbench-") as tmp:
        path = kernels.write_map(Path(tmp) / "map.ccp4", rho, grid)
        return path.read_bytes()


def model_pdb(model: Model, xyz: torch.Tensor) -> str:
    """PDB text of the model with positions ``xyz`` (N, 3) Å (the distorted ones, say)."""
    import gemmi

    st = model.structure.clone()
    pos = xyz.detach().to("cpu", torch.float64).numpy()
    i = 0
    for chain in st[0]:
        for res in chain:
            for atom in res:
                atom.pos = gemmi.Position(*pos[i])
                i += 1
    if i != len(pos):
        raise WorkbenchError(f"the model has {i} atoms but {len(pos)} positions were given")
    st.setup_entities()
    try:
        return st.make_pdb_string()
    except RuntimeError:
        # Long chain names do not fit PDB columns: 3Dmol reads mmCIF too, but sticks need
        # bonds it derives the same way, so shorten names instead.
        st.shorten_chain_names()
        return st.make_pdb_string()


def gradients_csv(model: Model, xyz: np.ndarray, grad: np.ndarray, kind: str, units: str) -> str:
    """CSV text: one row per atom with label, position (Å) and gradient components."""
    lines = [f"# {kind} gradient, units {units}", "index,chain,res_name,seq,atom,altloc,x,y,z,gx,gy,gz,norm"]
    norms = np.linalg.norm(grad, axis=1)
    for i, lab in enumerate(model.atoms.labels):
        x, y, z = xyz[i]
        gx, gy, gz = grad[i]
        lines.append(
            f"{i},{lab.chain},{lab.res_name},{lab.seq_num}{lab.icode.strip()},{lab.atom_name},{lab.altloc},"
            f"{x:.4f},{y:.4f},{z:.4f},{gx:.6e},{gy:.6e},{gz:.6e},{norms[i]:.6e}"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- timings


def time_backends(
    atoms: AtomSet,
    grid: GridSpec,
    settings: Settings,
    *,
    target: torch.Tensor,
    planes=None,
    repeats: int = 2,
    check: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Forward and backward times of every backend that can run here, best of ``repeats``.

    Returns rows ``{"device", "backend", "op", "forward_ms", "backward_ms", "error"}``:
    ``density`` is the splat and the backward of ½‖ρ − ρ_target‖²; ``planarity`` the NLL
    and its backward. A backend that fails gets its error instead of times.
    """
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for device in devices:
        for op in ("density", "planarity"):
            if op == "planarity" and planes is None:
                continue
            for backend in kernels.available_backends(op, device):
                if backend == "triton" and device == "cpu":
                    # Without a GPU, "triton" on CPU tensors is the Triton interpreter:
                    # seconds per call and no measure of the kernel. Say so, do not time it.
                    why = "runs in the Triton interpreter here (no GPU): not timed"
                    rows.append(dict(device=device, backend=backend, op=op, forward_ms=None, backward_ms=None,
                                     error=why))  # fmt: skip
                    continue
                fwd, bwd, err = math.inf, math.inf, ""
                for _ in range(repeats):
                    try:
                        if op == "density":
                            g, _ = density_fit_gradient(atoms, grid, target, settings, backend=backend, device=device)
                        else:
                            g = planarity_gradient(atoms.xyz, planes, settings, backend=backend, device=device)
                    except (WorkbenchError, RuntimeError, ValueError) as exc:
                        err = str(exc)
                        break
                    fwd, bwd = min(fwd, g.forward_s), min(bwd, g.backward_s)
                    check()
                rows.append(
                    {
                        "device": device,
                        "backend": backend,
                        "op": op,
                        "forward_ms": None if err else fwd * 1e3,
                        "backward_ms": None if err else bwd * 1e3,
                        "error": err,
                    }
                )
    return rows


# --------------------------------------------------------------------------- the pipeline


@dataclasses.dataclass
class Result:
    """Everything the views draw for one :class:`Settings` snapshot.

    Tensors are on the CPU; ``rho`` is float32 or float64 (reference). ``unavailable``
    maps a feature name to why it could not be computed (a missing kernel, say): the
    views show that instead of a result.
    """

    settings: Settings
    model: Model
    grid: GridSpec
    atoms: AtomSet
    rho: torch.Tensor
    backend: str
    mean: float
    sigma: float
    target: torch.Tensor
    target_source: str
    section: Section
    near: tuple[np.ndarray, np.ndarray, np.ndarray]
    gradient: GradientResult | None
    atom_rho: np.ndarray | None
    atom_target: np.ndarray | None
    profile: tuple[np.ndarray, np.ndarray] | None
    timings: dict[str, float]
    notes: list[str]
    unavailable: dict[str, str]
    planes: object = None
    atoms_key: tuple = ()
    map_key: tuple = ()

    @property
    def iso_level(self) -> float:
        """Isosurface level in e/Å³: mean + iso_sigma·σ of the whole-cell map."""
        return self.mean + self.settings.iso_sigma * self.sigma


class Pipeline:
    """Runs the computations for a :class:`Settings` snapshot, memoising every stage.

    Stages are keyed on exactly the settings they read, so a change recomputes only
    what depends on it. ``check`` is called between stages and raises :class:`Cancelled`
    to abandon work for settings that are already out of date.
    """

    def __init__(self, memory_models: dict[str, Model] | None = None, splat_cache: int = 6):
        self.memory_models = dict(memory_models or {})
        self._memo: dict[str, tuple[object, object]] = {}
        self._versions: collections.Counter = collections.Counter()
        self._splats: collections.OrderedDict = collections.OrderedDict()
        self._splat_cache = splat_cache

    def _stage(self, name: str, key, fn: Callable):
        hit = self._memo.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = fn()
        self._memo[name] = (key, value)
        self._versions[name] += 1  # keys of later stages use this, never id() (ids are reused)
        return value

    def model(self, structure: str) -> Model:
        """The model of the ``structure`` setting (memoised)."""
        return self._stage("model", structure, lambda: load_model(self.memory_models.get(structure, structure)))

    def grid(self, model: Model, spacing: float) -> GridSpec:
        """The whole-cell grid for ``spacing`` (gemmi's sizing, compatible with the space group)."""
        try:
            return self._stage(
                "grid",
                (self._versions["model"], spacing),
                lambda: GridSpec.for_spacing(model.cell, spacing, model.spacegroup),
            )
        except kernels.GridError as exc:
            raise WorkbenchError(f"{exc}; choose another spacing") from exc

    def _splat(self, key, fn):
        if key in self._splats:
            self._splats.move_to_end(key)
            return self._splats[key]
        value = fn()
        self._splats[key] = value
        while len(self._splats) > self._splat_cache:
            self._splats.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every memoised stage (the next run recomputes everything)."""
        self._memo.clear()
        self._splats.clear()

    def run(
        self,
        settings: Settings,
        *,
        check: Callable[[], None] = lambda: None,
        progress: Callable[[int, int, str], None] = lambda i, n, what: None,
        on_section: Callable[[Section, tuple], None] = lambda sec, near: None,
    ) -> Result:
        """Compute every result for ``settings``; raise WorkbenchError or Cancelled.

        ``on_section(section, near)`` is called as soon as the section exists, before the
        gradients and the tricubic samples (so the slice view updates first).
        """
        total = 6
        notes: list[str] = []
        unavailable: dict[str, str] = {}
        timings: dict[str, float] = {}
        progress(0, total, f"reading {settings.structure}")
        model = self.model(settings.structure)
        notes.extend(model.notes)
        grid = self.grid(model, settings.spacing)
        check()

        mv = self._versions["model"]
        b_key = (
            settings.b_mode,
            settings.b_global if settings.b_mode == "global" else None,
            settings.b_offset if settings.b_mode == "offset" else None,
        )
        d_key = (settings.distort_amplitude, settings.distort_seed) if settings.distort_amplitude > 0 else None
        atoms = self._stage("atoms", (mv, b_key, d_key), lambda: prepare_atoms(model, settings))
        undistorted = self._stage("atoms0", (mv, b_key), lambda: prepare_atoms(model, settings, distorted=False))
        r_key = (settings.radius_arg, settings.density_cutoff if settings.radius_mode == "auto" else None)
        base = (mv, grid.shape, r_key, settings.device, settings.backend, b_key)

        progress(1, total, "splatting the model map")
        want_fit = settings.gradient_kind == "density"
        gradient = None
        if want_fit:
            target, target_source, target_key = self._target(grid, undistorted, settings, base)
            check()
            rho_key = ("fit", *base, d_key, target_key)
            gradient, rho = self._splat(rho_key, lambda: density_fit_gradient(atoms, grid, target, settings))
            backend = gradient.backend
            timings["density forward"] = gradient.forward_s
            timings["density backward"] = gradient.backward_s
        else:
            rho_key = ("rho", *base, d_key)
            rho, backend, seconds = self._splat(rho_key, lambda: density_map(atoms, grid, settings))
            timings["density forward"] = seconds
        check()

        progress(2, total, "map statistics and the section")
        mean, sigma, lo, hi = self._stage("stats", rho_key, lambda: map_statistics(rho))
        # The section is what a slider drag changes: cut it where the map lives (only the section crosses
        # to the host) and show it before the slower stages and before the whole map is copied.
        sec = section(rho, grid, settings.axis, min(settings.slice_index, grid.shape[settings.axis] - 1), (lo, hi))
        near = atoms_near_section(atoms.xyz, grid, sec)
        check()
        on_section(sec, near)
        rho_cpu = self._stage("rho_cpu", rho_key, lambda: rho.detach().cpu())
        if not want_fit:
            target, target_source, target_key = self._target(grid, undistorted, settings, base)
        check()

        progress(3, total, "planarity")
        planes = None
        if not want_fit:
            try:
                planes = self._stage("planes", mv, lambda: find_planes(model))
                gradient = self._stage(
                    "planarity",
                    (mv, d_key, settings.device, settings.backend),
                    lambda: planarity_gradient(atoms.xyz, planes, settings),
                )
                timings["planarity forward"] = gradient.forward_s
                timings["planarity backward"] = gradient.backward_s
            except WorkbenchError as exc:
                unavailable["gradient"] = str(exc)
        check()

        progress(4, total, "density at the atoms (tricubic)")
        atom_rho = atom_target = profile = None
        try:
            start = time.perf_counter()
            atom_rho, atom_target = self._stage(
                "atom_rho",
                (rho_key, target_key),
                lambda: (
                    density_at_points(rho, grid, atoms.xyz, backend=settings.backend),
                    density_at_points(target.to(rho.device), grid, atoms.xyz, backend=settings.backend),
                ),
            )
            timings["tricubic at atoms"] = time.perf_counter() - start
            check()
            progress(5, total, "line profile (tricubic)")
            i, j = settings.profile_atoms
            n = len(model)
            if not (0 <= i < n and 0 <= j < n):
                raise WorkbenchError(f"profile atoms {i}, {j} outside [0, {n - 1}]: pick two atoms of this model")
            profile = self._stage(
                "profile",
                (rho_key, i, j),
                lambda: line_profile(rho, grid, atoms.xyz[i].numpy(), atoms.xyz[j].numpy(), backend=settings.backend),
            )
        except WorkbenchError as exc:
            unavailable["tricubic"] = str(exc)
        progress(6, total, "done")
        return Result(
            settings,
            model,
            grid,
            atoms,
            rho_cpu,
            backend,
            mean,
            sigma,
            target.cpu(),
            target_source,
            sec,
            near,
            gradient,
            atom_rho,
            atom_target,
            profile,
            timings,
            notes,
            unavailable,
            planes,
            atoms_key=(mv, b_key, d_key),
            map_key=rho_key,
        )

    def _target(self, grid, undistorted, settings, base):
        """ρ_target, where it came from and its cache key: a loaded map or the undistorted model's map."""
        if settings.target_map:
            path = Path(settings.target_map).expanduser()
            mtime = path.stat().st_mtime if path.exists() else None
            key = ("map", str(path), mtime, grid.shape, settings.device)
            rho_t, source = self._stage("target_map", key, lambda: self._load_target(path, grid, settings.device))
            return rho_t, source, key
        key = ("rho", *base, None)
        rho0, _, _ = self._splat(key, lambda: density_map(undistorted, grid, settings))
        return rho0.detach(), "map of the undistorted model", key

    @staticmethod
    def _load_target(path: Path, grid: GridSpec, device: str):
        try:
            rho_t, tgrid = kernels.read_map(path)
        except ValueError as exc:
            raise WorkbenchError(
                f"target map: {_sentence(exc)} Give a CCP4/MRC file, or clear the path to use the model"
            ) from exc
        if not np.allclose(tgrid.cell.parameters, grid.cell.parameters, rtol=1e-3):
            raise WorkbenchError(
                f"target map {path.name} has cell {tgrid.cell.parameters}, the model {grid.cell.parameters}: "
                "load a map of this crystal"
            )
        if tgrid.shape == grid.shape and tgrid.is_whole_cell:
            return rho_t.to(device), path.name
        # Resample onto the model grid (tricubic on the loaded map) so ½‖ρ − ρ_target‖² is per voxel.
        sample = _tricubic()
        pts = grid.voxel_positions().reshape(-1, 3).to(rho_t.dtype)
        mode = "periodic" if tgrid.is_whole_cell else "bounded"
        vals = sample(rho_t, tgrid, pts, method="catmull-rom", mode=mode, fill_value=0.0)
        return vals.reshape(grid.shape).to(device), f"{path.name} (resampled from {tgrid.shape})"
