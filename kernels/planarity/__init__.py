"""Planarity restraint: find planar groups, and their negative log-likelihood.

:func:`find_planes` turns a model into a :class:`PlaneSet`; :func:`planarity_nll` scores
atom positions against it (weighted least-squares plane per group, docs/kernels.md), with a
float64 reference, a C++ CPU path and a Triton GPU path.
"""

from __future__ import annotations

import torch

from kernels._util import assume_constant_result, to_float32
from kernels.dispatch import get_backend
from kernels.planarity.planes import (
    DEFAULT_SIGMA,
    PLANE_DEFINITIONS,
    PlaneSet,
    check_inputs,
    find_planes,
    live_plane_set,
)

__all__ = ["DEFAULT_SIGMA", "PLANE_DEFINITIONS", "PlaneSet", "find_planes", "planarity_nll"]


def planarity_nll(xyz: torch.Tensor, planes: PlaneSet, *, backend: str = "auto") -> torch.Tensor:
    """Negative log-likelihood of atom positions under planarity restraints.

    NLL = Σ_planes Σ_atoms [ ½ (d_a/σ_a)² + log σ_a + ½ log 2π ], d_a = (x_a − c)·n, where
    each plane is the weighted least-squares fit of its atoms (weights 1/σ²: weighted
    centroid c, normal n = eigenvector of the smallest eigenvalue of the weighted
    covariance). Because the plane minimises exactly this sum, ∂NLL/∂x_a = (d_a/σ_a²)·n.

    Parameters
    ----------
    xyz : torch.Tensor, shape (N, 3), floating
        Atom positions in Å, rows in the order of the model the planes were found on.
    planes : PlaneSet
        From :func:`find_planes` (or :meth:`PlaneSet.from_lists`).
    backend : {"auto", "reference", "cpu", "triton"}
        ``"reference"``: float64 with ``torch.linalg.eigh`` and autograd; ``"cpu"``: C++,
        float32 or float64 (fitted in double), analytic backward; ``"triton"``: float32 on
        CUDA, analytic backward. ``"auto"`` picks triton on CUDA, cpu on the CPU.

    Returns
    -------
    torch.Tensor, shape ()
        float64 (reference, or cpu on float64 input) or float32; differentiable with
        respect to ``xyz``. A degenerate plane (collinear or coincident atoms, a NaN or
        infinite coordinate) adds only its ``log σ`` constant and gets zero gradient.

    Raises
    ------
    ValueError, TypeError
        ``xyz`` is not (N, 3) floating, or N differs from the planes' model.
    kernels.BackendError
        The asked-for backend cannot run here (the message says why).
    """
    check_inputs(xyz, planes)
    if torch.compiler.is_compiling():
        return _compiled_planarity_nll(xyz, planes, backend)
    _, fn = get_backend("planarity", xyz.device, backend)
    return fn(xyz, planes)


# --------------------------------------------------------------------------- torch.compile
#
# Eager calls go straight to the backends' autograd Functions: a custom op's dispatch adds
# host time to every call, and the eager path is where that time is counted. Under
# torch.compile the public function calls the custom ops below instead, which dynamo puts in
# the graph as single nodes (their fake implementations give the output shapes), so
# ``torch.compile(fullgraph=True)`` compiles a loop that calls planarity_nll.
#
# The ops take ``xyz`` and an int, the handle of the PlaneSet's tables on xyz's device, never the
# PlaneSet's own (CPU) tensors. The tables are made while dynamo traces the call
# (:func:`_compiled_handle`, which dynamo runs instead of tracing, like
# ``torch.compiler.assume_constant_result``), before any compiled code runs. So nothing an op
# keeps is allocated while ``mode="reduce-overhead"`` routes allocations to its CUDA graph's
# private pool: CUDA graph trees refuse to replay when a tensor made during warm-up or capture
# outlives the graph without being one of its outputs. A compiled Triton call takes its
# scratch (the ticket, zeroed, and the partial sums) as temporaries of the call, so a replay
# zeroes the ticket too.

# handle -> (PlaneSet, backend, device tables): the PlaneSet for "cpu", the Triton plan for
# "triton". Kept for the process: a compiled graph may run again as long as it lives.
_compiled: list[tuple] = []
_handles: dict[tuple, int] = {}


@assume_constant_result
def _backend_name(device_type: str, backend: str) -> str:
    return get_backend("planarity", device_type, backend)[0]


@assume_constant_result
def _compiled_handle(token: str, device: str, backend: str) -> int:
    """The handle of the tables of the PlaneSet ``token`` on ``device`` for ``backend``, made on the first call."""
    key = (token, device, backend)
    handle = _handles.get(key)
    if handle is None:
        planes = live_plane_set(token)
        if backend == "cpu":
            tables = planes
        else:
            from kernels.planarity.triton import _plan

            tables = _plan(planes, torch.device(device), None)
        handle = _handles[key] = len(_compiled)
        _compiled.append((planes, backend, tables))
    return handle


def _compiled_planarity_nll(xyz: torch.Tensor, planes: PlaneSet, backend: str) -> torch.Tensor:
    name = _backend_name(xyz.device.type, backend)
    if name == "reference":  # plain torch: dynamo traces it
        from kernels.planarity.reference import planarity_nll_reference

        return planarity_nll_reference(xyz, planes)
    if xyz.dtype != torch.float32 and not (name == "cpu" and xyz.dtype == torch.float64):
        xyz = to_float32(xyz, "planarity_nll")
    if len(planes) == 0:
        return (xyz * 0.0).sum() + planes.constant
    handle = _compiled_handle(planes._token, str(xyz.device), name)
    loss, _ = _planarity_op(xyz.contiguous(), handle)
    return loss


def _table_shape(handle: int, xyz_dtype: torch.dtype) -> tuple[int, torch.dtype]:
    planes, backend, _ = _compiled[handle]
    p, k = planes.index.shape
    return p * k + p * 3, xyz_dtype if backend == "cpu" else torch.float32


@torch.library.custom_op("kernels::planarity_nll", mutates_args=())
def _planarity_op(xyz: torch.Tensor, handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, table)``: the NLL and the (P·K + P·3,) coefficients and normals of the fit."""
    _, backend, tables = _compiled[handle]
    if backend == "cpu":
        from kernels.planarity.cpu import fit_table

        return fit_table(xyz, tables)
    from kernels.planarity.triton import _call_scratch, _forward

    return _forward(xyz, tables, True, _call_scratch(tables))


@_planarity_op.register_fake
def _(xyz, handle):
    size, dtype = _table_shape(handle, xyz.dtype)
    return xyz.new_empty((), dtype=dtype), xyz.new_empty((size,), dtype=dtype)


@torch.library.custom_op("kernels::planarity_nll_backward", mutates_args=())
def _planarity_backward_op(table: torch.Tensor, grad_out: torch.Tensor, handle: int) -> torch.Tensor:
    """∂NLL/∂xyz, shape (n_atoms, 3), from the forward's table."""
    planes, backend, tables = _compiled[handle]
    if backend == "cpu":
        from kernels.planarity.cpu import scatter_table

        return scatter_table(table, grad_out, tables)
    from kernels.planarity.triton import _backward

    return _backward(table, grad_out, tables)


@_planarity_backward_op.register_fake
def _(table, grad_out, handle):
    return table.new_empty((_compiled[handle][0].n_atoms, 3))


def _setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])
    ctx.handle = inputs[1]


def _backward(ctx, grad_loss, _grad_table):
    (table,) = ctx.saved_tensors
    return _planarity_backward_op(table, grad_loss, ctx.handle), None


_planarity_op.register_autograd(_backward, setup_context=_setup)
