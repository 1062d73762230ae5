"""Gaussian density splatting: one public function, three backends.

``reference`` (float64 torch, the truth), ``cpu`` (separable C++/OpenMP) and ``triton``
(CUDA). :func:`splat_density` picks one through :mod:`kernels.dispatch`.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from kernels._util import positive_number
from kernels.crystal import AtomSet, GridError, GridSpec
from kernels.density.positions import check_finite
from kernels.density.radius import DEFAULT_CUTOFF, cutoff_radius
from kernels.dispatch import get_backend

__all__ = ["splat_density", "check_finite", "cutoff_radius", "peak_density", "DEFAULT_CUTOFF"]

# Most voxels one atom's box may span (2^27: about a second of work per atom on one core, 1 GiB of
# float64 for the reference's per-atom chunk). A fixed radius beyond it is a unit mistake (nm, or
# "everything"), not a density; per-atom radii from the cutoff stay below 60 Å and never reach it.
MAX_BOX_VOXELS = 1 << 27


def _check_radius_extent(radius: float, grid: GridSpec) -> None:
    """GridError when a fixed ``radius`` makes each atom's box span more than MAX_BOX_VOXELS voxels."""
    per_angstrom = [r * m for r, m in zip(grid.cell.reciprocal_lengths, grid.sampling)]  # voxels per Å
    box = math.prod(2 * math.ceil(radius * k) + 1 for k in per_angstrom)
    if box > MAX_BOX_VOXELS:
        # the largest radius whose box stays within the limit (a cube of side 2·R·k + 1 per axis)
        r_max = (MAX_BOX_VOXELS ** (1 / 3) - 1) / (2 * max(per_angstrom))
        nx, ny, nz = grid.shape
        raise GridError(
            f"radius={radius:g} Å makes each atom cover {box:.3g} voxels of this {nx}×{ny}×{nz} grid "
            f"(at most {MAX_BOX_VOXELS} per atom); a density radius is a few Å: use radius ≤ {r_max:.4g} Å, "
            "or radius=None for each atom's own radius from the cutoff"
        )


def peak_density(atoms: AtomSet) -> torch.Tensor:
    """Each atom's density at its centre, occ·Σ_k a_k·(4π/(b_k + B))^{3/2}, in e/Å³.

    Returns
    -------
    torch.Tensor, shape (N,), the atoms' dtype and device; not differentiable.
    """
    with torch.no_grad():
        if atoms.device.type == "cpu":
            return torch.from_numpy(_peak_density_host(atoms))
        scale = torch.reciprocal(atoms.b + atoms.b_iso[:, None]).mul_(4 * math.pi)  # 4π/B_k
        scale.mul_(scale.sqrt()).mul_(atoms.a)  # a_k·(4π/B_k)^{3/2}, without pow
        return scale.sum(dim=1).mul_(atoms.occ)


def _peak_density_host(atoms: AtomSet) -> np.ndarray:
    """:func:`peak_density` of CPU atoms in numpy: one pass over N×5 values on the calling thread.

    torch would split it over its thread pool, whose threads may be busy elsewhere (a browser,
    another kernel) and hold the splat call up behind them.
    """
    with torch.no_grad():
        a, b = atoms.a.numpy(), atoms.b.numpy()
        b_iso, occ = atoms.b_iso.numpy(), atoms.occ.numpy()
    scale = (4 * math.pi) / (b + b_iso[:, None])
    return (a * (scale * np.sqrt(scale))).sum(axis=1) * occ


def _warn_atoms_below_cutoff(atoms: AtomSet, cutoff: float) -> None:
    """Warn when an atom's peak density is below ``cutoff``: with per-atom radii it adds nothing.

    Host tensors only (a few µs for 10^4 atoms); on a GPU the answer would have to be read back.
    Atoms of occupancy 0 are meant to add nothing and are not reported.
    """
    if len(atoms) == 0:
        return
    peaks = _peak_density_host(atoms)
    low = peaks < cutoff
    occ = atoms.occ.detach().numpy()
    if low.any():
        low &= occ > 0
    if low.any():
        idx = int(np.flatnonzero(low)[0])
        count = int(low.sum())
        more = f" and {count - 1} more atoms" if count > 1 else ""
        label = atoms.labels[idx] if len(atoms.labels) == len(atoms) else f"#{idx + 1}"
        warnings.warn(
            f"atom {label} (index {idx}){more}: peak density {float(peaks[idx]):.3g} "
            f"e/Å³ is below the cutoff {cutoff:g} e/Å³, so the per-atom radius leaves it out of the map "
            "(B or occupancy too small?); lower the cutoff or pass radius= to splat it",
            UserWarning,
            stacklevel=3,
        )


