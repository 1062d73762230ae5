"""Structure factors by one real-to-complex transform in the map's own precision, on any device.

``torch.fft.rfftn`` of the whole map (MKL on the CPU, cuFFT on a GPU) and one gather of the
reflections' coefficients. A transform cut axis by axis to the indices d_min's sphere reaches does less
arithmetic but, as three strided one-axis transforms with copies between them, took longer on both
devices than the one multi-dimensional transform (benchmarks/bench_reciprocal.py).
"""

from __future__ import annotations

import torch

from kernels.crystal import GridSpec
from kernels.reciprocal.miller import MillerSet

__all__ = ["structure_factors_fft"]

# (index-set key, blur, dtype, device) -> (flat positions, (M, 2) factors); a handful of grids at a time.
_MAX_PLANS = 64
_plans: dict = {}


def _gather_plan(millers: MillerSet, grid: GridSpec, blur: float, dtype: torch.dtype, device: torch.device):
    """Flat positions of each reflection's half-space mate in the (nx, ny, nz//2+1) transform, and the (M, 2)
    factors that turn the (re, im) there into F: V/N·exp(B·s²/4), and its negation for the imaginary part of a
    reflection with l ≥ 0 (which takes the conjugate).

    Made once per (index set, blur, dtype, device) — value keys: the index set's own key names its grid, space
    group and d_min — and kept, so a call is one gather and one multiply on the device.
    """
    key = (millers.key, float(blur), dtype, str(device))
    got = _plans.get(key)
    if got is not None:
        return got
    t = millers.on(device)
    half = t["half"]
    nx, ny, nz = grid.shape
    # the mate (h, k, l), l ≥ 0, at (h mod nx, k mod ny, l) of the half-space transform
    flat = (torch.remainder(half[:, 0], nx) * ny + torch.remainder(half[:, 1], ny)) * (nz // 2 + 1) + half[:, 2]
    scale = (
        grid.voxel_volume * torch.exp(t["inv_d2"] * (blur / 4))
        if blur
        else torch.full_like(t["inv_d2"], grid.voxel_volume)
    )
    # l ≥ 0 reflections take conj(R) (imaginary part negated), flipped ones R as it is
    sign = torch.where(t["flipped"], 1.0, -1.0).to(scale.dtype)
    factors = torch.stack((scale, scale * sign), dim=1).to(dtype)
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = (flat, factors)
    return flat, factors


def structure_factors_fft(rho: torch.Tensor, grid: GridSpec, millers: MillerSet, blur: float = 0.0) -> torch.Tensor:
    """F of every reflection of ``millers``: one rfftn of the map, then a gather.

    With R(h) = Σ_x ρ(x)·exp(−2πi h·x) (what torch transforms), F(h) = V/N·R(−h) = V/N·conj(R(h)) for a
    real map. R is kept for l ≥ 0 only: a reflection with l ≥ 0 takes the conjugate of R at itself, one
    with l < 0 takes R at its mate −h (l > 0) as it is.

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape, float32 or float64
    grid : GridSpec
    millers : MillerSet
    blur : float
        B in Å² to divide out (F·exp(B·s²/4)).

    Returns
    -------
    torch.Tensor, shape (M,), complex64 for float32 maps, complex128 for float64, on ``rho``'s device
    """
    t = torch.fft.rfftn(rho)
    flat, factors = _gather_plan(millers, grid, blur, rho.dtype, rho.device)
    pairs = torch.view_as_real(t).reshape(-1, 2).index_select(0, flat)
    return torch.view_as_complex(pairs * factors)
