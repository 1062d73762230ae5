"""Space-group symmetry on map grids."""

from __future__ import annotations

import torch

from kernels.crystal import GridError, GridSpec

__all__ = ["symmetrize", "grid_operators"]


def grid_operators(grid: GridSpec, spacegroup: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The space group's operators in voxel units: ``[(rot (3,3) int64, shift (3,) int64), …]``.

    A voxel (u, v, w) maps to ``rot @ (u, v, w) + shift`` (modulo the grid). The identity
    comes first. Raises :class:`GridError` if the grid is not compatible with the group
    (a translation that is not a whole number of voxels, or symmetry-related axes with
    different sizes) — :meth:`GridSpec.for_spacing` with the space group always is.
    """
    import gemmi

    sg = gemmi.find_spacegroup_by_name(spacegroup)
    if sg is None:
        raise GridError(f"unknown space group {spacegroup!r}")
    if not grid.is_whole_cell:
        raise GridError("symmetry operators apply to whole-cell grids only")
    ops = sg.operations()
    n = grid.shape
    result = []
    for op in ops:  # every operator: symmetry × centring, identity first
        rot = [[r // op.DEN for r in row] for row in op.rot]
        for i in range(3):
            for j in range(3):
                if i != j and rot[i][j] != 0 and n[i] != n[j]:
                    raise GridError(
                        f"grid {n} is not compatible with {spacegroup}: axes {i} and {j} are related by symmetry "
                        "but have different sizes; use GridSpec.for_spacing(cell, spacing, spacegroup)"
                    )
        shift = []
        for i in range(3):
            num = op.tran[i] * n[i]
            if num % op.DEN:
                raise GridError(
                    f"grid {n} is not compatible with {spacegroup}: the translation of {op.triplet()} is not a "
                    "whole number of voxels; use GridSpec.for_spacing(cell, spacing, spacegroup)"
                )
            shift.append(num // op.DEN)
        result.append((torch.tensor(rot, dtype=torch.int64), torch.tensor(shift, dtype=torch.int64)))
    ident = [k for k, (r, s) in enumerate(result) if torch.equal(r, torch.eye(3, dtype=torch.int64)) and not s.any()]
    if ident:
        result.insert(0, result.pop(ident[0]))
    return result


def symmetrize(rho: torch.Tensor, grid: GridSpec, spacegroup: str) -> torch.Tensor:
    """Add the symmetry mates: ``out[x] = Σ_g rho[g·x]`` over the space group's operators.

    Turns the map of the atoms in the file (the asymmetric unit, as :func:`splat_density`
    gives it) into the crystal's density, as gemmi's ``put_model_density_on_grid`` does.

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape
        Any floating dtype and device; differentiable.
    grid : GridSpec
        Whole-cell grid compatible with the space group.
    spacegroup : str
        Hermann–Mauguin name, e.g. ``model.spacegroup``.

    Returns
    -------
    torch.Tensor, same shape, dtype and device as ``rho``
    """
    if tuple(rho.shape) != grid.shape:
        raise GridError(f"map shape {tuple(rho.shape)} does not match the grid {grid.shape}")
    ops = grid_operators(grid, spacegroup)
    if len(ops) == 1:
        return rho.clone()
    dev = rho.device
    n = torch.tensor(grid.shape, dtype=torch.int64, device=dev)
    axes = [torch.arange(k, device=dev) for k in grid.shape]
    uvw = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)  # (V, 3)
    flat = rho.reshape(-1)
    out = torch.zeros_like(flat)
    for rot, shift in ops:
        mapped = torch.remainder(uvw @ rot.to(dev).T + shift.to(dev), n)
        out = out + flat[(mapped[:, 0] * grid.shape[1] + mapped[:, 1]) * grid.shape[2] + mapped[:, 2]]
    return out.reshape(rho.shape)
