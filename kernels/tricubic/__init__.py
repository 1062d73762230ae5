"""Tricubic interpolation of maps: one public function, three backends.

``reference`` (float64 torch, the truth), ``cpu`` (C++/OpenMP) and ``triton`` (CUDA).
:func:`tricubic_sample` validates its input, picks a backend through
:mod:`kernels.dispatch` and issues the bounded-mode warning.
"""

from __future__ import annotations

import math
import warnings

import torch

from kernels._util import assume_constant_result, finite_number
from kernels.crystal import GridError, GridSpec
from kernels.dispatch import get_backend
from kernels.tricubic.reference import METHODS, MODES, grid_parameters, outside_mask, voxel_coordinates

__all__ = ["tricubic_sample", "OutsideMapWarning", "METHODS", "MODES"]

# Points per chunk when counting bounded-mode misses: bounds the float64 temporaries.
_COUNT_CHUNK = 1 << 20

_params: dict = {}  # (grid, device) -> grid_parameters(grid, device)
_MAX_PARAMS = 64


def cached_grid_parameters(grid: GridSpec, device: torch.device) -> torch.Tensor:
    """:func:`~kernels.tricubic.reference.grid_parameters` on ``device``, made once per grid.

    A fresh one costs a few small ops and, on a GPU, a host-to-device copy per call (which
    cannot run inside a CUDA graph capture); grids compare by value, so equal grids share one
    tensor. At most 64 are kept (the oldest goes first).
    """
    key = (grid, device)
    params = _params.get(key)
    if params is None:
        if len(_params) >= _MAX_PARAMS:
            _params.pop(next(iter(_params)))
        params = _params[key] = grid_parameters(grid, device)
    return params


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
    if torch.compiler.is_compiling():
        return _compiled_tricubic(rho, grid, points, method, mode, fill_value, backend)
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


# --------------------------------------------------------------------------- torch.compile
#
# Eager calls go straight to the backends' autograd Functions (a custom op's dispatch would
# add host time to each). Under torch.compile the public function calls the custom ops
# below, single graph nodes whose fake implementations give the output shapes, so
# ``torch.compile(fullgraph=True)`` compiles a loop that calls tricubic_sample. The bounded-mode
# warning needs the count of points outside on the host (a sync, a graph break), so a compiled
# call does not issue it; the values and gradients are the same.
#
# The ops take the map, the points and an int, the handle of the grid's parameters on the map's
# device, never a CPU tensor. The parameters are made while dynamo traces the call
# (:func:`_compiled_params`, which dynamo runs instead of tracing), before any compiled code runs:
# nothing an op keeps is allocated inside a CUDA graph's private pool (``mode="reduce-overhead"``).

_compiled: list[torch.Tensor] = []  # handle -> the 15 grid parameters; kept while compiled graphs may run
_handles: dict[tuple, int] = {}


@assume_constant_result
def _backend_name(device_type: str, backend: str) -> str:
    return get_backend("tricubic", device_type, backend)[0]


@assume_constant_result
def _compiled_params(frac: torch.Tensor, lattice: torch.Tensor, device: str) -> int:
    """The handle of the grid parameters (``grid_parameters``) on ``device``, made on the first call.

    ``frac`` is the cell's (3, 3) fractionalisation matrix and ``lattice`` the grid's sampling then
    its origin, (6,) float64. Both come in as tensors: a tensor reaches this function as its value,
    where ints that differ between two traces of one function would become symbolic and could not.
    """
    params = torch.cat([frac.detach().to(torch.float64).reshape(9).cpu(), lattice.to(torch.float64).cpu()])
    key = (tuple(params.tolist()), device)
    handle = _handles.get(key)
    if handle is None:
        handle = _handles[key] = len(_compiled)
        _compiled.append(params.to(device))
    return handle


def _compiled_tricubic(rho, grid, points, method, mode, fill_value, backend):
    name = _backend_name(rho.device.type, backend)
    if name == "reference":  # plain torch: dynamo traces it
        from kernels.tricubic.reference import tricubic_reference

        return tricubic_reference(rho, grid, points, method, mode, fill_value)
    if name == "triton":
        from kernels.tricubic.triton import _prepare
    else:
        from kernels.tricubic.cpu import _prepare
    lead = points.shape[:-1]
    rho, flat = _prepare(rho, points)
    lattice = torch.tensor([*grid.sampling, *grid.origin], dtype=torch.float64)
    handle = _compiled_params(grid.cell.frac, lattice, str(rho.device))
    out = _tricubic_op(rho, flat, handle, method, mode == "periodic", fill_value, name)
    return out.reshape(lead)


def _backend_module(name: str):
    if name == "triton":
        from kernels.tricubic import triton as module
    else:
        from kernels.tricubic import cpu as module
    return module


def _method_arg(name: str, method: str):
    """The method as the backend's kernels take it (Triton: a code, C++: the name)."""
    if name == "triton":
        from kernels.tricubic.triton import _METHOD_CODE

        return _METHOD_CODE[method]
    return method


@torch.library.custom_op("kernels::tricubic_sample", mutates_args=())
def _tricubic_op(
    rho: torch.Tensor, points: torch.Tensor, handle: int, method: str, periodic: bool, fill_value: float, backend: str
) -> torch.Tensor:
    """Values at ``points`` (N, 3) of the prepared map (see the backends' ``_prepare``)."""
    params = _compiled[handle]
    return _backend_module(backend)._forward(rho, points, params, _method_arg(backend, method), periodic, fill_value)


@_tricubic_op.register_fake
def _(rho, points, handle, method, periodic, fill_value, backend):
    return points.new_empty(points.shape[:1], dtype=rho.dtype)


@torch.library.custom_op("kernels::tricubic_sample_backward", mutates_args=())
def _tricubic_backward_op(
    rho: torch.Tensor, points: torch.Tensor, handle: int, grad_out: torch.Tensor, method: str, periodic: bool,
    need_rho: bool, need_points: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(grad_rho, grad_points)``; one not asked for is an empty (0,) tensor."""
    grad_rho, grad_points = _backend_module(backend)._backward(
        rho, points, _compiled[handle], grad_out, _method_arg(backend, method), periodic, need_rho, need_points
    )
    empty = rho.new_empty((0,))
    return grad_rho if need_rho else empty, grad_points if need_points else empty


@_tricubic_backward_op.register_fake
def _(rho, points, handle, grad_out, method, periodic, need_rho, need_points, backend):
    empty = rho.new_empty((0,))
    return rho.new_empty(rho.shape) if need_rho else empty, points.new_empty(points.shape) if need_points else empty


def _setup(ctx, inputs, output):
    rho, points, handle, method, periodic, _, backend = inputs
    ctx.save_for_backward(rho, points)
    ctx.args = (handle, method, periodic, backend)


def _backward(ctx, grad_out):
    rho, points = ctx.saved_tensors
    handle, method, periodic, backend = ctx.args
    need_rho, need_points = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_rho, grad_points = _tricubic_backward_op(
        rho, points, handle, grad_out, method, periodic, need_rho, need_points, backend
    )
    return (grad_rho if need_rho else None, grad_points if need_points else None) + (None,) * 5


_tricubic_op.register_autograd(_backward, setup_context=_setup)
