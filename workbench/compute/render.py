"""A section → what the slice view draws: a smooth raster in Å, σ contours, atom marks.

The grid section (:class:`~workbench.compute.Section`, one value per voxel) is resampled
on a raster of square pixels of the section's own Cartesian frame by tricubic
(Catmull-Rom) interpolation with :func:`kernels.tricubic_sample`, so the picture is
smooth at display resolution and the cell's true angles are kept: an oblique cell face
is a parallelogram of pixels, and pixels outside it are NaN (drawn transparent).

The section is handed to the kernel as a periodic map one voxel thick along the
section normal, on a unit cube cell: Catmull-Rom interpolation runs along the grid axes
in fractional coordinates, so in-plane it is exactly the 3-D tricubic interpolation of
the whole map at that plane (along the normal all four neighbours are the plane itself),
while only the section ever crosses to the host. At a grid node the interpolant equals
the voxel value.

Contours are lines of the raster at ``mean + n·σ`` of the whole map (as Coot draws
maps), found with contourpy (matplotlib's own contour generator), in Å of the section
frame.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

import kernels
from kernels import Cell, GridSpec
from workbench.compute.errors import WorkbenchError
from workbench.compute.sections import Section

__all__ = [
    "ELEMENT_COLOURS",
    "SECTION_PIXELS",
    "AtomMarks",
    "Contour",
    "SectionImage",
    "atom_marks",
    "render_section",
    "section_contours",
    "section_fractions",
    "sample_section",
]

# Pixels along the longer side of the raster: about the size the face is drawn at (the
# figure is 600 px wide); a 0.67-Å-spaced 40-Å cell gets ~5 pixels per voxel.
SECTION_PIXELS = 320

# Mark colours of the atoms near the plane (Coot/Jmol-like: C grey, N blue, O red, S yellow).
ELEMENT_COLOURS = {"C": "#d0d0d0", "N": "#6f8fff", "O": "#ff5050", "S": "#ffd030", "P": "#ff9000"}
_OTHER_COLOUR = "#ff80ff"

# One unit cube: fractional = Cartesian, so the kernel interpolates in grid fractions.
_UNIT = Cell.from_parameters(1.0, 1.0, 1.0)


@dataclasses.dataclass(frozen=True, eq=False)
class Contour:
    """The lines of one contour level.

    Attributes
    ----------
    sigma : float
        The level in σ above the map mean (negative: below it).
    level : float
        The level in e/Å³.
    lines : list of numpy.ndarray, each shape (K, 2), float64, Å in the section frame
    """

    sigma: float
    level: float
    lines: list


@dataclasses.dataclass(frozen=True, eq=False)
class SectionImage:
    """A section resampled on square pixels of its Cartesian frame.

    Attributes
    ----------
    values : numpy.ndarray, shape (ny, nx), float32
        Row ``r`` is ``y = extent[2] + (r + 0.5)·pixel``; NaN outside the cell face.
    extent : tuple of 4 float
        ``(x0, x1, y0, y1)`` Å, the outer edges of the raster (matplotlib ``imshow`` order).
    pixel : float
        Å per pixel, the same along x and y.
    contours : list of Contour
    vmin, vmax : float
        Range of the resampled face, e/Å³.
    """

    values: np.ndarray
    extent: tuple[float, float, float, float]
    pixel: float
    contours: list
    vmin: float
    vmax: float

    @property
    def n_lines(self) -> int:
        """Contour polylines over every level."""
        return sum(len(c.lines) for c in self.contours)


def _raster(sec: Section, pixels: int, pixel: float | None = None, anchor=None):
    corners = sec.corners
    lo, hi = corners.min(axis=0), corners.max(axis=0)
    if pixel is None:
        pixel = float((hi - lo).max()) / pixels
    if anchor is not None:
        # pixel edges on anchor + k·pixel: the raster's pixels are the display's pixels
        ax, ay = anchor
        lo = np.array([ax + np.floor((lo[0] - ax) / pixel) * pixel, ay + np.floor((lo[1] - ay) / pixel) * pixel])
    nx = max(2, int(np.ceil((hi[0] - lo[0]) / pixel - 1e-9)))
    ny = max(2, int(np.ceil((hi[1] - lo[1]) / pixel - 1e-9)))
    x = lo[0] + (np.arange(nx) + 0.5) * pixel
    y = lo[1] + (np.arange(ny) + 0.5) * pixel
    return x, y, pixel, (float(lo[0]), float(lo[0] + nx * pixel), float(lo[1]), float(lo[1] + ny * pixel))


def section_fractions(sec: Section, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fractional in-plane coordinates ``(fu, fv)`` of section-frame points ``(x, y)`` Å.

    Inverts ``(x, y) = fu · e_u + fv · e_v`` (``e_u`` lies along x). Any matching shapes.
    """
    fv = np.asarray(y, np.float64) / sec.e_v[1]
    fu = (np.asarray(x, np.float64) - fv * sec.e_v[0]) / sec.e_u[0]
    return fu, fv


