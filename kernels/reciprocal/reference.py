"""Structure factors by a float64 full complex transform: plain, obviously correct, the truth.

F(h) = V/N · Σ_x ρ(x)·exp(2πi h·x) over the N voxels x of the cell. ``torch.fft.fftn`` computes
Σ_x ρ(x)·exp(−2πi h·x), so F(h) is the transform's coefficient at −h (modulo the grid).
"""

from __future__ import annotations

import torch

from kernels.crystal import GridSpec
from kernels.reciprocal.miller import MillerSet

__all__ = ["structure_factors_reference"]


def structure_factors_reference(rho: torch.Tensor, grid: GridSpec, millers: MillerSet) -> torch.Tensor:
    """F of every reflection of ``millers`` from the whole map, in float64.

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape, real
        Cast to float64 (differentiably).
    grid : GridSpec
    millers : MillerSet

    Returns
    -------
    torch.Tensor, shape (M,), complex128, on ``rho``'s device
    """
    transform = torch.fft.fftn(rho.to(torch.float64))
    hkl = millers.on(rho.device)["hkl"]
    n = torch.tensor(grid.shape, device=rho.device)
    idx = torch.remainder(-hkl, n)
    return transform[idx[:, 0], idx[:, 1], idx[:, 2]] * grid.voxel_volume
