"""CPU tricubic interpolation: C++/OpenMP kernels (``tricubic.cpp``) behind an autograd Function.

The kernel streams points one at a time (voxel coordinates in float64, neighbourhood
contraction in the map's dtype, prefetching a few points ahead because random points on
a large map are bound by memory latency), so any number of points needs no index
buffers. The map gradient is an atomic-free, deterministic partitioned scatter: each
thread owns a slab of x-planes.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from kernels._util import to_float32
from kernels.crystal import GridSpec
from kernels.tricubic import cached_grid_parameters

__all__ = ["tricubic_cpu"]

try:
    from kernels.tricubic import _tricubic as _ext
except ImportError as exc:  # the dispatcher turns this into "cannot be imported (...)"
    raise ImportError(
        f"the C++ tricubic kernel is not built ({exc}); run `pip install --no-build-isolation -e .` "
        "in the repository (needs a C++17 compiler)"
    ) from exc

_DTYPES = (torch.float32, torch.float64)


def _forward(rho, points, params, method: str, periodic: bool, fill_value: float) -> torch.Tensor:
    """Values at ``points`` (N, 3, ``rho``'s dtype, C-contiguous), in ``rho``'s dtype."""
    out = torch.empty(points.shape[0], dtype=rho.dtype)
    if points.shape[0]:
        _ext.forward(
            rho.detach(),
            points.detach(),
            out,
            params,
            method=method,
            periodic=periodic,
            fill_value=float(fill_value),
            n_threads=torch.get_num_threads(),
        )
    return out


def _backward(rho, points, params, grad_out, method: str, periodic: bool, need_rho: bool, need_points: bool):
    """``(grad_rho, grad_points)``, each None unless asked for; the map gradient is deterministic."""
    if grad_out.dtype != rho.dtype:
        grad_out = grad_out.to(rho.dtype)
    if not grad_out.is_contiguous():
        grad_out = grad_out.contiguous()
    # C-contiguous whatever rho's layout (zeros_like would copy a Fortran-ordered map's strides).
    grad_rho = torch.zeros(rho.shape, dtype=rho.dtype) if need_rho else None
    grad_points = torch.empty_like(points) if need_points else None
    if points.shape[0] and (need_rho or need_points):
        _ext.backward(
            rho.detach(),
            points.detach(),
            grad_out,
            grad_points,
            grad_rho,
            params,
            method=method,
            periodic=periodic,
            n_threads=torch.get_num_threads(),
        )
    elif need_points:
        grad_points.zero_()
    return grad_rho, grad_points


class _TricubicCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rho, points, params, method, periodic, fill_value):
        out = _forward(rho, points, params, method, periodic, fill_value)
        ctx.save_for_backward(rho, points, params)
        ctx.method, ctx.periodic = method, periodic
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        rho, points, params = ctx.saved_tensors
        grad_rho, grad_points = _backward(
            rho, points, params, grad_out, ctx.method, ctx.periodic, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        return grad_rho, grad_points, None, None, None, None


def _prepare(rho: torch.Tensor, points: torch.Tensor):
    """The map in a kernel dtype (its strides kept) and C-contiguous (N, 3) points of its dtype.

    The map is never copied for its layout: .contiguous() of a Fortran-ordered view (numpy's
    view of a gemmi grid) would copy the whole map on every call (35 MB for 3WIP), more than
    interpolating 10^5 points costs. C order is still the fast layout (vector row loads).
    """
    if rho.dtype not in _DTYPES:
        rho = to_float32(rho, "tricubic_sample")
    if points.dtype != rho.dtype:
        points = to_float32(points, "tricubic_sample") if rho.dtype == torch.float32 else points.to(rho.dtype)
    if points.ndim != 2:
        points = points.reshape(-1, 3)
    if not points.is_contiguous():
        points = points.contiguous()
    return rho, points


def tricubic_cpu(
    rho: torch.Tensor,
    grid: GridSpec,
    points: torch.Tensor,
    method: str = "catmull-rom",
    mode: str = "periodic",
    fill_value: float = 0.0,
) -> torch.Tensor:
    """Tricubic interpolation on the CPU (C++/OpenMP, ``torch.get_num_threads()`` threads).

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape, float32 or float64, CPU
        The map, any strides (read in place, never copied; C order, z fastest, is the
        fastest layout). Other floating dtypes are cast to float32 (with a warning once).
    grid : GridSpec
    points : torch.Tensor, shape (..., 3), CPU
        Cartesian positions in Å; cast to ``rho``'s dtype (float64 points on a float32
        map warn once: the kernel then works from float32 positions).
    method : {"catmull-rom", "lagrange"}
    mode : {"periodic", "bounded"}
    fill_value : float

    Returns
    -------
    torch.Tensor, shape points.shape[:-1], dtype of ``rho``
        Differentiable with respect to ``rho`` and ``points`` (analytic backward,
        deterministic map gradient).
    """
    lead = points.shape[:-1]
    rho, flat = _prepare(rho, points)
    params = cached_grid_parameters(grid, rho.device)
    out = _TricubicCPU.apply(rho, flat, params, method, mode == "periodic", fill_value)
    return out.reshape(lead)