def sample_section(sec: Section, fu: np.ndarray, fv: np.ndarray, *, backend: str = "cpu") -> np.ndarray:
    """Tricubic (Catmull-Rom) values of the section at fractional in-plane points.

    Periodic in ``fu`` and ``fv``; at ``(p/n_u, q/n_v)`` the value is ``sec.values[p, q]``.

    Parameters
    ----------
    sec : Section
    fu, fv : numpy.ndarray, any matching shape
        Fractions along the section's first and second in-plane cell axes.
    backend : str
        :func:`kernels.tricubic_sample` backend (the section is on the host: ``cpu``).

    Returns
    -------
    numpy.ndarray, shape fu.shape, float32
    """
    n_u, n_v = sec.values.shape
    rho = torch.from_numpy(np.ascontiguousarray(sec.values, dtype=np.float32)).reshape(n_u, n_v, 1)
    grid = GridSpec(_UNIT, (n_u, n_v, 1))
    fu = np.asarray(fu, np.float64)
    pts = np.stack([fu, np.asarray(fv, np.float64), np.zeros_like(fu)], axis=-1)
    out = kernels.tricubic_sample(rho, grid, torch.from_numpy(pts.astype(np.float32)), backend=backend)
    return out.numpy().astype(np.float32, copy=False)


@functools.lru_cache(maxsize=8)
def _face_plan(n_u: int, e_u: tuple, e_v: tuple, x: tuple, y: tuple):
    """What the resampling of a face on a raster reuses while only the values change:
    the rows crossing the face, the pixels on it, and their 1-D Catmull-Rom stencils
    along u (flat indices into the (n_u, rows) v-interpolated table and weights).

    Keyed on the geometry alone (tuples), so stepping through sections or B-factors of
    one grid computes it once.
    """
    x, y = np.asarray(x), np.asarray(y)
    fv_rows = y / e_v[1]
    eps = 1e-9
    rows = np.nonzero((fv_rows >= -eps) & (fv_rows < 1 + eps))[0]
    fv = fv_rows[rows]
    fu = (x[None, :] - fv[:, None] * e_v[0]) / e_u[0]  # section_fractions, row by row
    r, c = np.nonzero((fu >= -eps) & (fu < 1 + eps))
    t = fu[r, c] * n_u
    i = np.floor(t)
    t -= i
    i = i.astype(np.intp)
    stencil = np.stack([((i + k) % n_u) * len(rows) + r for k in (-1, 0, 1, 2)])
    # Catmull-Rom weights of the kernel (kernels.tricubic.reference._catmull_rom_1d)
    weights = np.stack(
        [
            0.5 * (-t + 2 * t**2 - t**3),
            0.5 * (2 - 5 * t**2 + 3 * t**3),
            0.5 * (t + 4 * t**2 - 3 * t**3),
            0.5 * (t**3 - t**2),
        ]
    )
    pixels = rows[r] * len(x) + c
    for a in (rows, fv, stencil, weights, pixels):
        a.flags.writeable = False
    return rows, fv, stencil, weights, pixels


def _resample_face(sec: Section, x: np.ndarray, y: np.ndarray, backend: str) -> np.ndarray:
    """Catmull-Rom values of the face on the raster ``x`` × ``y`` Å; NaN off the face.

    Tensor-product Catmull-Rom is separable, and ``fv`` is constant along a raster row
    (``y = fv · e_v[1]``): the kernel interpolates along v once per row at every u node
    (n_u · rows points: at a node the u weights are 0, 1, 0, 0), then each pixel takes the
    1-D Catmull-Rom along u of its row. Equal to sampling every pixel with the kernel, at
    a fraction of its points (a 400-pixel face over 60 voxels: about 7× fewer).
    """
    n_u = sec.values.shape[0]
    rows, fv, stencil, weights, pixels = _face_plan(
        n_u, tuple(map(float, sec.e_u)), tuple(map(float, sec.e_v)), tuple(map(float, x)), tuple(map(float, y))
    )
    values = np.full(len(y) * len(x), np.nan, np.float32)
    if len(rows):
        pu, pv = np.meshgrid(np.arange(n_u) / n_u, fv, indexing="ij")
        along_v = sample_section(sec, pu, pv, backend=backend).ravel()  # (n_u, rows), flat
        values[pixels] = np.einsum("kp,kp->p", weights, along_v[stencil])
    return values.reshape(len(y), len(x))


