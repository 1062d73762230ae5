"""Gaussian density splatting: one public function, three backends.

``reference`` (float64 torch, the truth), ``cpu`` (separable C++/OpenMP) and ``triton``
(CUDA). :func:`splat_density` picks one through :mod:`kernels.dispatch`.
"""

from __future__ import annotations

import torch

from kernels.crystal import AtomSet, GridError, GridSpec
from kernels.density.radius import DEFAULT_CUTOFF, cutoff_radius
from kernels.dispatch import get_backend

__all__ = ["splat_density", "cutoff_radius", "DEFAULT_CUTOFF"]


def splat_density(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    backend: str = "auto",
) -> torch.Tensor:
    """Electron density of ``atoms`` on ``grid`` (periodic in the unit cell).

    Parameters
    ----------
    atoms : AtomSet
        Positions (N, 3) Å, B (N,) Å², occupancies (N,), IT92 coefficients (N, 5).
        The device of its tensors picks where the work runs.
    grid : GridSpec
        Whole-cell grid (every backend) or box grid (``reference`` only).
    radius : float, optional
        One cutoff radius in Å for every atom. Default: each atom's radius is where its
        density falls to ``cutoff`` (gemmi's rule).
    cutoff : float
        Density level in e/Å³ setting the per-atom radius (default 1e-5).
    backend : {"auto", "reference", "cpu", "triton"}
        ``auto`` runs ``cpu`` for CPU tensors and ``triton`` for CUDA tensors.

    Returns
    -------
    torch.Tensor, shape grid.shape
        Density in e/Å³: float64 from ``reference``, float32 from ``cpu`` and
        ``triton``. Differentiable with respect to ``atoms.xyz``, ``atoms.b_iso`` and
        ``atoms.occ``.

    Raises
    ------
    kernels.BackendError
        The backend asked for cannot run here.
    kernels.GridError
        The map would not fit in memory, or a fast backend got a box grid.
    """
    name, fn = get_backend("density", atoms.device, backend)
    if name != "reference" and not grid.is_whole_cell:
        raise GridError(f"the {name} density backend splats whole-cell grids only; use backend='reference' for a box")
    dtype = torch.float64 if name == "reference" else torch.float32
    key = (grid.cell.parameters, grid.shape, dtype, str(atoms.device))
    if key not in _memory_checked:  # once per grid: the query is a driver call, and not allowed in graph capture
        grid.require_memory(dtype, atoms.device, copies=2)
        _memory_checked.add(key)
    return fn(atoms, grid, radius=radius, cutoff=cutoff)


_memory_checked: set[tuple] = set()
