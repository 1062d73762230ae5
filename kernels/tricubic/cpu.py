"""CPU tricubic interpolation: C++/OpenMP kernels (``tricubic.cpp``) behind an autograd Function.

The kernel streams points one at a time (voxel coordinates in float64, neighbourhood
contraction in the map's dtype, prefetching a few points ahead because random points on
a large map are bound by memory latency), so any number of points needs no index
buffers. The map gradient is an atomic-free, deterministic partitioned scatter: each
thread owns a slab of x-planes.
"""

from __future__ import annotations

import torch

from kernels._opdef import eager_function, register
from kernels._util import to_float32
from kernels.crystal import GridSpec
from kernels.tricubic import op_def, sample

__all__ = ["tricubic_cpu"]

try:
    from kernels.tricubic import _tricubic as _ext
except ImportError as exc:  # the dispatcher turns this into "cannot be imported (...)"
    raise ImportError(
        f"the C++ tricubic kernel is not built ({exc}); run `pip install --no-build-isolation -e .` "
        "in the repository (needs a C++17 compiler)"
    ) from exc

_DTYPES = (torch.float32, torch.float64)


def _forward(state, rho, points) -> tuple[torch.Tensor]:
    """``(values,)`` at ``points`` (N, 3, ``rho``'s dtype, C-contiguous), in ``rho``'s dtype."""
    params, method, periodic, fill_value, _, _ = state
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
    return (out,)


def _backward(state, grad_out, rho, points) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_rho, grad_points)``, each (0,) unless asked for; the map gradient is deterministic."""
    params, method, periodic, _, need_rho, need_points = state
    if grad_out.dtype != rho.dtype:
        grad_out = grad_out.to(rho.dtype)
    if not grad_out.is_contiguous():
        grad_out = grad_out.contiguous()
    # C-contiguous whatever rho's layout (zeros_like would copy a Fortran-ordered map's strides).
    grad_rho = torch.zeros(rho.shape, dtype=rho.dtype) if need_rho else rho.new_empty(0)
    grad_points = torch.empty_like(points) if need_points else points.new_empty(0)
    if points.shape[0] and (need_rho or need_points):
        _ext.backward(
            rho.detach(),
            points.detach(),
            grad_out,
            grad_points if need_points else None,
            grad_rho if need_rho else None,
            params,
            method=method,
            periodic=periodic,
            n_threads=torch.get_num_threads(),
        )
    elif need_points:
        grad_points.zero_()
    return grad_rho, grad_points


TRICUBIC_CPU_OP = op_def("cpu", lambda method: method, _forward, _backward)
_TricubicCPU = eager_function(TRICUBIC_CPU_OP)
register(TRICUBIC_CPU_OP)


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
    out = sample(
        torch.ops.kernels.tricubic_cpu, _TricubicCPU, _forward, rho, grid, flat, method, method, mode, fill_value
    )
    return out.reshape(lead)
