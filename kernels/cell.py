"""Unit cells: six parameters, checked, and the matrices the kernels use."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from kernels._util import real_number

__all__ = ["Cell", "MIN_CELL_WIDTH"]

#: The narrowest a unit cell may be, in Å, between any pair of its faces. No two atoms are closer than
#: the H–H bond (0.74 Å) and an atom's density is wider still, so in a narrower cell each atom would
#: overlap its own periodic image more closely than any neighbour: the map piles up the density of
#: thousands of images (a 0.0002 Å cell puts ~10⁴ of them on every voxel), a result of no crystal.
MIN_CELL_WIDTH = 0.5


def _cell_problem(params: Sequence[float]) -> str | None:
    """Why six cell parameters make no unit cell, or None when they make one."""
    names = ("a", "b", "c", "α", "β", "γ")
    for name, p in zip(names, params):
        if not math.isfinite(p):
            return f"{name} = {p} is not a finite number"
    for name, p in zip(names[:3], params[:3]):
        if p <= 0:
            return f"the cell length {name} = {p:g} Å must be positive"
    for name, p in zip(names[3:], params[3:]):
        if not 0 < p < 180:
            return f"the angle {name} = {p:g}° must lie strictly between 0° and 180°"
    # Three unit vectors with these pairwise angles exist iff the angles sum to less than
    # 360° and each is less than the sum of the other two (the volume factor is then > 0).
    al, be, ga = params[3:]
    if al + be + ga >= 360:
        return f"the angles sum to {al + be + ga:g}° (must be < 360°), so no cell has them"
    for name, x, y, z in (("α", al, be, ga), ("β", be, al, ga), ("γ", ga, al, be)):
        if x >= y + z:
            return (
                f"the angle {name} = {x:g}° is not less than the sum of the other two ({y + z:g}°), so no cell has them"
            )
    ca, cb, cg = (math.cos(math.radians(t)) for t in (al, be, ga))
    if 1 - ca * ca - cb * cb - cg * cg + 2 * ca * cb * cg < 1e-9:
        return "the angles make a flat cell (volume ≈ 0)"
    return None


def _format_cell(params: Sequence[float]) -> str:
    a, b, c, al, be, ga = params
    return f"a={a:g} b={b:g} c={c:g} Å, α={al:g} β={be:g} γ={ga:g}°"


@dataclasses.dataclass(frozen=True, eq=False)
class Cell:
    """A unit cell: six parameters and the matrices kernels use.

    Two cells are equal when their parameters and matrices are equal (a value, like a
    tuple); the hash is that of the parameters, so equal cells hash alike.

    Attributes
    ----------
    parameters : tuple of 6 float
        a, b, c in Å and α, β, γ in degrees.
    orth : torch.Tensor, shape (3, 3), float64
        Fractional → Cartesian; its columns are the cell vectors a, b, c (gemmi's
        convention: upper triangular, a along x).
    frac : torch.Tensor, shape (3, 3), float64
        Cartesian → fractional, ``orth⁻¹``.
    metric : torch.Tensor, shape (3, 3), float64
        ``G = orthᵀ·orth``: squared length of a fractional difference d is ``dᵀ G d``.
    """

    parameters: tuple[float, float, float, float, float, float]
    orth: torch.Tensor
    frac: torch.Tensor
    metric: torch.Tensor

    @classmethod
    def from_parameters(
        cls, a: float, b: float, c: float, alpha: float = 90.0, beta: float = 90.0, gamma: float = 90.0
    ) -> Cell:
        """Cell from lengths (Å) and angles (degrees), in gemmi's orientation convention.

        Parameters
        ----------
        a, b, c : float
            Cell lengths in Å, finite and positive (Python, numpy or 0-d torch real scalars).
        alpha, beta, gamma : float
            Angles in degrees, each in (0°, 180°), summing to < 360°, each less than the
            sum of the other two (otherwise no cell has them).

        Raises
        ------
        ValueError
            Saying which parameter is wrong and why, with all six values; or a cell narrower than
            :data:`MIN_CELL_WIDTH` (0.5 Å) between some pair of faces, naming them.
        """
        import gemmi

        names = ("a", "b", "c", "alpha", "beta", "gamma")
        params = tuple(real_number(v, f"cell {n}") for n, v in zip(names, (a, b, c, alpha, beta, gamma)))
        problem = _cell_problem(params)
        if problem:
            raise ValueError(f"impossible unit cell ({_format_cell(params)}): {problem}")
        return cls.from_gemmi(gemmi.UnitCell(*params))

    @classmethod
    def from_gemmi(cls, unit_cell) -> Cell:
        """Cell from a ``gemmi.UnitCell`` (its parameters are checked as in :meth:`from_parameters`)."""
        params = tuple(float(p) for p in unit_cell.parameters)
        problem = _cell_problem(params)
        if problem:
            raise ValueError(f"impossible unit cell ({_format_cell(params)}): {problem}")
        orth = torch.tensor(unit_cell.orth.mat.tolist(), dtype=torch.float64)
        if not torch.isfinite(orth).all() or abs(float(torch.linalg.det(orth))) < 1e-6:
            raise ValueError(f"degenerate unit cell ({_format_cell(params)}): its matrices are singular")
        frac = torch.linalg.inv(orth)
        widths = (1.0 / torch.linalg.norm(frac, dim=1)).tolist()  # the spacing of the lattice planes
        narrow = min(range(3), key=lambda i: widths[i])
        if not widths[narrow] >= MIN_CELL_WIDTH:
            faces = ("b–c", "a–c", "a–b")[narrow]
            raise ValueError(
                f"unit cell too narrow for an atom ({_format_cell(params)}): its {faces} faces are "
                f"{widths[narrow]:.3g} Å apart, less than {MIN_CELL_WIDTH} Å, shorter than any bond, so every atom "
                "would overlap its own periodic images; give the crystal's cell (or a box wider than the atoms)"
            )
        return cls(params, orth, frac, orth.T @ orth)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Cell):
            return NotImplemented
        return self.parameters == other.parameters and torch.equal(self.orth, other.orth)

    def __hash__(self) -> int:
        return hash(self.parameters)

    def to_gemmi(self):
        """The same cell as a ``gemmi.UnitCell``."""
        import gemmi

        return gemmi.UnitCell(*self.parameters)

    def __post_init__(self):
        # Every host value derived from the matrices is computed here, once, as a Python float: read inside
        # a compiled function (``grid.voxel_volume`` in a loss), a property that ran torch ops on these CPU
        # tensors would be traced into the graph, and the CPU tensors it makes would become the graph's
        # inputs and saved outputs, which CUDA graph trees cannot hold (they are in no CUDA pool).
        g = self.metric
        scale = float(g.diagonal().max())
        off = [abs(float(g[i, j])) > 1e-9 * scale for i, j in ((0, 1), (0, 2), (1, 2))]
        if not any(off):
            kind = "orthogonal"
        elif off == [False, True, False]:
            kind = "monoclinic"
        elif off == [True, False, False]:
            kind = "hexagonal"
        else:
            kind = "triclinic"
        object.__setattr__(self, "_volume", abs(float(torch.linalg.det(self.orth))))
        object.__setattr__(self, "_reciprocal_lengths", tuple(float(v) for v in torch.linalg.norm(self.frac, dim=1)))
        object.__setattr__(self, "_kind", kind)

    @property
    def volume(self) -> float:
        """Cell volume in Å³."""
        return self._volume

    @property
    def reciprocal_lengths(self) -> tuple[float, float, float]:
        """|a*|, |b*|, |c*| in 1/Å: the inverse spacings of the lattice planes."""
        return self._reciprocal_lengths

    @property
    def kind(self) -> str:
        """Which metric cross terms the cell has, as the separable kernels see it.

        ``"orthogonal"`` (G diagonal), ``"monoclinic"`` (only G13, the a–c pair couples),
        ``"hexagonal"`` (only G12, the a–b pair couples) or ``"triclinic"`` (anything else).
        """
        return self._kind

    def __repr__(self) -> str:
        a, b, c, al, be, ga = self.parameters
        return f"Cell({a:g}, {b:g}, {c:g}, {al:g}, {be:g}, {ga:g})"
