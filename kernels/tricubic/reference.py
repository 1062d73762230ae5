"""Float64 reference tricubic interpolation: plain torch, obviously correct, slow — the truth.

Each point is turned into map-voxel coordinates ``u = sampling·(frac·p) − origin``; the
4×4×4 neighbourhood starting at ``floor(u) − 1`` is gathered in one batched index
``(B, 4, 4, 4)`` and interpolated along z, then y, then x with the 1-D scheme written in
its textbook form (Catmull-Rom in gemmi's value form, Lagrange by Neville's recurrence),
so it shares no weight formulas with the fast paths it checks. Differentiable by
autograd with respect to the points and the map.

The helpers :func:`voxel_coordinates` and :func:`outside_mask` are the one definition of
"where a point falls" used by every backend's tests and by the public function's
bounded-mode warning.
"""

from __future__ import annotations

import torch

from kernels.crystal import GridSpec

__all__ = ["tricubic_reference", "voxel_coordinates", "outside_mask", "grid_parameters", "METHODS", "MODES"]

METHODS = ("catmull-rom", "lagrange")
# A periodic point at least this many voxels from the map's origin is folded through its fractional
# coordinate first, u = (f − floor(f))·m − o: wrapping u itself modulo n is exact only well inside
# 2^53 (and a C++ int64 cast of a larger u is undefined). f − floor(f) is exact for any finite f,
# so every backend lands on the same voxel, however far the point.
FAR_VOXELS = 2.0**40
MODES = ("periodic", "bounded")


