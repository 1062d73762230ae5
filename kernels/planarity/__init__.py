"""Planarity restraint: find planar groups, and their negative log-likelihood.

:func:`find_planes` turns a model into a :class:`PlaneSet`; :func:`planarity_nll` scores
atom positions against it (weighted least-squares plane per group, docs/kernels.md), with a
float64 reference, a C++ CPU path and a Triton GPU path.
"""

from __future__ import annotations

import torch

from kernels._util import assume_constant_result
from kernels.dispatch import BackendError, get_backend
from kernels.planarity.planes import (
    DEFAULT_SIGMA,
    PLANE_DEFINITIONS,
    PlaneSet,
    check_inputs,
    find_planes,
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
# Eager calls go straight to the backends' autograd Functions: a custom op's dispatch adds host time
# to every call, and the eager path is where that time is counted. Under torch.compile the backend
# is picked here by name (dispatch is host code dynamo does not trace) and its function calls its
# custom op instead (``kernels::planarity_cpu``, ``kernels::planarity_triton``), built from the same
# definition as its eager Function (kernels._opdef). Dynamo puts each in the graph as one node, so
# ``torch.compile(fullgraph=True)`` compiles a loop that calls planarity_nll.


@assume_constant_result
def _backend_name(device_type: str, backend: str) -> str:
    return get_backend("planarity", device_type, backend)[0]


def _compiled_planarity_nll(xyz: torch.Tensor, planes: PlaneSet, backend: str) -> torch.Tensor:
    name = _backend_name(xyz.device.type, backend)
    if name == "reference":  # plain torch: dynamo traces it
        from kernels.planarity.reference import planarity_nll_reference

        return planarity_nll_reference(xyz, planes)
    if name == "cpu":
        from kernels.planarity.cpu import planarity_nll_cpu

        return planarity_nll_cpu(xyz, planes)
    if name == "triton":
        from kernels.planarity.triton import planarity_nll_triton

        return planarity_nll_triton(xyz, planes)
    raise BackendError(
        f"planarity backend {name!r} is a registered Python function, not a torch.library op, so planarity_nll "
        "does not put it in a compiled graph; call it outside the compiled function, or compile with "
        "backend='cpu' or 'triton'"
    )
