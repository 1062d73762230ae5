"""Atom positions as the density kernels take them: finite, and near the unit cell in float64.

The `cpu` and `reference` backends call :func:`positions_in_cell` before they cast to float32, so an atom far
from the cell (a lattice translation of 10^6 Å, or 10^30 Å) is placed in the cell exactly as the
float64 fractional coordinate says, not after a float32 rounding of its Cartesian position (ulp
0.06 Å at 10^6 Å), and neither turns a huge voxel coordinate into an integer index.
:func:`check_finite` is the one test of "a non-finite position" against a cell; its error is the
atom set's own (``AtomSet._nonfinite_position_error``, which :meth:`AtomSet.check` raises too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # names for the annotations only
    from kernels.atoms import AtomSet
    from kernels.cell import Cell

__all__ = ["check_finite", "positions_in_cell", "NEAR_CELL"]

# Fractional range kept as given: the unit cell and one cell either side, where every model file's
# atoms lie. Moving those by lattice vectors would change their float32 rounding (and so the map's
# bits) for no gain in accuracy: at two cell edges from the origin float32 positions are within
# 6e-8 relative of the float64 ones, well inside the float32 contract.
NEAR_CELL = (-1.0, 2.0)


_MATRICES: dict[tuple[Cell, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _matrices(cell: Cell, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(frac, orth)`` of ``cell`` on ``device`` (float64), copied once per (cell, device).

    Kept because a host-to-device copy on every call would cost a transfer each time and cannot
    be captured in a CUDA graph; the first (eager) call of a cell on a device makes them.
    """
    key = (cell, torch.device(device))
    hit = _MATRICES.get(key)
    if hit is None:
        if len(_MATRICES) > 64:  # a long session of many cells: start again rather than grow
            _MATRICES.clear()
        hit = _MATRICES[key] = (
            cell.frac.to(device=device, dtype=torch.float64),
            cell.orth.to(device=device, dtype=torch.float64),
        )
    return hit


def _fractional(xyz: torch.Tensor, cell: Cell) -> torch.Tensor:
    # (x·F_d0 + y·F_d1) + z·F_d2, one exactly rounded op at a time: the order the C++ kernel uses, on
    # every machine (a matmul's order and FMA use depend on the BLAS and the CPU), so both backends put
    # an atom at an exact voxel tie on the same side.
    return _frac_product(xyz.detach().to(torch.float64), _matrices(cell, xyz.device)[0])


def _frac_product(x64: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """frac·x per row, (N, 3) float64, in the fixed order of :func:`_fractional` (differentiable)."""
    return x64[:, 0:1] * frac[:, 0] + x64[:, 1:2] * frac[:, 1] + x64[:, 2:3] * frac[:, 2]


def check_finite(atoms: AtomSet, cell: Cell | None = None) -> None:
    """Raise ``ValueError`` naming the first atom whose position is not finite.

    ``splat_density`` runs this on entry for the ``cpu`` and ``reference`` backends (a few µs for
    10^4 atoms). The ``triton`` backend does not, because reading the answer back would stop the
    host for the GPU on every call; there a non-finite atom adds nothing to the map and gets a zero
    gradient. Call this where your code synchronises anyway (e.g. after reading a map or loss back)
    to get the same error on CUDA.

    Parameters
    ----------
    atoms : AtomSet
        Any device (CUDA tensors: one host synchronisation).
    cell : Cell, optional
        Also refuse finite positions whose fractional coordinates overflow float64 in this cell.

    Raises
    ------
    ValueError
        An atom has a NaN or infinite coordinate; the message names it, its index and how many
        more there are.
    """
    pos = atoms.xyz.detach() if cell is None else _fractional(atoms.xyz, cell)
    finite = torch.isfinite(pos).all(dim=1)
    if not bool(finite.all()):
        raise atoms._nonfinite_position_error(~finite)


def positions_in_cell(atoms: AtomSet, cell: Cell) -> torch.Tensor:
    """Positions with every far atom moved by whole lattice vectors into the unit cell, in float64.

    Atoms whose fractional coordinates f = frac·xyz (float64) all lie in ``NEAR_CELL`` = [−1, 2)
    keep their positions bit for bit. The others become ``orth·(f − floor(f))``: f − floor(f) is
    exact in floating point for any finite f, so an atom at 10^30 Å lands where its float64
    fractional coordinate says, and no kernel ever sees a coordinate beyond two cells. Used by the
    ``cpu`` and ``reference`` backends, which read the answer on the host; on the CPU the usual
    case (every atom near the cell) costs one reduction.

    Parameters
    ----------
    atoms : AtomSet
        ``atoms.xyz`` (N, 3) Å, any floating dtype and device; may require grad.
    cell : Cell

    Returns
    -------
    torch.Tensor, shape (N, 3)
        ``atoms.xyz`` itself when nothing moved on the CPU (no copy, no autograd node); otherwise
        float64 and differentiable (a translation: gradient 1 up to rounding).

    Raises
    ------
    ValueError
        A non-finite position (see :func:`check_finite`).
    """
    xyz = atoms.xyz
    x64 = xyz.to(torch.float64)
    lo, hi = NEAR_CELL
    with torch.no_grad():
        f = _fractional(xyz, cell)
        if x64.device.type == "cpu":
            # The usual case in one reduction (NaN makes both tests fail and takes the full path below).
            f_min, f_max = (float(v) for v in torch.aminmax(f)) if f.numel() else (lo, lo)
            if f_min >= lo and f_max < hi:
                return xyz
        finite = torch.isfinite(f).all(dim=1)
        if not bool(finite.all()):
            raise atoms._nonfinite_position_error(~finite)
        far = ((f < lo) | (f >= hi)).any(dim=1)[:, None]
        if x64.device.type == "cpu" and not bool(far.any()):
            return xyz
        shift = torch.where(far, torch.floor(f), torch.zeros_like(f))
    # frac·xyz − floor(frac·xyz) in the differentiable path (exact), then back to Cartesian.
    frac, orth = _matrices(cell, x64.device)
    moved = (_frac_product(x64, frac) - shift) @ orth.T
    return torch.where(far, moved, x64)
