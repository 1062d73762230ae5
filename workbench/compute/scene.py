"""Results → the 3D scene: the region's map box, its 3Dmol volume, gradient arrows, ADP ellipsoids, the focus.

The 3D view (:mod:`workbench.views.view3d`) only sets traits from what these return:
cropping the periodic map to a region, serialising it for 3Dmol.js, choosing and
scaling the arrows, picking the atoms near a residue and the sphere the camera fits all
happen here.

What is shown is one set of atoms (:func:`shown_atoms`: the whole model, or a residue
and every atom within the region padding of it). The map box covers them plus the
padding; box voxels farther than the padding from every shown atom are set below any
isosurface level (:func:`near_atoms_mask`), so no isosurface fragment of a periodic
image or of a distant part of the model appears at the box's corners; and the camera
fits the sphere around the shown atoms plus the margin the isosurface needs
(:func:`focus_sphere`), so nothing shown is cut at the canvas edges.
"""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import torch

from kernels import AtomSet, GridSpec, Model
from kernels.adp import U_TO_B, u_matrix
from workbench.compute.atoms import region_atoms
from workbench.compute.errors import WorkbenchError
from workbench.compute.export import map_ccp4_bytes
from workbench.compute.maps import GradientResult
from workbench.compute.text import count

__all__ = [
    "AtomPick",
    "atom_pick",
    "ARROW_MAX_LENGTH",
    "ARROW_MIN_LENGTH",
    "ARROW_SCALE",
    "CLIPPED",
    "ELLIPSOID_SCALE",
    "MAX_ELLIPSOIDS",
    "MAX_ARROWS",
    "MAX_VIEW_VOXELS",
    "VIEW_MARGIN",
    "VIEW_VOXELS",
    "Arrows",
    "Ellipsoids",
    "EllipsoidMesh",
    "RegionGeometry",
    "RegionVolume",
    "adp_ellipsoids",
    "arrow_bytes",
    "position_bytes",
    "arrow_segments",
    "atoms_within",
    "ellipsoid_arrays",
    "ellipsoid_mesh",
    "element_colour",
    "focus_selection",
    "focus_sphere",
    "near_atoms_mask",
    "residue_of_atom",
    "gradient_arrows",
    "region_arrows",
    "region_box",
    "region_geometry",
    "region_volume",
    "shown_atoms",
    "unit_sphere",
    "volume_base64",
]

# Largest box sent to the 3D view: 4 M float32 voxels = 16 MB per update.
MAX_VIEW_VOXELS = 4_000_000
# Boxes above this are subsampled for the 3D view: 3Dmol.js contours in the browser's
# main thread, and a 260k-voxel box holds a headless (software WebGL) page for ~2 s.
VIEW_VOXELS = 150_000

# Å of arrow per unit of gradient, fixed per gradient kind (stated beside the view), so
# an arrow's length means the same pull in every model and after every distortion.
# Measured on 1ORC at 1 Å spacing (max |∇| per atom): planarity 158 1/Å undistorted,
# 523 at 0.1 Å RMS distortion, 1.5e3 at 0.3 Å, 2.4e3 at 0.5 Å; density fit 0 undistorted,
# 4.7 (e/Å³)²/Å at 0.1 Å, 12 at 0.3 Å. With these scales a 0.3 Å distortion gives
# arrows up to ~1.5-2.5 Å, and the undistorted model's own small deviations draw none.
ARROW_SCALE = {"planarity": 1e-3, "density": 0.2}
# Arrows shorter than this (Å) are not drawn: a real model's residual non-planarity is
# noise, not a pull worth an arrow.
ARROW_MIN_LENGTH = 0.25
# Longer arrows are clipped to this length (Å) and the caption says how many were.
ARROW_MAX_LENGTH = 3.0
MAX_ARROWS = 800  # each is a mesh in 3Dmol.js; more slows a software-WebGL page
# e/Å³ below the box minimum given to clipped voxels: below any isosurface level.
CLIPPED = 1.0
# Å added to the camera's sphere around the shown atoms: stick radius plus the isosurface
# around an atom at the usual levels (1-2 σ: ~1.5 Å from a carbon at B 20).
VIEW_MARGIN = 2.0


# --------------------------------------------------------------------------- the map box


@dataclasses.dataclass(frozen=True, eq=False)
class RegionGeometry:
    """Where a region's map box lies in the cell grid, and which of its voxels are drawn.

    Attributes
    ----------
    box_grid : GridSpec
        The box: origin in units of the (subsampled) cell sampling, possibly negative or past the
        cell (the periodic map is wrapped).
    stride : int
        Every ``stride``-th voxel of the cell grid is in the box (1: all of them).
    index : tuple of 3 numpy.ndarray of int64
        The cell-grid index of each box voxel along a, b and c (for :func:`numpy.ix_`).
    keep : numpy.ndarray of bool, shape box_grid.shape, or None
        Voxels within the padding of the atoms (None: no clipping).
    """

    box_grid: GridSpec
    stride: int
    index: tuple
    keep: np.ndarray | None = None


