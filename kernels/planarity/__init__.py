"""Planarity restraint: find planar groups, and their negative log-likelihood.

:func:`find_planes` turns a model into a :class:`PlaneSet`; :func:`planarity_nll` scores
atom positions against it (weighted least-squares plane per group, docs/kernels.md), with a
float64 reference, a C++ CPU path and a Triton GPU path.
"""

from __future__ import annotations

import torch

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
    _, fn = get_backend("planarity", xyz.device, backend)
    return fn(xyz, planes)
