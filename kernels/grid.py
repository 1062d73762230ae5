"""Map grids: where each voxel of a map sits in a unit cell, and whether a map of it fits in memory."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from kernels._util import format_size, positive_number
from kernels.cell import Cell

__all__ = ["GridError", "GridSpec", "grid_of"]


class GridError(ValueError):
    """A grid is malformed, or its map would not fit in the memory of the device asked for."""


def _has_small_factors(n: int) -> bool:
    for p in (2, 3, 5):
        while n % p == 0:
            n //= p
    return n == 1


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """Where each voxel of a map sits in a unit cell.

    The cell is sampled ``sampling = (mx, my, mz)`` times along a, b, c. A map on this
    grid has ``shape = (nx, ny, nz)`` voxels starting at voxel ``origin``; voxel
    (i, j, k) of the map sits at fractional position
    ``((origin[0] + i) / mx, (origin[1] + j) / my, (origin[2] + k) / mz)``.
    With the default origin (0, 0, 0) and ``sampling = shape`` the map covers the whole
    cell, which is what crystal maps and the periodic kernels use; a box map (a region
    inside or across cells, as bounded interpolation needs) has its own shape and origin.

    Parameters
    ----------
    cell : Cell
    shape : tuple of 3 int
        Voxels of the map along a, b, c.
    origin : tuple of 3 int, optional
        Voxel index (in the cell's sampling) of the map's first voxel.
    sampling : tuple of 3 int, optional
        Voxels per cell edge; defaults to ``shape``.

    Grids compare and hash by value (cell, shape, origin, sampling).
    """

    cell: Cell
    shape: tuple[int, int, int]
    origin: tuple[int, int, int] = (0, 0, 0)
    sampling: tuple[int, int, int] | None = None

    def __post_init__(self):
        shape = tuple(int(n) for n in self.shape)
        origin = tuple(int(o) for o in self.origin)
        sampling = shape if self.sampling is None else tuple(int(m) for m in self.sampling)
        if len(shape) != 3 or len(origin) != 3 or len(sampling) != 3:
            raise GridError(f"shape, origin and sampling need 3 values each, got {shape}, {origin}, {sampling}")
        if min(shape) < 1 or min(sampling) < 1:
            raise GridError(f"grid shape and sampling must be positive, got shape {shape}, sampling {sampling}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "origin", origin)
        object.__setattr__(self, "sampling", sampling)

    @classmethod
    def for_spacing(cls, cell: Cell, spacing: float, spacegroup: str | None = None) -> GridSpec:
        """The whole-cell grid gemmi picks for a requested spacing.

        Follows gemmi's rule (``Grid.set_size_from_spacing`` rounding up): along each
        axis at least ``edge / spacing`` voxels, rounded up to an even multiple of the
        space group's grid factor times a product of 2, 3 and 5, with symmetry-related
        (or nearly equal) axes sharing a size. So a map made here lines up voxel for
        voxel with gemmi's ``DensityCalculatorX`` at ``spacing = d_min / (2·rate)``.

        Parameters
        ----------
        cell : Cell
        spacing : float
            Requested voxel spacing in Å (an upper bound: the grid is at least this fine).
        spacegroup : str, optional
            Hermann–Mauguin name; the grid is then compatible with its operators
            (needed by :func:`kernels.symmetrize`). P 1 when omitted.
        """
        import gemmi

        try:
            spacing = positive_number(spacing, "spacing", "Å")
        except ValueError as exc:
            raise GridError(f"grid {exc}") from None
        if spacegroup is None:
            ops = gemmi.find_spacegroup_by_name("P 1").operations()
        else:
            sg = gemmi.find_spacegroup_by_name(spacegroup)
            if sg is None:
                raise GridError(f"unknown space group {spacegroup!r}")
            ops = sg.operations()
        factors = list(ops.find_grid_factors())
        limits = [edge / spacing for edge in cell.parameters[:3]]
        if max(limits) > 1e6:
            raise GridError(f"spacing {spacing} Å on cell {cell} asks for over a million voxels per axis")
        # Symmetry-related axes must share a size; nearly equal ones share it for looks.
        same_as = [None, None, None]
        for i in range(1, 3):
            for j in range(i):
                if _directions_related(ops, i, j) or (abs(limits[i] - limits[j]) < 0.5 and factors[i] == factors[j]):
                    limits[j] = max(limits[i], limits[j])
                    same_as[i] = j
                    factors[i] = -1 - j
        sizes = [0, 0, 0]
        for i in range(3):
            if same_as[i] is not None:
                sizes[i] = sizes[same_as[i]]
                continue
            f = factors[i] if factors[i] % 2 == 0 else 2 * factors[i]
            n = max(int(math.ceil(limits[i] / f)), 1)
            while not _has_small_factors(n):
                n += 1
            sizes[i] = n * f
        return cls(cell, tuple(sizes))

    @property
    def n_voxels(self) -> int:
        """Number of voxels in the map, ``nx·ny·nz``."""
        nx, ny, nz = self.shape
        return nx * ny * nz

    @property
    def is_whole_cell(self) -> bool:
        """True when the map covers the cell exactly once (origin 0, shape = sampling)."""
        return self.origin == (0, 0, 0) and self.shape == self.sampling

    @property
    def spacing(self) -> tuple[float, float, float]:
        """Distance between voxel planes along each axis in Å (gemmi's ``Grid.spacing``)."""
        return tuple(1.0 / (m * r) for m, r in zip(self.sampling, self.cell.reciprocal_lengths))

    @property
    def voxel_volume(self) -> float:
        """Volume of one voxel in Å³ (a map's sum times this is its number of electrons)."""
        mx, my, mz = self.sampling
        return self.cell.volume / (mx * my * mz)

    def voxel_fractional(self) -> torch.Tensor:
        """Fractional coordinates of every voxel, shape (nx, ny, nz, 3), float64."""
        axes = [
            (torch.arange(n, dtype=torch.float64) + o) / m for n, o, m in zip(self.shape, self.origin, self.sampling)
        ]
        return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)

    def voxel_positions(self) -> torch.Tensor:
        """Cartesian coordinates of every voxel in Å, shape (nx, ny, nz, 3), float64."""
        return self.voxel_fractional() @ self.cell.orth.T

    def require_memory(
        self,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        copies: int = 1,
        extra_bytes: int = 0,
    ):
        """Raise :class:`GridError` if ``copies`` maps of this grid plus ``extra_bytes`` would not fit on ``device``.

        Called before any map is allocated, so a grid that is too fine fails with a
        message instead of taking the machine down. Each operation passes what it really
        allocates at its peak (maps and temporaries; see docs/kernels.md, "Memory").
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = self.n_voxels * itemsize * copies + int(extra_bytes)
        free = _free_memory(torch.device(device))
        if need > 0.8 * free:
            what = f"{copies} cop{'y' if copies == 1 else 'ies'}" if copies else "output and temporaries"
            if copies and extra_bytes:
                what += f" and {format_size(extra_bytes)} of temporaries"
            raise GridError(
                f"a {self.shape[0]}×{self.shape[1]}×{self.shape[2]} map in {dtype} needs {format_size(need)} ({what}) "
                f"but only {format_size(free)} is free on {device}: use a coarser grid spacing"
            )

    def __repr__(self) -> str:
        extra = "" if self.is_whole_cell else f", origin={self.origin}, sampling={self.sampling}"
        return f"GridSpec({self.cell!r}, shape={self.shape}{extra})"


def _directions_related(ops, i: int, j: int) -> bool:
    """True when a rotation of the space group maps axis i onto axis j (e.g. a and b in P 3)."""
    for op in ops.sym_ops:
        rot = op.rot
        # column i of the rotation is the image of axis i
        col = [rot[k][i] for k in range(3)]
        if all((k == j) == (col[k] != 0) for k in range(3)):
            return True
    return False


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


@functools.lru_cache(maxsize=64)
def _grid_of(cell: tuple[float, ...], shape: tuple[int, ...]) -> GridSpec:
    return GridSpec(Cell.from_parameters(*cell), shape)


def grid_of(cell, shape) -> GridSpec:
    """The whole-cell grid that six cell parameters (Å, degrees) and a shape name (cached).

    Custom ops take a grid as these plain values, which a compiled graph can hold, and rebuild it here.
    """
    return _grid_of(tuple(cell), tuple(shape))