def section_contours(
    x: np.ndarray, y: np.ndarray, values: np.ndarray, sigmas, mean: float, sigma: float
) -> list[Contour]:
    """Contour lines of a raster at ``mean + s·sigma`` for each ``s`` in ``sigmas``.

    ``values`` has shape (len(y), len(x)), NaN where there is no data. A level no value
    reaches has no lines (still listed, so the caption can say so).
    """
    import contourpy

    if not len(sigmas):
        return []
    z = np.ma.masked_invalid(values)
    gen = contourpy.contour_generator(x, y, z, line_type=contourpy.LineType.Separate)
    out = []
    for s in sigmas:
        level = float(mean + s * sigma)
        lines = [np.asarray(seg, np.float64) for seg in gen.lines(level) if len(seg) > 1]
        out.append(Contour(sigma=float(s), level=level, lines=lines))
    return out


def render_section(
    sec: Section,
    *,
    mean: float | None = None,
    sigma: float | None = None,
    contour_sigmas=(),
    pixels: int = SECTION_PIXELS,
    pixel: float | None = None,
    anchor: tuple[float, float] | None = None,
    backend: str = "cpu",
) -> SectionImage:
    """Resample ``sec`` at display resolution and contour it.

    Parameters
    ----------
    sec : Section
    mean, sigma : float, optional
        Mean and standard deviation of the whole map, e/Å³ (needed for contours).
    contour_sigmas : sequence of float
        Contour levels in σ above the mean; empty for none.
    pixels : int
        Pixels along the longer side of the face's bounding box (when ``pixel`` is not given).
    pixel : float, optional
        Å per pixel instead: the scale the face is drawn at, so that each raster pixel is
        one display pixel (no resampling when drawn).
    anchor : (float, float), optional
        A point, Å in the section frame, on pixel edges: the raster's pixel edges lie at
        ``anchor + k·pixel`` (a display pixel's corner, for a one-to-one drawing).
    backend : str
        :func:`kernels.tricubic_sample` backend.
    """
    if pixels < 2:
        raise WorkbenchError(f"a section needs at least 2 pixels, got {pixels}")
    if pixel is not None and not (pixel > 0 and np.isfinite(pixel)):
        raise WorkbenchError(f"pixel size must be a positive number of Å, got {pixel!r}")
    x, y, pixel, extent = _raster(sec, pixels, pixel, anchor)
    values = _resample_face(sec, x, y, backend)
    inside = np.isfinite(values)
    face = values[inside]
    vmin, vmax = (float(face.min()), float(face.max())) if face.size else (0.0, 0.0)
    contours: list[Contour] = []
    if len(contour_sigmas):
        if mean is None or sigma is None:
            raise WorkbenchError("contours at σ levels need the map's mean and σ")
        contours = section_contours(x, y, values, contour_sigmas, mean, sigma)
    return SectionImage(values=values, extent=extent, pixel=pixel, contours=contours, vmin=vmin, vmax=vmax)


@dataclasses.dataclass(frozen=True, eq=False)
class AtomMarks:
    """Marks on a section plane (the atoms near it, or voxels of a difference over tolerance).

    Attributes
    ----------
    uv : numpy.ndarray, shape (M, 2), Å in the section frame
    sizes : numpy.ndarray, shape (M,), points² (matplotlib ``scatter`` sizes)
        Largest on the plane, shrinking with the distance from it.
    colours : list of str
        One colour per mark, by element.
    noun : str
        What one mark is, singular ("atom", "voxel"): the caption counts marks by it.
    where : str
        Which of them are marked ("within 1 Å of the plane", "over tolerance"), for the caption.
    """

    uv: np.ndarray
    sizes: np.ndarray
    colours: list
    noun: str = "atom"
    where: str = "within 1 Å of the plane"


def atom_marks(near, elements, tolerance: float = 1.0, size: float = 40.0) -> AtomMarks:
    """Marks for :func:`~workbench.compute.atoms_near_section`'s ``near`` = (index, uv, distance).

    ``elements`` gives every atom's element symbol; a mark's area falls from ``size`` on
    the plane to a quarter of it at ``tolerance`` Å.
    """
    idx, uv, dist = near
    idx = np.asarray(idx, int)
    frac = np.clip(np.asarray(dist, float) / max(tolerance, 1e-9), 0.0, 1.0)
    sizes = size * (1.0 - 0.75 * frac)
    colours = [ELEMENT_COLOURS.get(str(elements[i]).strip().capitalize(), _OTHER_COLOUR) for i in idx]
    return AtomMarks(
        uv=np.asarray(uv, float).reshape(-1, 2),
        sizes=sizes,
        colours=colours,
        where=f"within {tolerance:g} Å of the plane",
    )
