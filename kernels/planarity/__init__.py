"""Planarity restraint: find planar groups, and their negative log-likelihood.

:func:`find_planes` turns a model into a :class:`PlaneSet`; :func:`planarity_nll` scores
atom positions against it (weighted least-squares plane per group, docs/kernels.md), with a
float64 reference, a C++ CPU path and a Triton GPU path.
"""

from __future__ import annotations

import weakref

import torch

from kernels._util import assume_constant_result, to_float32
from kernels.dispatch import get_backend
from kernels.planarity.planes import DEFAULT_SIGMA, PLANE_DEFINITIONS, PlaneSet, check_inputs, find_planes

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
# ``torch.compile(fullgraph=True)`` compiles a loop that calls planarity_nll. The ops take the
# PlaneSet's own tensors, so the graph has no Python object in it; the device tables are
# built from them on the first run and kept while the index tensor lives.


@assume_constant_result
def _backend_name(device_type: str, backend: str) -> str:
    return get_backend("planarity", device_type, backend)[0]


def _compiled_planarity_nll(xyz: torch.Tensor, planes: PlaneSet, backend: str) -> torch.Tensor:
    name = _backend_name(xyz.device.type, backend)
    if name == "reference":  # plain torch: dynamo traces it
        from kernels.planarity.reference import planarity_nll_reference

        return planarity_nll_reference(xyz, planes)
    if xyz.dtype != torch.float32 and not (name == "cpu" and xyz.dtype == torch.float64):
        xyz = to_float32(xyz, "planarity_nll")
    if len(planes) == 0:
        return (xyz * 0.0).sum() + planes.constant
    loss, _ = _planarity_op(xyz.contiguous(), planes.index, planes.sigma, name)
    return loss


# id(index tensor) -> (weak reference to it, PlaneSet); tensors cannot be WeakKeyDictionary
# keys (their == is elementwise), so a dead or reused id is told apart by the reference.
_op_planes: dict[int, tuple[weakref.ref, PlaneSet]] = {}


def _planes_of(index: torch.Tensor, sigma: torch.Tensor, n_atoms: int) -> PlaneSet:
    """A PlaneSet over ``index``/``sigma`` (padding: σ = inf), the same object while both live."""
    hit = _op_planes.get(id(index))
    if hit is not None and hit[0]() is index and hit[1].sigma is sigma and hit[1].n_atoms == n_atoms:
        return hit[1]
    for key in [key for key, (ref, _) in _op_planes.items() if ref() is None]:
        del _op_planes[key]
    p = index.shape[0]
    planes = PlaneSet(
        index=index,
        sigma=sigma,
        size=torch.isfinite(sigma).sum(dim=1).to(torch.int32).cpu(),
        kinds=("plane",) * p,
        where=("",) * p,
        n_atoms=n_atoms,
    )
    _op_planes[id(index)] = (weakref.ref(index), planes)
    return planes


def _table_dtype(xyz_dtype: torch.dtype, backend: str) -> torch.dtype:
    return xyz_dtype if backend == "cpu" else torch.float32


@torch.library.custom_op("kernels::planarity_nll", mutates_args=())
def _planarity_op(
    xyz: torch.Tensor, index: torch.Tensor, sigma: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, table)``: the NLL and the (P·K + P·3,) coefficients and normals of the fit."""
    planes = _planes_of(index, sigma, xyz.shape[0])
    if backend == "cpu":
        from kernels.planarity.cpu import fit_table

        return fit_table(xyz, planes)
    from kernels.planarity.triton import _forward, _plan

    return _forward(xyz, _plan(planes, xyz.device, None), True)


@_planarity_op.register_fake
def _(xyz, index, sigma, backend):
    p, k = index.shape
    dtype = _table_dtype(xyz.dtype, backend)
    return xyz.new_empty((), dtype=dtype), xyz.new_empty((p * k + p * 3,), dtype=dtype)


@torch.library.custom_op("kernels::planarity_nll_backward", mutates_args=())
def _planarity_backward_op(
    table: torch.Tensor, grad_out: torch.Tensor, index: torch.Tensor, sigma: torch.Tensor, n_atoms: int, backend: str
) -> torch.Tensor:
    """∂NLL/∂xyz, shape (n_atoms, 3), from the forward's table."""
    planes = _planes_of(index, sigma, n_atoms)
    if backend == "cpu":
        from kernels.planarity.cpu import scatter_table

        return scatter_table(table, grad_out, planes)
    from kernels.planarity.triton import _backward, _plan

    return _backward(table, grad_out, _plan(planes, table.device, None))


@_planarity_backward_op.register_fake
def _(table, grad_out, index, sigma, n_atoms, backend):
    return table.new_empty((n_atoms, 3))


def _setup(ctx, inputs, output):
    xyz, index, sigma, backend = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1], index, sigma)
    ctx.n_atoms, ctx.backend = xyz.shape[0], backend


def _backward(ctx, grad_loss, _grad_table):
    table, index, sigma = ctx.saved_tensors
    return _planarity_backward_op(table, grad_loss, index, sigma, ctx.n_atoms, ctx.backend), None, None, None


_planarity_op.register_autograd(_backward, setup_context=_setup)
