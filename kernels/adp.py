"""Anisotropic displacement parameters (ADPs): U tensors, their checks, blur and per-term Gaussians.

An atom with displacement tensor U (Cartesian, Å²) and form-factor term (a_k, b_k) has the density

    ρ_k(r) = occ · a_k · (2π)^{-3/2} · det(M_k)^{-1/2} · exp(−½ rᵀ M_k⁻¹ r),   M_k = U + b_k/(8π²) · I,

a normal distribution of covariance M_k. An isotropic atom is the case U = B/(8π²) · I, which gives
the familiar a_k (4π/B_k)^{3/2} exp(−4π² r²/B_k) with B_k = b_k + B. Every M_k of one atom shares
U's eigenvectors (adding a multiple of I moves only the eigenvalues), which the exact radius rule uses.

U is stored as six numbers per atom in gemmi's order: U11, U22, U33, U12, U13, U23.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "U_TO_B",
    "rounding_margin",
    "effective_u",
    "first_bad_adp",
    "bad_adp",
    "u_matrix",
    "with_blur",
    "adp_eigenvalues",
]

#: B = 8π² U: a displacement of U Å² spreads density as an isotropic B of 8π²U Å².
U_TO_B = 8 * math.pi**2


def u_matrix(u6: torch.Tensor) -> torch.Tensor:
    """Symmetric 3×3 matrices from six components.

    Parameters
    ----------
    u6 : torch.Tensor, shape (..., 6)
        U11, U22, U33, U12, U13, U23.

    Returns
    -------
    torch.Tensor, shape (..., 3, 3), same dtype and device (differentiable).
    """
    u11, u22, u33, u12, u13, u23 = u6.unbind(-1)
    rows = (
        torch.stack((u11, u12, u13), -1),
        torch.stack((u12, u22, u23), -1),
        torch.stack((u13, u23, u33), -1),
    )
    return torch.stack(rows, -2)


def adp_eigenvalues(u6: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of each U in Å², ascending, shape (..., 3), float64 (not differentiable)."""
    with torch.no_grad():
        return torch.linalg.eigvalsh(u_matrix(u6.detach().to(torch.float64)))


def first_bad_adp(u_aniso: torch.Tensor, aniso: torch.Tensor, found=None) -> tuple[int, int, str] | None:
    """The first anisotropic atom whose U is not finite or not positive definite, on the host.

    Parameters
    ----------
    u_aniso : torch.Tensor, shape (N, 6)
    aniso : torch.Tensor, shape (N,), bool
    found : tuple, optional
        :func:`bad_adp`'s result for these tensors, when the caller has it already.

    Returns
    -------
    None when every anisotropic atom's U is finite and positive definite, else
    ``(index, count, what)``: the first bad atom, how many are bad, and a phrase naming the problem
    with the atom's eigenvalues. Where ``u_aniso`` is of lower precision than float64 and the U is
    within its rounding of singular, the phrase says that the cast to that dtype can make it so.
    """
    bad, finite, lam = bad_adp(u_aniso, aniso) if found is None else found
    if not bad.any():
        return None
    u = u_aniso.detach().to("cpu", torch.float64)
    idx = int(bad.nonzero()[0, 0])
    if not bool(finite[idx]):
        what = f"has a non-finite anisotropic U: {u[idx].tolist()}"
    else:
        eig = ", ".join(f"{v:.4g}" for v in lam[idx].tolist())
        what = f"has an anisotropic U that is not positive definite (eigenvalues {eig} Å²)"
        if u_aniso.dtype != torch.float64 and abs(float(lam[idx, 0])) <= rounding_margin(u_aniso.dtype) * float(
            lam[idx].abs().max()
        ):
            what += (
                f", singular within {u_aniso.dtype} rounding: a U positive definite in float64 can lose that in the "
                f"cast to {u_aniso.dtype} (the cpu and triton backends compute in float32); backend='reference' "
                "keeps float64"
            )
    return idx, int(bad.sum()), what