def region_geometry(
    grid: GridSpec, xyz: torch.Tensor, padding: float, *, max_voxels: int = VIEW_VOXELS, clip: bool = False
) -> RegionGeometry:
    """The box covering ``xyz`` (M, 3) Å plus ``padding`` Å in the periodic cell grid ``grid``.

    A box over ``max_voxels`` is subsampled: every ``stride``-th voxel along each axis
    (a stride dividing the cell sampling, so the box is still a grid of the cell), since
    3Dmol.js contours it in the browser's main thread on every update. With ``clip`` the
    voxels within ``padding`` of the atoms are marked (:func:`near_atoms_mask`).
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
    index = tuple((np.arange(lo_s[k], hi_s[k] + 1) * stride) % grid.shape[k] for k in range(3))
    sampling = tuple(int(v) // stride for v in m)
    box_grid = GridSpec(grid.cell, tuple(int(v) for v in shape), tuple(int(v) for v in lo_s), sampling)
    keep = near_atoms_mask(box_grid, xyz, padding) if clip and len(xyz) else None
    return RegionGeometry(box_grid, stride, index, keep)


def region_box(
    rho: torch.Tensor, grid: GridSpec, xyz: torch.Tensor, padding: float, *, max_voxels: int = VIEW_VOXELS
) -> tuple[torch.Tensor, GridSpec, int]:
    """The part of a periodic whole-cell map covering ``xyz`` (M, 3) Å plus ``padding`` Å
    (the box of :func:`region_geometry`).

    Returns
    -------
    box : torch.Tensor, float32, CPU
    box_grid : GridSpec
        Origin in units of the (subsampled) cell sampling, possibly negative or past the
        cell: the periodic map is wrapped.
    stride : int
        1 for the full grid.
    """
    geometry = region_geometry(grid, xyz, padding, max_voxels=max_voxels)
    return _cut(rho, geometry), geometry.box_grid, geometry.stride


def _cut(rho: torch.Tensor, geometry: RegionGeometry) -> torch.Tensor:
    full = rho.detach().to("cpu", torch.float32).numpy()
    return torch.from_numpy(np.ascontiguousarray(full[np.ix_(*geometry.index)]))


@dataclasses.dataclass(frozen=True, eq=False)
class RegionVolume:
    """A region's map box, serialised for 3Dmol.js.

    Attributes
    ----------
    ccp4 : bytes
        The box as a whole CCP4/MRC file (3Dmol.js ``addVolumetricData(…, "ccp4")``).
    shape : tuple of 3 int
        Voxels of the box along a, b, c.
    stride : int
        Every ``stride``-th voxel of the cell grid is in the box (1: all of them).
    n_clipped : int
        Box voxels set below every level: farther than the padding from the shown atoms.
    """

    ccp4: bytes
    shape: tuple[int, int, int]
    stride: int
    n_clipped: int = 0

    @property
    def n_voxels(self) -> int:
        return int(np.prod(self.shape))


def region_volume(
    rho: torch.Tensor,
    grid: GridSpec,
    xyz: torch.Tensor,
    padding: float,
    *,
    max_voxels: int = VIEW_VOXELS,
    clip: bool = True,
    geometry: RegionGeometry | None = None,
) -> RegionVolume:
    """The map box around ``xyz`` (M, 3) Å (:func:`region_box`) as a CCP4 file for the 3D view.

    With ``clip`` every box voxel farther than ``padding`` Å from all of ``xyz`` is set
    to :data:`CLIPPED` below the box minimum, so no isosurface is drawn there.
    ``geometry`` (:func:`region_geometry`, with ``clip``) gives the box and the voxels kept
    instead of deriving them from ``xyz``: a relax frame's map is cut in its run's box, whose
    atoms have moved by much less than the padding.
    """
    if geometry is None:
        geometry = region_geometry(grid, xyz, padding, max_voxels=max_voxels, clip=clip)
    box = _cut(rho, geometry)
    n_clipped = 0
    if clip and geometry.keep is not None and box.numel():
        # geometry.keep may be near_atoms_mask's cached, read-only array: index the box's numpy view with it
        clipped = ~geometry.keep
        box.numpy()[clipped] = float(box.min()) - CLIPPED
        n_clipped = int(clipped.sum())
    return RegionVolume(
        ccp4=map_ccp4_bytes(box, geometry.box_grid), shape=tuple(box.shape), stride=geometry.stride, n_clipped=n_clipped
    )


def near_atoms_mask(box_grid: GridSpec, xyz: torch.Tensor, distance: float) -> np.ndarray:
    """Voxels of a box grid within ``distance`` Å of any atom ``xyz`` (M, 3) Å, no periodic images.

    Each atom stamps the ball of voxels around it (a stencil of voxel offsets, exact
    distances in the cell's metric), so the cost is atoms × ball voxels, not atoms × box.

    Returns
    -------
    numpy.ndarray, shape box_grid.shape, bool
        Read-only: the last mask is kept and handed out again for the same atoms and box.
    """
    pts = xyz.detach().to("cpu", torch.float64).numpy().reshape(-1, 3)
    key = (
        box_grid.shape,
        tuple(box_grid.origin),
        tuple(box_grid.sampling),
        box_grid.cell.parameters,
        float(distance),
        pts.tobytes(),
    )
    if _near_mask[0] == key:
        # the same atoms and box: another map of the same model (the resolution slider's) clips alike
        return _near_mask[1]
    keep = _stamp_near_atoms(box_grid, pts, distance)
    keep.flags.writeable = False
    _near_mask[:] = [key, keep]
    return keep


# The last mask made: (key, mask).
_near_mask: list = [None, None]


def _stamp_near_atoms(box_grid: GridSpec, pts: np.ndarray, distance: float) -> np.ndarray:
    shape = np.asarray(box_grid.shape)
    keep = np.zeros(tuple(shape), bool)
    if not len(pts):
        return keep
    orth = box_grid.cell.orth.numpy()
    m = np.asarray(box_grid.sampling, np.float64)
    origin = np.asarray(box_grid.origin, np.float64)
    reach = np.ceil(distance * np.asarray(box_grid.cell.reciprocal_lengths) * m).astype(int) + 1
    offsets = np.stack(np.meshgrid(*[np.arange(-r, r + 1) for r in reach], indexing="ij"), axis=-1).reshape(-1, 3)
    frac = pts @ box_grid.cell.frac.numpy().T
    voxel = frac * m - origin  # continuous voxel coordinates in the box
    chunk = max(1, 2_000_000 // len(offsets))
    for start in range(0, len(pts), chunk):
        base = np.floor(voxel[start : start + chunk]).astype(int)
        cand = base[:, None, :] + offsets[None, :, :]  # (A, K, 3)
        d_frac = (cand + origin) / m - frac[start : start + chunk, None, :]
        near = np.einsum("akj,ij->aki", d_frac, orth)
        ok = (near**2).sum(-1) <= distance**2
        ok &= ((cand >= 0) & (cand < shape)).all(-1)
        c = cand[ok]
        keep[c[:, 0], c[:, 1], c[:, 2]] = True
    return keep


def volume_base64(ccp4: bytes) -> str:
    """CCP4 bytes as base64 text: py3Dmol passes volume data as text, 3Dmol decodes base64 for binary formats."""
    return base64.b64encode(ccp4).decode("ascii")


# --------------------------------------------------------------------------- atoms and focus


def atoms_within(xyz: torch.Tensor, centre: np.ndarray, distance: float) -> np.ndarray:
    """Atoms within ``distance`` Å of any of the atoms ``centre`` (no periodic images).

    Parameters
    ----------
    xyz : torch.Tensor, shape (N, 3), float, Å
    centre : numpy.ndarray, shape (M,), int
        Indices into ``xyz``, M ≥ 1; they are always part of the answer.
    distance : float
        Å, ≥ 0.

    Returns
    -------
    numpy.ndarray, shape (K,), int64
        Ascending indices into ``xyz``.
    """
    x = xyz.detach().cpu()
    d = torch.cdist(x, x[torch.as_tensor(np.asarray(centre), dtype=torch.long)]).min(dim=1).values
    return np.nonzero((d <= distance).numpy())[0]


def shown_atoms(xyz: torch.Tensor, region: np.ndarray | None, padding: float) -> np.ndarray:
    """The atoms the 3D view shows with a region: all (None), or the residue ``region``
    and every atom within ``padding`` Å of it (ascending indices)."""
    if region is None:
        return np.arange(len(xyz))
    return atoms_within(xyz, region, padding)


def focus_sphere(
    xyz: torch.Tensor, shown: np.ndarray, margin: float = VIEW_MARGIN, centre_on: np.ndarray | None = None
) -> list[float]:
    """The sphere the camera fits: ``[cx, cy, cz, radius]`` Å.

    Centred on the middle of the bounding box of the atoms ``centre_on`` (default: those
    ``shown``; indices into ``xyz`` (N, 3) Å) and reaching ``margin`` Å past the farthest
    atom shown. A chosen residue is centred even when its neighbours lie to one side (a
    water at the surface).
    """
    all_xyz = xyz.detach().to("cpu", torch.float64).numpy()
    pts = all_xyz[np.asarray(shown, int)]
    if not len(pts):
        return [0.0, 0.0, 0.0, 10.0]
    middle = pts if centre_on is None or not len(centre_on) else all_xyz[np.asarray(centre_on, int)]
    centre = 0.5 * (middle.min(axis=0) + middle.max(axis=0))
    radius = float(np.sqrt(((pts - centre) ** 2).sum(axis=1).max())) + margin
    return [*map(float, centre), radius]


def residue_of_atom(model: Model, index: int) -> str:
    """The region key (``"chain/seq[icode]"``) of atom ``index``'s residue."""
    from workbench.compute.atoms import _residue_key

    if not 0 <= index < len(model):
        raise WorkbenchError(f"atom {index} is not in the model (0 … {len(model) - 1})")
    return _residue_key(model.atoms.labels[index])


@dataclasses.dataclass(frozen=True)
class AtomPick:
    """What the 3D view says about a picked atom (its label at the atom).

    Attributes
    ----------
    index : int
        The atom's index in the model.
    xyz : tuple of 3 float
        Its position as drawn (distortion applied), Å.
    name : str
        ``"A/PHE 14/CA"``: chain, residue, atom (and altloc).
    b : float
        Its B in Å²; for an anisotropic atom B_eq = 8π²·U_eq, with U_eq the mean of U's diagonal.
    anisotropic : bool
        Whether ``b`` is a B_eq from an anisotropic U.
    occupancy : float
    rho : float or None
        ρ at the atom (tricubic), in ``units``; None when not computed.
    units : str
        The unit of ``rho``.
    gradient_norm : float or None
        |∂loss/∂xyz| of the atom, in ``gradient_units``; None without a gradient.
    gradient_kind, gradient_units : str
        Which loss the gradient is of (``"planarity"``, ``"density"``) and its unit.
    """

    index: int
    xyz: tuple
    name: str
    b: float
    anisotropic: bool
    occupancy: float
    rho: float | None
    units: str
    gradient_norm: float | None
    gradient_kind: str
    gradient_units: str

    def lines(self) -> list[str]:
        """The label's lines: the name, then B/occupancy, then ρ and |∇|."""
        b = f"B_eq {self.b:.1f} Å² (U_eq {self.b / U_TO_B:.4f} Å²)" if self.anisotropic else f"B {self.b:.1f} Å²"
        rho = f"ρ {self.rho:.3g} {self.units}" if self.rho is not None else "ρ not computed"
        grad = (
            f"|∇| {self.gradient_norm:.3g} {self.gradient_units} ({self.gradient_kind})"
            if self.gradient_norm is not None
            else "no gradient"
        )
        return [f"#{self.index} {self.name}", f"{b}, occupancy {self.occupancy:.2f}", f"{rho}, {grad}"]

    def text(self) -> str:
        """The label as one line."""
        return " · ".join(self.lines())


def atom_pick(
    atoms: AtomSet, index: int, *, rho=None, gradient: GradientResult | None = None, units: str = "e/Å³"
) -> AtomPick:
    """Describe atom ``index`` of ``atoms`` (as splatted) for its label in the 3D view.

    ``rho`` is ρ at every atom (shape (N,), :attr:`Result.atom_rho`) or None; ``gradient``
    gives |∇| of the atom. Raises WorkbenchError for an index outside the atoms.
    """
    n = len(atoms)
    if not 0 <= index < n:
        raise WorkbenchError(f"atom {index} is not in the model (0 … {n - 1})")
    aniso = atoms.aniso is not None and bool(atoms.aniso[index])
    if aniso:
        b = float(atoms.u_aniso[index, :3].double().mean()) * U_TO_B
    else:
        b = float(atoms.b_iso[index])
    grad = None if gradient is None else float(np.linalg.norm(np.asarray(gradient.grad)[index]))
    return AtomPick(
        index=index,
        xyz=tuple(float(v) for v in atoms.xyz[index]),
        name=str(atoms.labels[index]) if len(atoms.labels) > index else f"atom {index}",
        b=b,
        anisotropic=aniso,
        occupancy=float(atoms.occ[index]),
        rho=None if rho is None else float(rho[index]),
        units=units,
        gradient_norm=grad,
        gradient_kind="" if gradient is None else gradient.kind,
        gradient_units="" if gradient is None else gradient.units,
    )


def focus_selection(model: Model, region: str) -> dict:
    """The 3Dmol.js selection to zoom to: ``{}`` (everything) or the residue's chain and number."""
    if not region:
        return {}
    lab = model.atoms.labels[int(region_atoms(model, region)[0])]
    return {"chain": lab.chain, "resi": lab.seq_num}


# --------------------------------------------------------------------------- arrows


def gradient_arrows(
    xyz: np.ndarray, grad: np.ndarray, kind: str, units: str, *, hint: str = "no distortion? drag 'distort'"
) -> tuple[np.ndarray, str]:
    """Arrows along −∇ at a fixed physical scale, and the caption that states it.

    Parameters
    ----------
    xyz : numpy.ndarray, shape (N, 3), Å
        Atom positions.
    grad : numpy.ndarray, shape (N, 3)
        Gradient of the loss per atom, in ``units``.
    kind : str
        ``"planarity"`` or ``"density"`` (picks :data:`ARROW_SCALE`).
    units : str
    hint : str
        Said when no atom gets an arrow (what would make some); "" says only that there are none.

    Returns
    -------
    arrows : numpy.ndarray, shape (M, 6), float32
        Start xyz and end xyz in Å, longest first; only atoms whose arrow would be at
        least :data:`ARROW_MIN_LENGTH` Å, at most :data:`MAX_ARROWS`, each clipped to
        :data:`ARROW_MAX_LENGTH` Å.
    caption : str
    """
    scale = ARROW_SCALE[kind]
    norms = np.linalg.norm(grad, axis=1) if len(grad) else np.zeros(0)
    lengths = norms * scale
    keep = np.nonzero(lengths >= ARROW_MIN_LENGTH)[0]
    keep = keep[np.argsort(-lengths[keep], kind="stable")][:MAX_ARROWS]
    clip = np.minimum(1.0, ARROW_MAX_LENGTH / np.maximum(lengths[keep], 1e-30))
    start = xyz[keep]
    end = start - grad[keep] * (scale * clip)[:, None]  # −∇: the way the loss pulls each atom
    arrows = np.hstack([start, end]).astype(np.float32).reshape(-1, 6)
    gmax = float(norms.max()) if len(norms) else 0.0
    n_clipped = int((clip < 1.0).sum())
    text = (
        f"arrows (magenta): −∇ of the {kind} loss, 1 Å of arrow = {1 / scale:.4g} {units}; "
        f"drawn where |∇| ≥ {ARROW_MIN_LENGTH / scale:.3g} {units} ({ARROW_MIN_LENGTH:g} Å): "
        f"{len(keep)} of {count(len(norms), 'atom')}, largest |∇| {gmax:.3g} {units}"
    )
    if n_clipped:
        text += f", {n_clipped} clipped at {ARROW_MAX_LENGTH:g} Å"
    if len(norms) > 0 and len(keep) == 0:
        text += f": no arrows ({hint})" if hint else ": no arrows"
    return arrows, text


def arrow_bytes(segments: np.ndarray) -> bytes:
    """Arrow segments (M, 6) as the float32 bytes the 3D view's ``arrows`` trait carries."""
    return np.ascontiguousarray(segments, dtype=np.float32).tobytes()


def position_bytes(xyz: torch.Tensor) -> bytes:
    """Positions ``xyz`` (N, 3) Å as float32 bytes, atom by atom (the 3D view's ``model_xyz``)."""
    return xyz.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def arrow_segments(data: bytes) -> np.ndarray:
    """The inverse of :func:`arrow_bytes`: float32 array of shape (M, 6), start xyz and end xyz in Å."""
    return np.frombuffer(data, dtype=np.float32).reshape(-1, 6)


@dataclasses.dataclass(frozen=True, eq=False)
class Arrows:
    """Gradient arrows for the 3D view.

    Attributes
    ----------
    segments : numpy.ndarray, shape (M, 6), float32
        Start xyz and end xyz in Å (:func:`gradient_arrows`).
    scale : float
        Å of arrow per unit of gradient; 0 when there is no gradient.
    caption : str
        The scale and how many atoms got an arrow, or why there are none.
    """

    segments: np.ndarray
    scale: float
    caption: str

    def to_bytes(self) -> bytes:
        """``segments`` as :func:`arrow_bytes`."""
        return arrow_bytes(self.segments)


def region_arrows(
    xyz: torch.Tensor,
    gradient: GradientResult | None,
    region: np.ndarray | None,
    padding: float,
    *,
    missing: str = "no gradient",
    hint: str = "no distortion? drag 'distort'",
) -> Arrows:
    """The arrows of the atoms shown with a region: every atom within ``padding`` Å of it.

    Parameters
    ----------
    xyz : torch.Tensor, shape (N, 3), float64, Å
    gradient : GradientResult or None
        None draws no arrows; the caption then says ``missing``.
    hint : str
        :func:`gradient_arrows`'s, for a gradient under the arrows' threshold everywhere.
    region : numpy.ndarray, shape (M,), int, or None
        The residue's atom indices; None for the whole model. The neighbours of a residue
        get arrows too, since their pull shows in the same map box.
    padding : float
        Å, the map box's margin around the region.
    """
    if gradient is None:
        return Arrows(segments=np.zeros((0, 6), np.float32), scale=0.0, caption=f"no arrows ({missing})")
    sel = np.arange(len(xyz)) if region is None else atoms_within(xyz, region, padding)
    points = xyz.detach().to("cpu", torch.float64).numpy()[sel]
    segments, caption = gradient_arrows(points, gradient.grad[sel], gradient.kind, gradient.units, hint=hint)
    return Arrows(segments=segments, scale=ARROW_SCALE[gradient.kind], caption=caption)


# --------------------------------------------------------------------------- ADP ellipsoids

# The 50 % probability surface of a 3-D normal distribution of covariance U is
# xᵀU⁻¹x = k² with P(χ²₃ ≤ k²) = ½: k² = 2.3660, k = 1.5382 (ORTEP's 50 % ellipsoids).
# Each semi-axis is k·√λ along U's eigenvector of eigenvalue λ.
ELLIPSOID_SCALE = 1.5382
# Each ellipsoid is 42 vertices and 80 triangles in 3Dmol.js: ~2.5 kB to send, and a
# software-WebGL page draws a thousand of them without stalling.
MAX_ELLIPSOIDS = 1000
# 3Dmol.js indexes a custom shape's triangles with 16 bits: each chunk stays below this many vertices.
MESH_CHUNK_VERTICES = 60_000
# Jmol's element colours (what 3Dmol.js gives the sticks); other elements pink.
_ELEMENT_COLOURS = {
    "H": "#ffffff", "C": "#909090", "N": "#3050f8", "O": "#ff0d0d", "S": "#ffff30", "P": "#ff8000",
    "Cl": "#1ff01f", "F": "#90e050", "Br": "#a62929", "I": "#940094", "Fe": "#e06633", "Zn": "#7d80b0",
    "Mg": "#8aff00", "Ca": "#3dff00", "Na": "#ab5cf2", "K": "#8f40d4", "Se": "#ffa100",
}  # fmt: skip
_OTHER_COLOUR = "#ff1493"


def element_colour(element: str) -> tuple[float, float, float]:
    """RGB in [0, 1] of an element symbol (Jmol's colours; pink for one not in the table)."""
    hexa = _ELEMENT_COLOURS.get(element.capitalize(), _OTHER_COLOUR)
    return tuple(int(hexa[i : i + 2], 16) / 255.0 for i in (1, 3, 5))


def unit_sphere(subdivisions: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A triangulated unit sphere: an icosahedron with each triangle split in four ``subdivisions`` times.

    Returns
    -------
    vertices : numpy.ndarray, shape (V, 3), float64
        On the unit sphere; V = 10·4ⁿ + 2 (42 for one subdivision).
    faces : numpy.ndarray, shape (F, 3), int64
        Vertex indices, counter-clockwise seen from outside; F = 20·4ⁿ.
    """
    t = (1 + 5**0.5) / 2
    verts = [(-1, t, 0), (1, t, 0), (-1, -t, 0), (1, -t, 0), (0, -1, t), (0, 1, t),
             (0, -1, -t), (0, 1, -t), (t, 0, -1), (t, 0, 1), (-t, 0, -1), (-t, 0, 1)]  # fmt: skip
    faces = [(0, 11, 5), (0, 5, 1), (0, 1, 7), (0, 7, 10), (0, 10, 11), (1, 5, 9), (5, 11, 4), (11, 10, 2),
             (10, 7, 6), (7, 1, 8), (3, 9, 4), (3, 4, 2), (3, 2, 6), (3, 6, 8), (3, 8, 9), (4, 9, 5),
             (2, 4, 11), (6, 2, 10), (8, 6, 7), (9, 8, 1)]  # fmt: skip
    points = [np.asarray(v, np.float64) / np.linalg.norm(v) for v in verts]
    for _ in range(subdivisions):
        middle: dict[tuple[int, int], int] = {}  # edge -> its new midpoint vertex, shared by both faces
        split = []
        for a, b, c in faces:
            mids = []
            for i, j in ((a, b), (b, c), (c, a)):
                key = (min(i, j), max(i, j))
                if key not in middle:
                    p = points[i] + points[j]
                    points.append(p / np.linalg.norm(p))
                    middle[key] = len(points) - 1
                mids.append(middle[key])
            ab, bc, ca = mids
            split += [(a, ab, ca), (b, bc, ab), (c, ca, bc), (ab, bc, ca)]
        faces = split
    return np.array(points), np.array(faces, dtype=np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class Ellipsoids:
    """ADP ellipsoids of some atoms: where they are and their principal axes.

    Attributes
    ----------
    index : numpy.ndarray, shape (M,), int64
        The atoms (indices into the AtomSet).
    centres : numpy.ndarray, shape (M, 3), float64, Å
    eigenvalues : numpy.ndarray, shape (M, 3), float64, Å²
        Of each atom's U, ascending (B/8π² three times for an isotropic atom).
    directions : numpy.ndarray, shape (M, 3, 3), float64
        Column k is the unit eigenvector of eigenvalue k (a right-handed frame).
    radii : numpy.ndarray, shape (M, 3), float64, Å
        Semi-axis lengths: ``scale``·√eigenvalue.
    anisotropic : numpy.ndarray, shape (M,), bool
        The atom has its own U (an ellipsoid); otherwise a sphere from its B.
    colours : numpy.ndarray, shape (M, 3), float64
        RGB in [0, 1] by element (:func:`element_colour`).
    scale : float
        k of the surface xᵀU⁻¹x = k² (:data:`ELLIPSOID_SCALE` for 50 % probability).
    n_dropped : int
        Atoms asked for but left out: beyond :data:`MAX_ELLIPSOIDS`.
    """

    index: np.ndarray
    centres: np.ndarray
    eigenvalues: np.ndarray
    directions: np.ndarray
    radii: np.ndarray
    anisotropic: np.ndarray
    colours: np.ndarray
    scale: float
    n_dropped: int = 0

    def __len__(self) -> int:
        return len(self.index)

    @property
    def axes(self) -> np.ndarray:
        """Principal semi-axes, shape (M, 3, 3), Å: column k is ``radii[:, k]`` × ``directions[..., k]``,
        so ``axes @ axesᵀ = scale²·U``."""
        return self.directions * self.radii[:, None, :]


def adp_ellipsoids(
    atoms: AtomSet, index=None, *, scale: float = ELLIPSOID_SCALE, max_count: int = MAX_ELLIPSOIDS
) -> Ellipsoids:
    """The 50 % probability ellipsoids of ``atoms[index]`` (all atoms by default).

    Anisotropic atoms (``atoms.aniso``) use their U; the others the sphere of U = B/(8π²)·I
    (:func:`kernels.adp.effective_u`'s rule), so a mixed model shows both. At most
    ``max_count`` atoms, the first ones of ``index``; ``n_dropped`` counts the rest.

    Raises
    ------
    WorkbenchError
        An atom's U is not positive definite (no ellipsoid has that shape), named.
    """
    from kernels.adp import effective_u

    idx = np.arange(len(atoms)) if index is None else np.asarray(index, np.int64).reshape(-1)
    dropped = max(0, len(idx) - max_count)
    idx = idx[:max_count]
    t = torch.as_tensor(idx, dtype=torch.long)
    b = atoms.b_iso.detach().to("cpu", torch.float64)[t]
    if atoms.u_aniso is not None:
        flag = atoms.aniso.detach().cpu()[t]
        u = atoms.u_aniso.detach().to("cpu", torch.float64)[t]
    else:
        flag = torch.zeros(len(idx), dtype=torch.bool)
        u = torch.zeros((len(idx), 6), dtype=torch.float64)
    u6 = effective_u(u, flag, b)
    lam, vec = torch.linalg.eigh(u_matrix(u6))
    lam, vec = lam.numpy(), vec.numpy()
    bad = ~(np.isfinite(lam).all(axis=1) & (lam[:, 0] > 0))
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise WorkbenchError(
            f"atom {atoms.labels[idx[i]]} has a U that is not positive definite (eigenvalues "
            f"{', '.join(f'{v:.4g}' for v in lam[i])} Å²): no ellipsoid has that shape; choose ADP 'isotropic'"
        )
    # a right-handed frame, so the triangles keep their outward winding after the transform
    vec[:, :, 2] *= np.sign(np.linalg.det(vec))[:, None]
    centres = atoms.xyz.detach().to("cpu", torch.float64).numpy()[idx]
    colours = np.array([element_colour(atoms.elements[i]) for i in idx]).reshape(-1, 3)
    return Ellipsoids(
        index=idx, centres=centres, eigenvalues=lam, directions=vec, radii=scale * np.sqrt(lam),
        anisotropic=flag.numpy(), colours=colours, scale=float(scale), n_dropped=dropped,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class EllipsoidMesh:
    """Ellipsoids as triangle meshes, in one-colour chunks 3Dmol.js can draw (``addCustom``).

    3Dmol.js (2.5) colours a custom shape with one colour (its per-vertex ``colorArr`` is drawn
    black), and indexes a shape's vertices with 16 bits: so the ellipsoids are grouped by
    colour, and each group split into chunks of fewer than :data:`MESH_CHUNK_VERTICES` vertices.

    Attributes
    ----------
    vertices : numpy.ndarray, shape (V, 6), float32
        Per vertex: position xyz (Å) and unit outward normal xyz; the ellipsoids in the
        order ``order``, each a block of ``per_ellipsoid[0]`` rows.
    faces : numpy.ndarray, shape (F, 3), uint32
        Vertex indices *within the triangle's chunk* (counter-clockwise seen from outside).
    chunks : list of (v0, v1, f0, f1, colour)
        Vertex rows v0:v1 and face rows f0:f1 of each chunk, and its colour as 0xRRGGBB.
    order : numpy.ndarray, shape (M,), int64
        Position in the :class:`Ellipsoids` of each block of vertices.
    per_ellipsoid : tuple of (int, int)
        Vertices and faces of one ellipsoid.
    """

    vertices: np.ndarray
    faces: np.ndarray
    chunks: list
    order: np.ndarray
    per_ellipsoid: tuple[int, int]

    def vertex_bytes(self) -> bytes:
        """``vertices`` as the float32 bytes the 3D view's ``ellipsoid_vertices`` trait carries."""
        return np.ascontiguousarray(self.vertices, dtype=np.float32).tobytes()

    def face_bytes(self) -> bytes:
        """``faces`` as the uint32 bytes the 3D view's ``ellipsoid_faces`` trait carries."""
        return np.ascontiguousarray(self.faces, dtype=np.uint32).tobytes()


def ellipsoid_arrays(vertex_bytes: bytes, face_bytes: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :meth:`EllipsoidMesh.vertex_bytes` and :meth:`EllipsoidMesh.face_bytes`:
    float32 vertices of shape (V, 6) and uint32 faces of shape (F, 3)."""
    v = np.frombuffer(vertex_bytes, dtype=np.float32).reshape(-1, 6)
    f = np.frombuffer(face_bytes, dtype=np.uint32).reshape(-1, 3)
    return v, f


def ellipsoid_mesh(ellipsoids: Ellipsoids, subdivisions: int = 1) -> EllipsoidMesh:
    """Each ellipsoid as the unit sphere (:func:`unit_sphere`) mapped by its axes: x = c + A·s.

    The normal at x is A⁻ᵀ·s (the gradient of sᵀs = (x − c)ᵀA⁻ᵀA⁻¹(x − c)), normalised, so the
    shading follows the ellipsoid's own curvature, not the sphere's.
    """
    sphere, tri = unit_sphere(subdivisions)
    nv, nf = len(sphere), len(tri)
    rgb = np.rint(np.asarray(ellipsoids.colours, np.float64).reshape(-1, 3) * 255).astype(np.int64)
    key = (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]
    order = np.argsort(key, kind="stable")
    axes = ellipsoids.axes[order]  # (M, 3, 3)
    pos = ellipsoids.centres[order][:, None, :] + np.einsum("mij,vj->mvi", axes, sphere)
    # A = V·diag(r), so A⁻ᵀ = V·diag(1/r)
    inv_t = ellipsoids.directions[order] / ellipsoids.radii[order][:, None, :]
    normal = np.einsum("mij,vj->mvi", inv_t, sphere)
    normal /= np.linalg.norm(normal, axis=-1, keepdims=True)
    vertices = np.concatenate([pos, normal], axis=-1).reshape(-1, 6).astype(np.float32)
    per_chunk = max(1, MESH_CHUNK_VERTICES // nv)
    faces, chunks = [], []
    sorted_key = key[order]
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and stop - start < per_chunk and sorted_key[stop] == sorted_key[start]:
            stop += 1
        faces.append((np.arange(stop - start)[:, None, None] * nv + tri[None]).reshape(-1, 3))
        chunks.append((start * nv, stop * nv, start * nf, stop * nf, int(sorted_key[start])))
        start = stop
    face_array = np.concatenate(faces).astype(np.uint32) if faces else np.zeros((0, 3), np.uint32)
    return EllipsoidMesh(vertices=vertices, faces=face_array, chunks=chunks, order=order, per_ellipsoid=(nv, nf))
