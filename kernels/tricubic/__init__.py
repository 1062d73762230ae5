"""Tricubic interpolation of maps: one public function, three backends.

``reference`` (float64 torch, the truth), ``cpu`` (C++/OpenMP) and ``triton`` (CUDA).
:func:`tricubic_sample` validates its input, picks a backend through
:mod:`kernels.dispatch` and issues the bounded-mode warning.
"""

from __future__ import annotations

import math
import warnings

import torch

from kernels._util import finite_number
from kernels.crystal import GridError, GridSpec
from kernels.dispatch import get_backend
from kernels.tricubic.reference import METHODS, MODES, outside_mask, voxel_coordinates

__all__ = ["tricubic_sample", "OutsideMapWarning", "METHODS", "MODES"]

# Points per chunk when counting bounded-mode misses: bounds the float64 temporaries.
_COUNT_CHUNK = 1 << 20


class OutsideMapWarning(UserWarning):
    """Some points of a bounded-mode call fell too close to (or past) the edge of the map."""


def _count_outside(points: torch.Tensor, grid: GridSpec, dtype: torch.dtype) -> int:
    """How many points' 4×4×4 neighbourhoods leave the box, as the backend computing in ``dtype`` sees them."""
    flat = points.reshape(-1, 3)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.shape[0], _COUNT_CHUNK):
        chunk = flat[start : start + _COUNT_CHUNK].detach().to(dtype)
        total += outside_mask(voxel_coordinates(chunk, grid), grid.shape).sum()
    return int(total)  # one host sync per bounded call


def tricubic_sample(
    rho: torch.Tensor,
    grid: GridSpec,
    points: torch.Tensor,
    *,
    method: str = "catmull-rom",
    mode: str = "periodic",
    fill_value: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Sample a map at Cartesian points by tricubic interpolation.

    The 4×4×4 voxels around each point (starting one voxel below the voxel that
    contains it, as gemmi does) are interpolated along each axis with a 4-point scheme.

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape
        Map values, float32 (``cpu``, ``triton``) or float64 (``reference``, ``cpu``).
    grid : GridSpec
        Where voxel (i, j, k) of ``rho`` sits: fractional ``((origin + (i, j, k)) / sampling)``.
    points : torch.Tensor, shape (..., 3)
        Cartesian positions in Å, on the same device as ``rho``. Any leading shape.
    method : {"catmull-rom", "lagrange"}
        ``catmull-rom`` matches gemmi's ``interpolate_position_array(order=3)`` (C¹
        smooth); ``lagrange`` is the 4-point Lagrange polynomial (Neville's scheme, as
        nanoBragg's ``polin3``), continuous but with gradient jumps at grid nodes.
    mode : {"periodic", "bounded"}
        ``periodic`` wraps around a whole-cell map (``grid.shape == grid.sampling``);
        ``bounded`` treats the map as a box: a point whose neighbourhood leaves it gets
        ``fill_value`` and zero gradient, and one :class:`OutsideMapWarning` per call
        says how many points did.
    fill_value : float
        Value for points outside a bounded map.
    backend : {"auto", "reference", "cpu", "triton"}
        ``auto`` runs ``cpu`` for CPU tensors and ``triton`` for CUDA tensors.

    Returns
    -------
    torch.Tensor, shape points.shape[:-1]
        float64 from ``reference``; the map's dtype from ``cpu``; float32 from
        ``triton``. NaN where a point is not finite. Differentiable with respect to
        ``rho`` and ``points``.

    Raises
    ------
    TypeError
        ``rho`` or ``points`` is not a floating tensor, or ``grid`` is not a GridSpec.
    ValueError
        Wrong shapes, unknown ``method``/``mode``, or ``rho`` and ``points`` on different devices.
    kernels.GridError
        ``mode="periodic"`` on a grid that does not cover the whole cell.
    kernels.BackendError
        The backend asked for cannot run here.
    """
    if not isinstance(grid, GridSpec):
        raise TypeError(f"grid must be a kernels.GridSpec, got {type(grid).__name__}")
    for name, t in (("rho", rho), ("points", points)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point torch tensor, got {got}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)}")
    if tuple(rho.shape) != grid.shape:
        raise ValueError(f"rho has shape {tuple(rho.shape)} but the grid is {grid.shape}; pass the map of this grid")
    if points.ndim < 1 or points.shape[-1] != 3:
        raise ValueError(f"points must have shape (..., 3) (Cartesian x, y, z in Å), got {tuple(points.shape)}")
    if rho.device != points.device:
        raise ValueError(
            f"rho is on {rho.device} but points are on {points.device}; move both to one device (e.g. points.to(rho.device))"
        )
    if mode == "periodic" and grid.shape != grid.sampling:
        raise GridError(
            f"mode='periodic' wraps a whole-cell map, but this grid's shape {grid.shape} differs from its sampling "
            f"{grid.sampling} (a box); use mode='bounded' for a box map"
        )
    if type(fill_value) is not float or math.isinf(fill_value):  # the common case costs one compare
        fill_value = finite_number(fill_value, "fill_value", allow_nan=True)
    name, fn = get_backend("tricubic", rho.device, backend)
    if mode == "bounded" and points.numel():
        compute = {"reference": torch.float64, "triton": torch.float32}.get(name, rho.dtype)
        if compute not in (torch.float32, torch.float64):
            compute = torch.float32
        n_out = _count_outside(points, grid, compute)
        if n_out:
            n_all = math.prod(points.shape[:-1])
            warnings.warn(
                f"tricubic_sample: {n_out} of {n_all} points lie within 2 voxels of the edge of the "
                f"{grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} box map (or outside it) and got fill_value="
                f"{fill_value}; use a larger box or mode='periodic' on a whole-cell map",
                OutsideMapWarning,
                stacklevel=2,
            )
    return fn(rho, grid, points, method, mode, fill_value)
