"""Tricubic interpolation of maps: one public function, three backends.

``reference`` (float64 torch, the truth), ``cpu`` (C++/OpenMP) and ``triton`` (CUDA).
:func:`tricubic_sample` validates its input, picks a backend through
:mod:`kernels.dispatch` and issues the bounded-mode warning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from kernels._opdef import OpDef
from kernels._util import Handles, assume_constant_result, finite_number
from kernels.crystal import GridError, GridSpec
from kernels.dispatch import BackendError, get_backend
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


# --------------------------------------------------------------------------- the ops
#
# Each backend defines its op once (:func:`op_def`: ``kernels::tricubic_cpu``, ``kernels::tricubic_triton``)
# and builds its eager autograd Function from it. Eager calls apply that Function (a custom op's dispatch
# would add host time to each); under torch.compile :func:`sample` calls the custom op instead, one graph
# node whose fake implementation gives the output shape, so ``torch.compile(fullgraph=True)`` compiles a
# loop that calls tricubic_sample. The bounded-mode warning needs the count of points outside on the host
# (a sync, a graph break), so a compiled call does not issue it; the values and gradients are the same.
#
# The call state is ``(params, method, periodic, fill_value, need_rho, need_points)``: the grid's 15
# parameters (:func:`~kernels.tricubic.reference.grid_parameters`) on the map's device, the method as the
# backend's kernels take it (Triton: a code, C++: the name), and which gradients to compute. The op takes
# the grid as an int, the handle of its parameters (``_GRIDS``), made while dynamo traces the call
# (:func:`_compiled_grid`, which dynamo runs instead of tracing), before any compiled code runs: nothing
# an op keeps is allocated inside a CUDA graph's private pool (``mode="reduce-overhead"``).

_GRIDS = Handles()  # handle -> the 15 grid parameters on a device


@assume_constant_result
def _backend_name(device_type: str, backend: str) -> str:
    return get_backend("tricubic", device_type, backend)[0]


@assume_constant_result
def _compiled_grid(frac: torch.Tensor, lattice: torch.Tensor, device: str) -> int:
    """The handle of the grid parameters (``grid_parameters``) on ``device``, made on the first call.

    ``frac`` is the cell's (3, 3) fractionalisation matrix and ``lattice`` the grid's sampling then
    its origin, (6,) float64. Both come in as tensors: a tensor reaches this function as its value,
    where ints that differ between two traces of one function would become symbolic and could not.
    """
    params = torch.cat([frac.detach().to(torch.float64).reshape(9).cpu(), lattice.to(torch.float64).cpu()])
    return _GRIDS.get((tuple(params.tolist()), device), lambda: params.to(device))


def _compiled_tricubic(rho, grid, points, method, mode, fill_value, backend):
    name = _backend_name(rho.device.type, backend)
    if name == "reference":  # plain torch: dynamo traces it
        from kernels.tricubic.reference import tricubic_reference

        return tricubic_reference(rho, grid, points, method, mode, fill_value)
    if name == "cpu":
        from kernels.tricubic.cpu import tricubic_cpu

        return tricubic_cpu(rho, grid, points, method, mode, fill_value)
    if name == "triton":
        from kernels.tricubic.triton import tricubic_triton

        return tricubic_triton(rho, grid, points, method, mode, fill_value)
    raise BackendError(
        f"tricubic backend {name!r} is a registered Python function, not a torch.library op, so tricubic_sample "
        "does not put it in a compiled graph; call it outside the compiled function, or compile with "
        "backend='cpu' or 'triton'"
    )


def op_def(backend: str, method_arg: Callable[[str], object], forward: Callable, backward: Callable) -> OpDef:
    """The op of one backend, ``kernels::tricubic_<backend>``.

    ``tricubic_<backend>(rho, points, int grid, str method, bool periodic, float fill_value, bool need_rho,
    bool need_points) -> values``: ``rho`` and ``points`` (N, 3) as the backend's ``_prepare`` gives them,
    ``grid`` a handle of ``_GRIDS``, ``need_rho``/``need_points`` whether ``rho``/``points`` require a
    gradient (a gradient not asked for is a (0,) tensor). ``forward(state, rho, points) -> (values,)`` and
    ``backward(state, grad, rho, points) -> (grad_rho, grad_points)`` are the backend's launchers, with
    a (0,) tensor for a gradient not asked for; ``method_arg`` turns the method's name into what
    they take.
    """

    def call(inputs, params):
        grid, method, *rest = params
        return (_GRIDS[grid], method_arg(method), *rest)

    return OpDef(
        name=f"kernels::tricubic_{backend}",
        inputs=("Tensor rho", "Tensor points"),
        params=("int grid", "str method", "bool periodic", "float fill_value", "bool need_rho", "bool need_points"),
        grads=(0, 1),
        saved=0,
        call=call,
        forward=forward,
        backward=backward,
        fake=lambda rho, points, *_: (points.new_empty(points.shape[:1], dtype=rho.dtype),),
        fake_grads=lambda rho, points, grid, method, periodic, fill_value, need_rho, need_points: (
            rho.new_empty(rho.shape if need_rho else (0,)),
            points.new_empty(points.shape if need_points else (0,)),
        ),
    )


def sample(op, function, forward, rho, grid, points, method, method_arg, mode, fill_value) -> torch.Tensor:
    """A backend's values at ``points`` (N, 3), from its prepared inputs: while compiling its custom ``op``
    (``torch.ops.kernels.tricubic_<backend>``), else its eager autograd ``function`` (``forward`` alone when
    no gradient is wanted)."""
    periodic = mode == "periodic"
    grad = torch.is_grad_enabled()
    need_rho, need_points = grad and rho.requires_grad, grad and points.requires_grad
    if torch.compiler.is_compiling():
        lattice = torch.tensor([*grid.sampling, *grid.origin], dtype=torch.float64)
        handle = _compiled_grid(grid.cell.frac, lattice, str(rho.device))
        return op(rho, points, handle, method, periodic, fill_value, need_rho, need_points)
    state = (cached_grid_parameters(grid, rho.device), method_arg, periodic, fill_value, need_rho, need_points)
    if need_rho or need_points:
        return function.apply(state, rho, points)
    return forward(state, rho, points)[0]