def splat_density(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    backend: str = "auto",
    out: torch.Tensor | None = None,
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
    out : torch.Tensor, optional
        ``cpu`` backend only: a float32, C-contiguous CPU tensor of shape ``grid.shape`` that
        receives the map (every voxel overwritten) and is returned. For loops over the same grid:
        a reused map skips the page faults of a fresh one (~35 MB on a 0.667 Å grid of 3WIP). An
        in-place result is not differentiable: refused while gradients are recorded for ``atoms``
        (splat under ``torch.no_grad()``, or leave ``out`` out).

    Returns
    -------
    torch.Tensor, shape grid.shape
        Density in e/Å³: float64 from ``reference``, float32 from ``cpu`` and
        ``triton``. Differentiable with respect to ``atoms.xyz``, ``atoms.b_iso`` and
        ``atoms.occ`` (``out`` itself when given, not differentiable).

    Raises
    ------
    kernels.BackendError
        The backend asked for cannot run here.
    kernels.GridError
        The map would not fit in memory, a fast backend got a box grid, or ``radius`` makes each
        atom's box larger than ``MAX_BOX_VOXELS`` voxels.
    ValueError
        ``radius``/``cutoff`` not a positive finite number, or (``cpu``, ``reference``) an atom
        with a non-finite position, named. The ``triton`` backend does not read positions back
        (no host synchronisation): there such an atom adds nothing and gets zero gradients, and
        :func:`check_finite` raises the same error where the caller synchronises anyway.
        ``out`` given to another backend than ``cpu``, or of the wrong shape, dtype, device or
        layout, or while gradients are recorded (the message says which).

    Notes
    -----
    Under ``torch.compile`` the ``cpu`` and ``triton`` backends run as ``torch.library`` custom
    ops (``kernels.density.ops``), so a loop of splats compiles with ``fullgraph=True``; eager
    calls go to the backends directly.
    """
    if torch.compiler.is_compiling():
        if out is not None:
            raise ValueError("out= is not supported under torch.compile; use the returned map")
        return _splat_compiling(atoms, grid, radius, cutoff, backend)
    if radius is not None:
        radius = positive_number(radius, "radius", "Å")
        _check_radius_extent(radius, grid)
    if type(cutoff) is not float or not 0.0 < cutoff < math.inf:  # the usual float skips the validator's call
        cutoff = positive_number(cutoff, "cutoff", "e/Å³")
    if radius is None and atoms.device.type == "cpu":
        _warn_atoms_below_cutoff(atoms, cutoff)
    name, fn = get_backend("density", atoms.device, backend)
    if name != "reference" and not grid.is_whole_cell:
        raise GridError(f"the {name} density backend splats whole-cell grids only; use backend='reference' for a box")
    dtype = torch.float64 if name == "reference" else torch.float32
    key = (grid.cell.parameters, grid.shape, dtype, atoms.device)
    if key not in _memory_checked:  # once per grid: the query is a driver call, and not allowed in graph capture
        grid.require_memory(dtype, atoms.device, copies=2)
        _memory_checked.add(key)
    if out is None:
        return fn(atoms, grid, radius=radius, cutoff=cutoff)
    if name != "cpu":
        raise ValueError(f"out= is supported by the cpu density backend only, not {name}; leave out= out")
    return fn(atoms, grid, radius=radius, cutoff=cutoff, out=out)


_memory_checked: set[tuple] = set()


def _splat_compiling(atoms: AtomSet, grid: GridSpec, radius, cutoff, backend: str) -> torch.Tensor:
    """:func:`splat_density` inside ``torch.compile``: the backend's custom op (``kernels.density.ops``).

    Eager calls never come here: the ops' dispatch costs host time a direct call does not. What the eager
    path checks on the host with values read back (the memory query, the peak-density warning) is left
    out of the graph; arguments are checked as plain Python values at trace time.
    """
    from kernels.density.ops import splat_density_op

    if radius is not None:
        radius = float(radius)
        if not 0 < radius < math.inf:
            raise ValueError(f"radius must be a positive finite number of Å (0 < radius < inf), got {radius!r}")
    cutoff = float(cutoff)
    if not 0 < cutoff < math.inf:
        raise ValueError(f"cutoff must be a positive finite number of e/Å³ (0 < cutoff < inf), got {cutoff!r}")
    if backend == "auto":
        backend = "triton" if atoms.xyz.device.type == "cuda" else "cpu"
    if not grid.is_whole_cell:
        raise GridError(
            f"the {backend} density backend splats whole-cell grids only; use backend='reference' for a box"
        )
    return splat_density_op(atoms, grid, backend, radius, cutoff)
