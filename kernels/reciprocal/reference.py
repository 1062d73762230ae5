"""Structure factors by a float64 full complex transform: plain, obviously correct, the truth.

F(h) = V/N · Σ_x ρ(x)·exp(2πi h·x) over the N voxels x of the cell. ``torch.fft.fftn`` computes
Σ_x ρ(x)·exp(−2πi h·x), so F(h) is the transform's coefficient at −h (modulo the grid).
"""

from __future__ import annotations

import torch

from kernels.crystal import GridSpec
from kernels.reciprocal.miller import MillerSet

__all__ = ["structure_factors_reference"]


def structure_factors_reference(
    rho: torch.Tensor, grid: GridSpec, millers: MillerSet, blur: float = 0.0
) -> torch.Tensor:
    """F of every reflection of ``millers`` from the whole map, in float64.

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape, real
        Cast to float64 (differentiably).
    grid : GridSpec
    millers : MillerSet
    blur : float
        B in Å² to divide out (F·exp(B·s²/4)).

    Returns
    -------
    torch.Tensor, shape (M,), complex128, on ``rho``'s device
    """
    transform = torch.fft.fftn(rho.to(torch.float64))
    hkl = millers.on(rho.device)["hkl"]
    n = torch.tensor(grid.shape, device=rho.device)
    idx = torch.remainder(-hkl, n)
    f = transform[idx[:, 0], idx[:, 1], idx[:, 2]] * grid.voxel_volume
    if blur:
        f = f * torch.exp(millers.on(rho.device)["inv_d2"] * (blur / 4))
    return f
