"""What the kernels are checked against: gemmi's density calculator, set up as the kernels are.

Tests, benchmarks and users checking a kernel of their own compare maps with gemmi's
``DensityCalculatorX`` (``…E`` for electrons, ``…N`` for neutrons) on the same grid. This module is
the one place that sets gemmi up for that: grid spacing, cutoff, blur, and the ANISOU kept or
dropped as :func:`kernels.read_model` keeps or drops it (``adp``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kernels._util import finite_number, positive_number

__all__ = [
    "GEMMI_RATE",
    "gemmi_density",
    "gemmi_density_calculator",
    "gemmi_density_of_model",
    "gemmi_structure_factors",
    "gemmi_structure_of_model",
    "synthetic_anisou",
]

#: gemmi's oversampling ``rate``; its grid spacing is ``d_min / (2·rate)``, so a spacing
#: ``s`` is asked for as ``d_min = 2·rate·s``.
GEMMI_RATE = 1.5


_CALCULATORS = {"xray": "DensityCalculatorX", "electron": "DensityCalculatorE", "neutron": "DensityCalculatorN"}


def gemmi_density_calculator(
    structure,
    spacing: float,
    cutoff: float = 1e-5,
    *,
    adp: str = "auto",
    radiation: str = "xray",
    blur: float = 0.0,
):
    """gemmi's density calculator for ``structure``, its grid sized for ``spacing``.

    The grid is gemmi's whole-cell grid for the structure's cell and space group at
    ``spacing`` Å, the same shape as ``kernels.GridSpec.for_spacing(cell, spacing,
    spacegroup)``.

    Parameters
    ----------
    structure : str, os.PathLike or gemmi.Structure
        A model file gemmi reads (PDB/mmCIF, optionally gzipped) or a structure already
        read; a structure passed in is modified when ``adp="iso"`` (its ANISOU zeroed).
    spacing : float
        Grid spacing in Å.
    cutoff : float
        Density level at which gemmi ends each atom's sphere (e/Å³; fm/Å³ for neutrons).
    adp : {"auto", "iso"}
        ``auto`` splats each atom's ANISOU where it has one (as ``read_model(adp="auto")`` keeps
        it); ``iso`` zeroes every ANISOU so gemmi splats isotropic B.
    radiation : {"xray", "electron", "neutron"}
        ``DensityCalculatorX``, ``DensityCalculatorE`` or ``DensityCalculatorN``.
    blur : float
        gemmi's ``blur``: an extra B in Å² on every atom.

    Returns
    -------
    (gemmi.Structure, gemmi.DensityCalculator*)
        The structure and the calculator, its grid allocated and zero.
    """
    import gemmi

    if adp not in ("auto", "iso"):
        raise ValueError(f"adp must be 'auto' or 'iso', got {adp!r}")
    if radiation not in _CALCULATORS:
        raise ValueError(f"radiation must be one of {tuple(_CALCULATORS)}, got {radiation!r}")
    st = gemmi.read_structure(os.fspath(structure)) if isinstance(structure, (str, Path)) else structure
    if adp == "iso":
        zero = gemmi.SMat33f(0, 0, 0, 0, 0, 0)
        for chain in st[0]:
            for residue in chain:
                for atom in residue:
                    atom.aniso = zero
    dc = getattr(gemmi, _CALCULATORS[radiation])()
    dc.d_min = 2 * GEMMI_RATE * spacing
    dc.rate = GEMMI_RATE
    dc.cutoff = positive_number(cutoff, "cutoff", "e/Å³")
    dc.blur = finite_number(blur, "blur", "Å²")
    dc.set_grid_cell_and_spacegroup(st)
    dc.initialize_grid()
    return st, dc


def gemmi_density(
    structure,
    spacing: float = 2.0 / 3.0,
    cutoff: float = 1e-5,
    *,
    symmetry: bool = False,
    adp: str = "auto",
    radiation: str = "xray",
    blur: float = 0.0,
) -> np.ndarray:
    """gemmi's density map of ``structure`` (first model).

    Parameters
    ----------
    structure : str, os.PathLike or gemmi.Structure
        As for :func:`gemmi_density_calculator`.
    spacing, cutoff : float
        Grid spacing in Å and density cutoff in e/Å³.
    symmetry : bool
        False: the asymmetric unit's atoms only, as ``kernels.splat_density`` computes.
        True: with the symmetry mates added, as ``kernels.symmetrize`` of that map.
    adp, radiation, blur
        As for :func:`gemmi_density_calculator`.

    Returns
    -------
    numpy.ndarray, shape (nx, ny, nz), float32
        Density in e/Å³ (a copy; gemmi's grid is freed).
    """
    st, dc = gemmi_density_calculator(structure, spacing, cutoff, adp=adp, radiation=radiation, blur=blur)
    if symmetry:
        dc.put_model_density_on_grid(st[0])
    else:
        dc.add_model_density_to_grid(st[0])
    return np.array(dc.grid, copy=True)


def gemmi_structure_of_model(model):
    """A copy of ``model.structure`` with ANISOU exactly where ``model.atoms`` uses U.

    The model's filtered gemmi structure (its atoms in the order of ``model.atoms``) is copied and
    the ANISOU of every atom that ``model.atoms`` splats at B is zeroed — all of them for an
    isotropic set (``adp="iso"``), those a ``on_bad_adp="iso"`` fallback turned isotropic.

    Parameters
    ----------
    model : kernels.Model

    Returns
    -------
    gemmi.Structure
    """
    import gemmi

    st = model.structure.clone()
    flags = model.atoms.aniso
    uses_u = [False] * len(model.atoms) if flags is None else flags.tolist()
    zero = gemmi.SMat33f(0, 0, 0, 0, 0, 0)
    i = 0
    for chain in st[0]:
        for residue in chain:
            for atom in residue:
                if not uses_u[i]:
                    atom.aniso = zero
                i += 1
    if i != len(model.atoms):
        raise ValueError(f"the model's structure has {i} atoms but model.atoms has {len(model.atoms)}")
    return st


def gemmi_density_of_model(
    model, spacing: float = 2.0 / 3.0, cutoff: float = 1e-5, *, symmetry: bool = False, blur: float = 0.0
) -> np.ndarray:
    """gemmi's map of exactly the atoms ``model.atoms`` splats: its radiation, and ANISOU only where it uses U
    (:func:`gemmi_structure_of_model`).

    Parameters
    ----------
    model : kernels.Model
    spacing, cutoff, symmetry, blur
        As for :func:`gemmi_density`.

    Returns
    -------
    numpy.ndarray, shape (nx, ny, nz), float32
    """
    st = gemmi_structure_of_model(model)
    return gemmi_density(st, spacing, cutoff, symmetry=symmetry, radiation=model.atoms.radiation, blur=blur)


def synthetic_anisou(structure, max_ratio: float = 10.0, seed: int = 0):
    """A copy of ``structure`` whose every atom has an ANISOU around its own B: a large anisotropic case.

    Each atom gets U = R·diag(λ)·Rᵀ with a random rotation R and eigenvalues λ whose mean is
    B/(8π²) (so 8π²·trace(U)/3 = B) and whose ratio largest/smallest is drawn up to ``max_ratio``;
    written to mmCIF and read back, gemmi and :func:`kernels.read_model` see the same U (to the 4
    decimals mmCIF keeps).

    Parameters
    ----------
    structure : str, os.PathLike or gemmi.Structure
        Not modified.
    max_ratio : float
        Largest eigenvalue ratio (≥ 1).
    seed : int
        Seeds the rotations and ratios (the same structure for the same seed).

    Returns
    -------
    gemmi.Structure
    """
    import gemmi

    st = gemmi.read_structure(os.fspath(structure)) if isinstance(structure, (str, Path)) else structure.clone()
    rng = np.random.default_rng(seed)
    for chain in st[0]:
        for residue in chain:
            for atom in residue:
                ratio = rng.uniform(1.0, max_ratio)
                lam = np.array([1.0, rng.uniform(1.0, ratio), ratio])
                lam *= 3 * atom.b_iso / (8 * np.pi**2) / lam.sum()
                q, r = np.linalg.qr(rng.normal(size=(3, 3)))
                rot = q * np.sign(np.diag(r))
                u = rot @ np.diag(lam) @ rot.T
                # 4 decimals, as mmCIF keeps them; the rounding is far below the smallest eigenvalue
                u = np.round(u, 4)
                atom.aniso = gemmi.SMat33f(u[0, 0], u[1, 1], u[2, 2], u[0, 1], u[0, 2], u[1, 2])
    return st


def gemmi_structure_factors(model, hkl, *, symmetry: bool = False) -> np.ndarray:
    """gemmi's exact structure factors (direct summation over atoms, no grid) of what ``model.atoms`` splats.

    ``gemmi.StructureFactorCalculatorX`` (``…E``, ``…N`` by the model's radiation) on
    :func:`gemmi_structure_of_model`: each atom's form factor, B or ANISOU as the kernels use them,
    and occupancy, with F(h) = Σ_j f_j·exp(2πi h·x_j) — the sign :func:`kernels.structure_factors` uses.

    Parameters
    ----------
    model : kernels.Model
    hkl : array-like, shape (M, 3), integer
    symmetry : bool
        False: the model's own atoms (P 1, as :func:`kernels.splat_density` maps them); True: with
        every symmetry mate of the model's space group (as :func:`kernels.symmetrize` of that map).

    Returns
    -------
    numpy.ndarray, shape (M,), complex128
        In electrons for X-rays (the map unit times Å³ otherwise). One Python call per reflection:
        about 1 s per 10⁷ atom-reflection pairs.
    """
    import gemmi

    st = gemmi_structure_of_model(model)
    if not symmetry:
        st.spacegroup_hm = "P 1"
    st.setup_cell_images()
    name = {"xray": "StructureFactorCalculatorX", "electron": "StructureFactorCalculatorE"}.get(
        model.atoms.radiation, "StructureFactorCalculatorN"
    )
    calc = getattr(gemmi, name)(st.cell)
    first = st[0]
    hkl = np.asarray(hkl, dtype=np.int64).reshape(-1, 3)
    return np.array([calc.calculate_sf_from_model(first, h) for h in hkl.tolist()], dtype=np.complex128)
