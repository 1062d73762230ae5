"""Space-group symmetry on map grids."""

from __future__ import annotations

import torch

from kernels.crystal import GridError, GridSpec

__all__ = ["symmetrize", "symmetrize_peak_bytes", "grid_operators"]


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


# Output voxels per chunk: the index temporaries (int64 coordinates and flat indices) stay below
# 17 MB whatever the map size, so the peak is the output map plus this.
_CHUNK_VOXELS = 1 << 16
# Bytes of temporaries per voxel of a chunk, an upper bound on what is alive at once: the flat index,
# its three coordinates and their stack, rot·uvw, + shift and the remainder (int64, 3 each), the
# flat-index arithmetic and the gathered values and accumulator (≤ 8 bytes each).
_CHUNK_BYTES_PER_VOXEL = 256


def _symmetrize_into(out: torch.Tensor, flat: torch.Tensor, shape, ops) -> None:
    """out[x] = Σ_g flat[g·x] (flat C-order maps), chunk by chunk, operators in order within each voxel."""
    dev = flat.device
    n = torch.tensor(shape, dtype=torch.int64, device=dev)
    ny, nz = shape[1], shape[2]
    ops = [(rot.to(dev).T, shift.to(dev)) for rot, shift in ops]
    total = flat.shape[0]
    for start in range(0, total, _CHUNK_VOXELS):
        idx = torch.arange(start, min(start + _CHUNK_VOXELS, total), device=dev)
        uvw = torch.stack((idx // (ny * nz), (idx // nz) % ny, idx % nz), dim=-1)  # (C, 3)
        acc = torch.zeros(idx.shape[0], dtype=flat.dtype, device=dev)
        for rot_t, shift in ops:
            # Integer products written out: CUDA has no int64 matrix multiply ("addmm_cuda" for Long).
            mapped = uvw[:, 0:1] * rot_t[0] + uvw[:, 1:2] * rot_t[1] + uvw[:, 2:3] * rot_t[2] + shift
            mapped = torch.remainder(mapped, n)
            acc += flat[(mapped[:, 0] * ny + mapped[:, 1]) * nz + mapped[:, 2]]
        out[start : start + idx.shape[0]] = acc


class _Symmetrize(torch.autograd.Function):
    """The group sum and its adjoint: Σ_g ρ(g·x) has gradient Σ_g γ(g⁻¹·y), and {g⁻¹} is the group again,
    so the backward is the same sum of the upstream gradient (no index tensors kept for autograd)."""

    @staticmethod
    def forward(ctx, rho, shape, ops):
        ctx.shape, ctx.ops = shape, ops
        out = torch.empty(rho.numel(), dtype=rho.dtype, device=rho.device)
        _symmetrize_into(out, rho.detach().reshape(-1), shape, ops)
        return out.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return _Symmetrize.apply(grad.contiguous(), ctx.shape, ctx.ops), None, None


def symmetrize_peak_bytes(grid: GridSpec, dtype: torch.dtype) -> int:
    """Memory :func:`symmetrize` allocates beyond its input, in bytes: the output map plus one chunk of temporaries."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return grid.n_voxels * itemsize + min(grid.n_voxels, _CHUNK_VOXELS) * _CHUNK_BYTES_PER_VOXEL


def symmetrize(rho: torch.Tensor, grid: GridSpec, spacegroup: str) -> torch.Tensor:
    """Add the symmetry mates: ``out[x] = Σ_g rho[g·x]`` over the space group's operators.

    Turns the map of the atoms in the file (the asymmetric unit, as :func:`splat_density`
    gives it) into the crystal's density, as gemmi's ``put_model_density_on_grid`` does.
    The sum runs over the output in chunks of 2^16 voxels, so the memory it needs beyond
    ``rho`` is the output map plus at most 17 MB (:func:`symmetrize_peak_bytes`), checked
    against the free memory of the device first. The backward is the same sum of the
    upstream gradient (the group contains every operator's inverse); it keeps nothing.

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

    Raises
    ------
    kernels.GridError
        Wrong map shape, an unknown space group, a grid incompatible with it, or not enough
        free memory for the output and its temporaries.
    """
    if tuple(rho.shape) != grid.shape:
        raise GridError(f"map shape {tuple(rho.shape)} does not match the grid {grid.shape}")
    ops = grid_operators(grid, spacegroup)
    if len(ops) == 1:
        grid.require_memory(rho.dtype, rho.device, copies=1)
        return rho.clone()
    grid.require_memory(rho.dtype, rho.device, copies=0, extra_bytes=symmetrize_peak_bytes(grid, rho.dtype))
    return _Symmetrize.apply(rho.contiguous(), grid.shape, ops)
