"""Map → sections: one grid plane in Å with the cell's true angles, and the atoms near it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from kernels import GridSpec
from workbench.compute.errors import WorkbenchError

__all__ = [
    "EMPTY_SECTION_FRACTION",
    "Section",
    "atoms_near_section",
    "central_depth",
    "central_index",
    "section",
    "section_depth",
    "section_index",
    "section_is_empty",
]

# A section whose maximum is below this fraction of the map maximum holds no density a
# person could see (the model's tails, 1e-9 e/Å³): the app says so in its status line.
EMPTY_SECTION_FRACTION = 0.01


@dataclasses.dataclass(eq=False)
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
        """The four corners of the cell face, shape (4, 2), float64, Å (for axis limits)."""
        return np.array([[0, 0], self.e_u, self.e_u + self.e_v, self.e_v])

    @property
    def voxel_affine(self) -> np.ndarray:
        """Affine map of voxel indices to the section frame, shape (3, 3), float64.

        ``voxel_affine @ (p, q, 1) = (x, y, 1)`` in Å: voxel (p, q) of ``values`` lands at
        ``p/n_u · e_u + q/n_v · e_v``, so an image drawn in index space and transformed by
        this matrix shows an oblique cell face as the parallelogram it is.
        """
        n_u, n_v = self.values.shape
        return np.array(
            [
                [self.e_u[0] / n_u, self.e_v[0] / n_v, 0.0],
                [self.e_u[1] / n_u, self.e_v[1] / n_v, 0.0],
                [0.0, 0.0, 1.0],
            ]
        )

    @property
    def is_rectangular(self) -> bool:
        """True when the in-plane cell axes are perpendicular (|cos| < 1e-6): both are plot axes."""
        return abs(self._cos_in_plane) < 1e-6

    @property
    def in_plane_angle(self) -> float:
        """Angle between the two in-plane cell axes, degrees (90 for a rectangular face)."""
        return float(np.degrees(np.arccos(np.clip(self._cos_in_plane, -1.0, 1.0))))

    @property
    def _cos_in_plane(self) -> float:
        return float(self.e_v[0] / np.hypot(*self.e_v))


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
    """The section ``index`` perpendicular to cell ``axis`` of a whole-cell map.

    ``rho`` has shape ``grid.shape`` on any device and dtype; only the section crosses
    to the host, as float32.
    """
    if not 0 <= index < grid.shape[axis]:
        raise WorkbenchError(f"slice index {index} outside [0, {grid.shape[axis] - 1}] for grid {grid.shape}")
    values = rho.detach().select(axis, index).to("cpu", torch.float32).numpy()
    in_plane, e_u, e_v = _in_plane_frame(grid, axis)
    depth = section_depth(grid, axis, index)
    return Section(
        values=np.ascontiguousarray(values),
        axis=axis,
        index=index,
        in_plane=in_plane,
        e_u=e_u,
        e_v=e_v,
        depth=depth,
        map_range=map_range,
    )


def section_depth(grid: GridSpec, axis: int, index: int) -> float:
    """Depth in Å of section ``index`` ⊥ cell ``axis``: its distance from the origin plane
    along the plane normal (``index / n`` of the cell's thickness ``1 / |a*|``)."""
    return index / grid.sampling[axis] / grid.cell.reciprocal_lengths[axis]


def section_index(grid: GridSpec, axis: int, depth: float) -> int:
    """Index of the grid section nearest ``depth`` Å ⊥ cell ``axis`` (periodic: any depth maps into the cell).

    The inverse of :func:`section_depth` on the grid's own planes, so a position kept in
    Å lands on the same place in every grid: the nearest plane of a coarse grid, and
    the very same plane again once the fine grid comes back.
    """
    n = grid.shape[axis]
    return int(round(depth * grid.cell.reciprocal_lengths[axis] * grid.sampling[axis])) % n


def central_depth(xyz: torch.Tensor, grid: GridSpec, axis: int) -> float:
    """Depth in Å (in [0, cell thickness)) of the middle of the atoms ``xyz`` (N, 3) Å along ``axis``.

    A circular mean of the fractional coordinates, so a model straddling the cell edge
    (or lying outside the first cell, as most do) still lands on its own middle.
    """
    f = (xyz.detach().to("cpu", torch.float64) @ grid.cell.frac.T)[:, axis].numpy()
    angle = math.atan2(float(np.sin(2 * np.pi * f).mean()), float(np.cos(2 * np.pi * f).mean()))
    return (angle / (2 * np.pi)) % 1.0 / grid.cell.reciprocal_lengths[axis]


def central_index(xyz: torch.Tensor, grid: GridSpec, axis: int) -> int:
    """Index of the section through the middle of the atoms ``xyz`` (N, 3) Å along ``axis``."""
    return section_index(grid, axis, central_depth(xyz, grid, axis))


def section_is_empty(sec: Section) -> bool:
    """True when the section holds no visible density: its maximum is below
    :data:`EMPTY_SECTION_FRACTION` of the whole map's (or it is all ≤ 0)."""
    top = float(sec.values.max()) if sec.values.size else 0.0
    map_top = sec.map_range[1] if sec.map_range is not None else top
    return top <= 0 or top < EMPTY_SECTION_FRACTION * map_top


def atoms_near_section(xyz: torch.Tensor, grid: GridSpec, sec: Section, tolerance: float = 1.0):
    """Atoms ``xyz`` (N, 3) Å within ``tolerance`` Å of the section plane (periodic images included).

    Returns
    -------
    index : numpy.ndarray, shape (M,), int
    uv : numpy.ndarray, shape (M, 2), float64, Å in the section frame
    distance : numpy.ndarray, shape (M,), float64, Å from the plane
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
