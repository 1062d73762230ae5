"""What the kernels are checked against: gemmi's density calculator, set up as the kernels are.

Tests, benchmarks and users checking a kernel of their own compare maps with gemmi's
``DensityCalculatorX`` on the same grid. This module is the one place that sets gemmi up
for that: grid spacing, cutoff, and the anisotropic ADPs dropped (the kernels splat
isotropic B; gemmi would otherwise splat the file's ANISOU).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["GEMMI_RATE", "gemmi_density", "gemmi_density_calculator"]

#: gemmi's oversampling ``rate``; its grid spacing is ``d_min / (2·rate)``, so a spacing
#: ``s`` is asked for as ``d_min = 2·rate·s``.
GEMMI_RATE = 1.5


def gemmi_density_calculator(structure, spacing: float, cutoff: float = 1e-5):
    """gemmi's X-ray density calculator for ``structure``, its grid sized for ``spacing``.

    The grid is gemmi's whole-cell grid for the structure's cell and space group at
    ``spacing`` Å, the same shape as ``kernels.GridSpec.for_spacing(cell, spacing,
    spacegroup)``. Every atom's ANISOU is zeroed, so gemmi splats each atom's isotropic B
    as the kernels do.

    Parameters
    ----------
    structure : str, os.PathLike or gemmi.Structure
        A model file gemmi reads (PDB/mmCIF, optionally gzipped) or a structure already
        read; a structure passed in is modified (its ANISOU zeroed).
    spacing : float
        Grid spacing in Å.
    cutoff : float
        Density level in e/Å³ at which gemmi ends each atom's sphere.

    Returns
    -------
    (gemmi.Structure, gemmi.DensityCalculatorX)
        The structure and the calculator, its grid allocated and zero.
    """
    import gemmi

    st = gemmi.read_structure(os.fspath(structure)) if isinstance(structure, (str, Path)) else structure
    zero = gemmi.SMat33f(0, 0, 0, 0, 0, 0)
    for chain in st[0]:
        for residue in chain:
            for atom in residue:
                atom.aniso = zero
    dc = gemmi.DensityCalculatorX()
    dc.d_min = 2 * GEMMI_RATE * spacing
    dc.rate = GEMMI_RATE
    dc.cutoff = cutoff
    dc.set_grid_cell_and_spacegroup(st)
    dc.initialize_grid()
    return st, dc


def gemmi_density(structure, spacing: float = 2.0 / 3.0, cutoff: float = 1e-5, *, symmetry: bool = False) -> np.ndarray:
    """gemmi's density map of ``structure`` (first model, ANISOU zeroed).

    Parameters
    ----------
    structure : str, os.PathLike or gemmi.Structure
        As for :func:`gemmi_density_calculator`.
    spacing, cutoff : float
        Grid spacing in Å and density cutoff in e/Å³.
    symmetry : bool
        False: the asymmetric unit's atoms only, as ``kernels.splat_density`` computes.
        True: with the symmetry mates added, as ``kernels.symmetrize`` of that map.

    Returns
    -------
    numpy.ndarray, shape (nx, ny, nz), float32
        Density in e/Å³ (a copy; gemmi's grid is freed).
    """
    st, dc = gemmi_density_calculator(structure, spacing, cutoff)
    if symmetry:
        dc.put_model_density_on_grid(st[0])
    else:
        dc.add_model_density_to_grid(st[0])
    return np.array(dc.grid, copy=True)
