"""Miller index sets and where each reflection sits in a map's Fourier transform.

A set is every unique reflection (gemmi's reciprocal ASU, systematic absences left out) with
d ≥ d_min. It depends on the cell, the space group, d_min and the grid, never on the map, so it
is made once per (grid, space group, d_min) and kept, with its index tensors on each device asked
for: a call on a GPU then copies nothing to the device and reads nothing back.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

import numpy as np
import torch

from kernels.crystal import GridError, GridSpec

__all__ = ["MillerSet", "miller_set", "finest_d_min", "inverse_d_squared"]

# Index sets kept (each a few MB at most: 3WIP at 2 Å in C 2 is 0.3 M reflections).
_MAX_SETS = 32
_sets: OrderedDict = OrderedDict()


def inverse_d_squared(hkl: torch.Tensor, grid_or_cell) -> torch.Tensor:
    """1/d² in Å⁻² of each reflection: ``hᵀ G* h`` with G* the reciprocal metric.

    Parameters
    ----------
    hkl : torch.Tensor, shape (M, 3), integer
    grid_or_cell : GridSpec or Cell

    Returns
    -------
    torch.Tensor, shape (M,), float64, on ``hkl``'s device
    """
    cell = getattr(grid_or_cell, "cell", grid_or_cell)
    g_star = (cell.frac @ cell.frac.T).to(hkl.device)  # rows of frac are a*, b*, c*
    h = hkl.to(torch.float64)
    return ((h @ g_star) * h).sum(dim=1)


def finest_d_min(grid: GridSpec) -> float:
    """The smallest d_min whose reflections all lie strictly inside the grid's Nyquist box.

    Every index must satisfy |h| < nx/2, |k| < ny/2, |l| < nz/2, so that no reflection is
    confused with its alias (at exactly n/2 the transform holds h and −h in one coefficient).
    The largest |h| of a sphere of radius 1/d is |a|/d, so d_min ≥ max(|a|/h_lim, |b|/k_lim, |c|/l_lim)
    with the largest allowed index h_lim = ⌈nx/2⌉ − 1.
    """
    lengths = torch.linalg.norm(grid.cell.orth, dim=0).tolist()  # |a|, |b|, |c|
    limits = [math.ceil(n / 2) - 1 for n in grid.sampling]
    if min(limits) < 1:
        raise GridError(f"grid {grid.shape} has fewer than 3 voxels along an axis: it holds no reflection")
    return max(length / lim for length, lim in zip(lengths, limits))


@dataclasses.dataclass(frozen=True)
class MillerSet:
    """A unique reflection set and its place in a map's transform (host arrays; see :func:`miller_set`).

    Attributes
    ----------
    hkl : numpy.ndarray, shape (M, 3), int64
        gemmi's order (``make_miller_array``): unique, no systematic absences, no (0, 0, 0).
    half : numpy.ndarray, shape (M, 3), int64
        ``hkl`` or ``−hkl``, whichever has l ≥ 0 (the half a real-to-complex transform keeps).
    flipped : numpy.ndarray, shape (M,), bool
        Where ``half`` is ``−hkl``: F(hkl) is then the conjugate of F(half) (Friedel's law, real map).
    inv_d2 : numpy.ndarray, shape (M,), float64
        1/d² in Å⁻².
    limits : tuple of 3 int
        Largest |h|, |k|, l of ``half``.
    key : tuple
        What the set was made for (cell parameters, sampling, space group, d_min): equal keys, equal sets.
    """

    hkl: np.ndarray
    half: np.ndarray
    flipped: np.ndarray
    inv_d2: np.ndarray
    limits: tuple[int, int, int]
    key: tuple = ()
    devices: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def on(self, device: torch.device) -> dict:
        """The set's tensors on ``device`` (made on the first call for each device, then kept)."""
        key = str(device)
        got = self.devices.get(key)
        if got is None:
            got = self.devices[key] = {
                "hkl": torch.from_numpy(self.hkl).to(device),
                "half": torch.from_numpy(self.half).to(device),
                "flipped": torch.from_numpy(self.flipped).to(device),
                "inv_d2": torch.from_numpy(self.inv_d2).to(device),
            }
        return got


def miller_set(grid: GridSpec, spacegroup: str, d_min: float) -> MillerSet:
    """The unique reflections of ``spacegroup`` with d ≥ ``d_min`` on ``grid`` (kept once made).

    Raises
    ------
    kernels.GridError
        Not a whole-cell grid, an unknown space group, or ``d_min`` finer than the grid holds
        (the message gives the finest it holds, :func:`finest_d_min`).
    """
    key = (grid.cell.parameters, grid.sampling, spacegroup, float(d_min))
    got = _sets.get(key)
    if got is not None:
        _sets.move_to_end(key)
        return got
    import gemmi

    if not grid.is_whole_cell:
        raise GridError("structure factors need a whole-cell grid (origin 0, shape = sampling)")
    sg = gemmi.find_spacegroup_by_name(spacegroup)
    if sg is None:
        raise GridError(f"unknown space group {spacegroup!r}")
    finest = finest_d_min(grid)
    if d_min < finest:
        spacing = max(grid.spacing)
        raise GridError(
            f"d_min = {d_min:g} Å is finer than this {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} grid "
            f"({spacing:.3g} Å spacing) holds: use d_min ≥ {math.ceil(finest * 1e4) / 1e4:g} Å, or a finer grid "
            f"(spacing ≤ d_min / 2)"
        )
    hkl = gemmi.make_miller_array(grid.cell.to_gemmi(), sg, d_min, 0.0, True).astype(np.int64)
    hkl = hkl[np.any(hkl != 0, axis=1)]
    # 1/d² from the cell's own matrices (the ones the density kernels use), so shells, blur and d agree.
    frac = grid.cell.frac.numpy()
    g_star = frac @ frac.T
    inv_d2 = np.einsum("mi,ij,mj->m", hkl.astype(np.float64), g_star, hkl.astype(np.float64))
    flipped = hkl[:, 2] < 0
    half = np.where(flipped[:, None], -hkl, hkl)
    limits = tuple(int(v) for v in np.abs(half).max(axis=0)) if len(half) else (0, 0, 0)
    got = MillerSet(hkl, half, flipped, inv_d2, limits, key)
    _sets[key] = got
    if len(_sets) > _MAX_SETS:
        _sets.popitem(last=False)
    return got