def grid_parameters(grid: GridSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 float64 numbers the kernels need: ``frac`` row-major (9), ``sampling`` (3), ``origin`` (3).

    Passed to the C++ and Triton kernels as one float64 tensor so no float64 scalar ever
    travels as a Python float (Triton would make it float32).
    """
    frac = grid.cell.frac.to(torch.float64).reshape(9)
    rest = torch.tensor([*grid.sampling, *grid.origin], dtype=torch.float64)
    return torch.cat([frac, rest]).to(device)


def voxel_coordinates(points: torch.Tensor, grid: GridSpec, periodic: bool = False) -> torch.Tensor:
    """Map-voxel coordinates of Cartesian points, float64.

    ``u[..., r] = sampling[r] · f_r − origin[r]`` with ``f_r = frac[r,0]·x + frac[r,1]·y + frac[r,2]·z``,
    written out term by term in this order (the C++ and Triton kernels add in the same
    order) so every backend puts a point on the same side of a voxel boundary. With
    ``periodic=True``, where ``|u| ≥ FAR_VOXELS`` (2^40) the coordinate is
    ``sampling[r] · (f_r − floor(f_r)) − origin[r]`` instead (the same point modulo the cell).

    Parameters
    ----------
    points : torch.Tensor, shape (..., 3)
        Cartesian positions in Å (any floating dtype; computed in float64).
    grid : GridSpec
    periodic : bool
        Fold far points through their fractional coordinate (periodic mode).

    Returns
    -------
    torch.Tensor, shape (..., 3), float64
        Voxel index coordinates of the map: voxel (i, j, k) of ``rho`` sits at (i, j, k).
    """
    p = points.to(torch.float64)
    frac = grid.cell.frac.to(device=p.device, dtype=torch.float64)
    x, y, z = p[..., 0:1], p[..., 1:2], p[..., 2:3]
    f = x * frac[:, 0] + y * frac[:, 1] + z * frac[:, 2]
    m = torch.tensor(grid.sampling, dtype=torch.float64, device=p.device)
    o = torch.tensor(grid.origin, dtype=torch.float64, device=p.device)
    u = f * m - o
    if periodic:
        u = torch.where(u.abs() < FAR_VOXELS, u, (f - torch.floor(f).detach()) * m - o)
    return u


def outside_mask(u: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """True where a finite point's 4×4×4 neighbourhood leaves a box map of ``shape``.

    Parameters
    ----------
    u : torch.Tensor, shape (..., 3), float64
        Voxel coordinates from :func:`voxel_coordinates`.
    shape : tuple of 3 int

    Returns
    -------
    torch.Tensor, shape (...), bool
        Non-finite points are not "outside" (they give NaN, not ``fill_value``).
    """
    n = torch.tensor(shape, dtype=u.dtype, device=u.device)
    fl = torch.floor(u)
    out = ((fl - 1 < 0) | (fl + 2 > n - 1)).any(dim=-1)
    return out & torch.isfinite(u).all(dim=-1)


def _catmull_rom_1d(v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Catmull-Rom along the last axis of ``v (..., 4)`` at ``t`` in [0, 1) between v[1] and v[2]."""
    a, b, c, d = v.unbind(-1)
    return b + 0.5 * t * (c - a + t * (2 * a - 5 * b + 4 * c - d + t * (3 * (b - c) + d - a)))


def _neville_1d(v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Lagrange polynomial through nodes −1, 0, 1, 2 (values ``v (..., 4)``) at ``t``, by Neville's recurrence."""
    nodes = (-1.0, 0.0, 1.0, 2.0)
    p = list(v.unbind(-1))
    for m in range(1, 4):
        p = [((t - nodes[i + m]) * p[i] + (nodes[i] - t) * p[i + 1]) / (nodes[i] - nodes[i + m]) for i in range(4 - m)]
    return p[0]


def tricubic_reference(
    rho: torch.Tensor,
    grid: GridSpec,
    points: torch.Tensor,
    method: str = "catmull-rom",
    mode: str = "periodic",
    fill_value: float = 0.0,
) -> torch.Tensor:
    """Sample ``rho`` at Cartesian ``points`` by tricubic interpolation, in float64.

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape
        Map values (any floating dtype; computed in float64).
    grid : GridSpec
        Where voxel (i, j, k) of ``rho`` sits in the cell.
    points : torch.Tensor, shape (..., 3)
        Cartesian positions in Å, on ``rho``'s device.
    method : {"catmull-rom", "lagrange"}
    mode : {"periodic", "bounded"}
        ``periodic`` wraps indices modulo the map shape (whole-cell maps); ``bounded``
        gives ``fill_value`` (and zero gradient) to points whose neighbourhood leaves the map.
    fill_value : float

    Returns
    -------
    torch.Tensor, shape points.shape[:-1], float64
        Interpolated values; NaN where a point is not finite. Differentiable by autograd
        with respect to ``rho`` and ``points``.

    Notes
    -----
    Memory grows as 64 float64 values per point (plus autograd's copies): meant for
    tests and small inputs; the fast backends stream points instead.
    """
    lead = points.shape[:-1]
    rho64 = rho.to(torch.float64)
    u = voxel_coordinates(points.reshape(-1, 3), grid, periodic=mode == "periodic")
    shape = tuple(rho.shape)
    n = torch.tensor(shape, dtype=torch.float64, device=u.device)
    finite = torch.isfinite(u).all(dim=-1)
    outside = outside_mask(u, shape) if mode == "bounded" else torch.zeros_like(finite)
    keep = (finite & ~outside)[:, None]
    # Points we do not interpolate get a harmless coordinate (and, through torch.where, zero gradient).
    u = torch.where(keep, u, torch.ones_like(u))
    if mode == "periodic":
        u = u - n * torch.floor(u / n).detach()
    base = torch.floor(u).detach()
    t = u - base
    offs = torch.arange(-1, 3, device=u.device)
    idx = base.long()[:, :, None] + offs  # (B, 3, 4)
    n_long = torch.tensor(shape, device=u.device)[:, None]
    if mode == "periodic":
        idx = torch.remainder(idx, n_long)
    else:  # only points kept inside gather for real; the clamp keeps masked ones (and maps under 4 wide) in range
        idx = torch.minimum(idx.clamp_min(0), n_long - 1)
    ix, iy, iz = idx.unbind(1)
    cube = rho64[ix[:, :, None, None], iy[:, None, :, None], iz[:, None, None, :]]  # (B, 4, 4, 4)
    interp = _catmull_rom_1d if method == "catmull-rom" else _neville_1d
    tx, ty, tz = t.unbind(-1)
    vals = interp(cube, tz[:, None, None])  # along z -> (B, 4, 4)
    vals = interp(vals, ty[:, None])  # along y -> (B, 4)
    vals = interp(vals, tx)  # along x -> (B,)
    nan = torch.full_like(vals, float("nan"))
    fill = torch.full_like(vals, float(fill_value))
    vals = torch.where(outside, fill, torch.where(finite, vals, nan))
    return vals.reshape(lead)
