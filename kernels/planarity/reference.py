"""float64 reference of the planarity NLL: weighted plane fit with ``torch.linalg.eigh``, autograd.

Obviously correct and slow-ish: the truth the fast paths are tested against.
"""

from __future__ import annotations

import torch

from kernels.planarity.planes import PlaneSet, check_inputs

__all__ = ["planarity_nll_reference", "DEGENERATE_GAP"]

DEGENERATE_GAP = 1e-5
"""A plane is degenerate (no defined normal: collinear or coincident atoms) when the gap
between the two smallest eigenvalues of its weighted covariance is at most this fraction
of the covariance's trace. float32 rounding puts about 1e-7·trace of noise into the
eigenvalues of exactly collinear atoms, so 1e-5 is 100× above it; real planar groups have
gaps above 1e-2·trace. Every backend uses the same threshold."""


def planarity_nll_reference(xyz: torch.Tensor, planes: PlaneSet) -> torch.Tensor:
    """Planarity negative log-likelihood in float64, differentiable by autograd.

    NLL = Σ_planes Σ_atoms ½ (d_a/σ_a)² + log σ_a + ½ log 2π, with d_a = (x_a − c)·n,
    c the centroid weighted by 1/σ² and n the eigenvector of the smallest eigenvalue of
    the weighted covariance Σ_a (x_a − c)(x_a − c)ᵀ/σ_a² (``torch.linalg.eigh``).

    Parameters
    ----------
    xyz : torch.Tensor, shape (N, 3), floating
        Atom positions in Å (cast to float64).
    planes : PlaneSet
        Planes whose indices point into ``xyz``.

    Returns
    -------
    torch.Tensor, shape (), float64
        The NLL. A degenerate plane (collinear or coincident atoms, a non-finite
        coordinate; see :data:`DEGENERATE_GAP`) adds only its constant ``log σ`` terms and
        has zero gradient.
    """
    check_inputs(xyz, planes)
    planes = planes.to(xyz.device)
    x = xyz.to(torch.float64)
    if len(planes) == 0:
        return (x * 0.0).sum() + planes.constant
    w = planes.weight(torch.float64)  # (P, K), 0 in padding
    pts = x[planes.index.long()]  # (P, K, 3)
    # A plane with a non-finite coordinate is zeroed before anything is formed from it,
    # so that no NaN reaches the backward pass (NaN·0 is NaN).
    finite_pts = torch.isfinite(pts).all(dim=2).all(dim=1)
    pts = torch.where(finite_pts[:, None, None], pts, torch.zeros_like(pts))
    wsum = w.sum(dim=1)  # (P,)
    centroid = (w[..., None] * pts).sum(dim=1) / wsum[:, None]
    y = pts - centroid[:, None, :]
    cov = torch.einsum("pk,pki,pkj->pij", w, y, y)  # (P, 3, 3)

    # Which planes have a normal: decided without gradient, then degenerate planes get a
    # harmless stand-in matrix so that eigh's backward (1/(λi − λj)) stays finite.
    with torch.no_grad():
        finite = torch.isfinite(cov).all(dim=(1, 2)) & finite_pts
        stand_in = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device=x.device))
        lam = torch.linalg.eigvalsh(torch.where(finite[:, None, None], cov, stand_in))
        trace = lam.sum(dim=1)
        ok = finite & (trace > 0) & (lam[:, 1] - lam[:, 0] > DEGENERATE_GAP * trace)
    cov = torch.where(ok[:, None, None], cov, stand_in)
    y = torch.where(ok[:, None, None], y, torch.zeros_like(y))
    normal = torch.linalg.eigh(cov).eigenvectors[:, :, 0]  # (P, 3), smallest eigenvalue first
    d = (y * normal[:, None, :]).sum(dim=-1)  # (P, K)
    return 0.5 * (w * d * d).sum() + planes.constant