def rounding_margin(dtype: torch.dtype) -> float:
    """How far, relative to U's largest eigenvalue, rounding each component to ``dtype`` can move the smallest.

    Parameters
    ----------
    dtype : torch.dtype
        A floating dtype.

    Returns
    -------
    float
        8 machine epsilons of ``dtype``: a U whose smallest eigenvalue is within this fraction of its
        largest can change sign in the cast.
    """
    return 8 * torch.finfo(dtype).eps


def bad_adp(u_aniso: torch.Tensor, aniso: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which anisotropic atoms have a U that is not finite or not positive definite, on the host.

    Parameters
    ----------
    u_aniso : torch.Tensor, shape (N, 6)
    aniso : torch.Tensor, shape (N,), bool

    Returns
    -------
    bad : torch.Tensor, shape (N,), bool, CPU
        ``aniso`` and (a non-finite U or smallest eigenvalue ≤ 0).
    finite : torch.Tensor, shape (N,), bool, CPU
    eigenvalues : torch.Tensor, shape (N, 3), float64, CPU, ascending (of 0 where U is not finite)
    """
    # numpy, not torch: these are small element-wise passes, which torch splits over its thread
    # pool (costly when the cores are busy), and torch's float64 acos is scalar code.
    u = u_aniso.detach().to("cpu", torch.float64).numpy()
    finite = np.isfinite(u).all(axis=1)
    u = np.where(finite[:, None], u, 0.0)
    lam = _eigenvalues_3x3(u)
    # LAPACK (exact to rounding, but ~15 µs a matrix) where the closed form's smallest eigenvalue is
    # within its own error of zero: the sign there decides positive definiteness.
    near = lam[:, 0] <= _CLOSED_FORM_TOLERANCE * np.abs(lam).max(axis=1)
    if near.any():
        lam[near] = torch.linalg.eigvalsh(u_matrix(torch.from_numpy(u[near]))).numpy()
    bad = aniso.detach().cpu().numpy() & (~finite | (lam[:, 0] <= 0))
    return torch.from_numpy(bad), torch.from_numpy(finite), torch.from_numpy(lam)


# Relative error bound of the closed-form eigenvalues, with a wide margin (they agree with LAPACK
# to ~1e-13 of the largest eigenvalue, except where two are nearly equal: then ~1e-8).
_CLOSED_FORM_TOLERANCE = 1e-6


def _eigenvalues_3x3(u: np.ndarray) -> np.ndarray:
    """Eigenvalues of symmetric 3×3 matrices given as (N, 6) float64 on the CPU, ascending, in closed form.

    The trigonometric solution of the characteristic cubic (Smith 1961), vectorised over the rows
    in numpy (``torch.linalg.eigvalsh`` calls LAPACK once per 3×3 matrix, and torch's float64
    ``acos`` is scalar code: both are ~10 µs a row).
    """
    u11, u22, u33, u12, u13, u23 = u.T
    q = (u11 + u22 + u33) / 3
    off = u12**2 + u13**2 + u23**2
    p = np.sqrt((((u11 - q) ** 2 + (u22 - q) ** 2 + (u33 - q) ** 2) + 2 * off) / 6)
    safe = np.where(p > 0, p, 1.0)
    b11, b22, b33 = (u11 - q) / safe, (u22 - q) / safe, (u33 - q) / safe
    b12, b13, b23 = u12 / safe, u13 / safe, u23 / safe
    det = b11 * (b22 * b33 - b23**2) - b12 * (b12 * b33 - b23 * b13) + b13 * (b12 * b23 - b22 * b13)
    phi = np.arccos(np.clip(det / 2, -1.0, 1.0)) / 3
    largest = q + 2 * p * np.cos(phi)
    smallest = q + 2 * p * np.cos(phi + 2 * math.pi / 3)
    middle = 3 * q - largest - smallest
    return np.stack((smallest, middle, largest), axis=-1)


def effective_u(u_aniso: torch.Tensor, aniso: torch.Tensor, b_iso: torch.Tensor) -> torch.Tensor:
    """Each atom's U as six components: its own row where ``aniso``, else B/(8π²) on the diagonal.

    Parameters
    ----------
    u_aniso : torch.Tensor, shape (N, 6), Å²
    aniso : torch.Tensor, shape (N,), bool
    b_iso : torch.Tensor, shape (N,), Å²

    Returns
    -------
    torch.Tensor, shape (N, 6), the dtype of ``u_aniso``: differentiable with respect to ``u_aniso``
    (anisotropic rows) and ``b_iso`` (isotropic rows); no host synchronisation.
    """
    u_iso = b_iso.to(u_aniso.dtype)[:, None] / U_TO_B
    diag = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=u_aniso.dtype, device=u_aniso.device)
    return torch.where(aniso[:, None], u_aniso, u_iso * diag)


def with_blur(atoms, blur: float):
    """``atoms`` with an extra B of ``blur`` Å² on every atom (gemmi's ``blur``), differentiably.

    Isotropic atoms get ``b_iso + blur``; anisotropic atoms ``U + blur/(8π²)·I``. ``blur = 0`` returns
    ``atoms`` itself. Not validated again: a negative blur that leaves some B ≤ 0 or some U not
    positive definite is refused by :func:`kernels.splat_density` before it gets here. A blur beyond
    half the largest value of the atoms' dtype raises ValueError naming the blur (B + blur overflows).
    """
    if blur == 0:
        return atoms
    largest = torch.finfo(atoms.dtype).max
    if not abs(blur) <= largest / 2:  # B + blur would overflow the atoms' dtype: the blur is at fault, not a B
        raise ValueError(
            f"blur={blur:g} Å² is beyond the range of the atoms' {atoms.dtype} (largest {largest:.3g}): B + blur "
            "overflows. A blur is an extra B in Å², of the size of B (tens of Å²)"
        )
    u = atoms.u_aniso
    if u is not None:
        diag = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=u.dtype, device=u.device)
        u = u + (blur / U_TO_B) * diag
    return atoms.replace(b_iso=atoms.b_iso + blur, u_aniso=u, _validate=False)


def term_gaussians(u_eff: torch.Tensor, occ: torch.Tensor, a: torch.Tensor, b: torch.Tensor, orth: torch.Tensor):
    """Per atom and form-factor term: the amplitude and the fractional-space quadratic form.

    ρ_k(Δf) = amp_k · exp(−½ Δfᵀ Q_k Δf) for a fractional offset Δf from the atom, with
    Q_k = orthᵀ M_k⁻¹ orth and amp_k = occ · a_k · (2π)^{-3/2} · det(M_k)^{-1/2}.

    Parameters
    ----------
    u_eff : torch.Tensor, shape (N, 6), Å² (:func:`effective_u`)
    occ : torch.Tensor, shape (N,)
    a, b : torch.Tensor, shape (N, 5)
    orth : torch.Tensor, shape (3, 3), fractional → Cartesian

    Returns
    -------
    amp : torch.Tensor, shape (N, 5)
    q : torch.Tensor, shape (N, 5, 3, 3)
        Both in the dtype of ``u_eff`` and differentiable with respect to every input.
    """
    eye = torch.eye(3, dtype=u_eff.dtype, device=u_eff.device)
    m = u_matrix(u_eff)[:, None] + (b.to(u_eff.dtype) / U_TO_B)[:, :, None, None] * eye  # (N, 5, 3, 3)
    m_inv = torch.linalg.inv(m)
    det = torch.linalg.det(m)
    amp = occ.to(u_eff.dtype)[:, None] * a.to(u_eff.dtype) * (2 * math.pi) ** -1.5 * det.rsqrt()
    orth = orth.to(device=u_eff.device, dtype=u_eff.dtype)
    q = orth.T @ m_inv @ orth
    return amp, q
