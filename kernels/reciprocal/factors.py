"""Structure factors of a map: the public function, its result type and the blur that keeps sampling error small."""

from __future__ import annotations

import dataclasses
import math

import torch

from kernels._util import finite_number, positive_number
from kernels.crystal import Cell, GridError, GridSpec
from kernels.reciprocal.miller import inverse_d_squared, miller_set

__all__ = ["SF_BACKENDS", "StructureFactors", "fourier_synthesis", "sampling_blur", "structure_factors"]

SF_BACKENDS = ("auto", "fft", "reference")

# gemmi's refmac-compatible blur (DensityCalculator::set_refmac_compatible_blur): the sharpest atom
# is widened to B = 8π²·h²/1.1 on a grid of spacing h.
_SAMPLING_B_PER_H2 = 8 * math.pi**2 / 1.1


def sampling_blur(atoms, grid: GridSpec) -> float:
    """The blur B (Å²) to splat with, and divide out of the factors, so that a map samples its atoms finely enough.

    A map on a grid of spacing h holds the factors out to its Nyquist limit 1/(2h); the rest of each
    atom's transform folds back onto them (aliasing), and the sharpest atom folds most. Blurring
    every atom until the sharpest has B = 8π²h²/1.1 (gemmi's ``set_refmac_compatible_blur``) makes
    what folds back small, and :func:`structure_factors` divides the blur out again. The sharpest atom's
    B is the smallest B of the isotropic atoms and 8π² times the smallest eigenvalue of U of the
    anisotropic ones.

    Parameters
    ----------
    atoms : kernels.AtomSet
    grid : GridSpec
        The grid the map will be splatted on (h is its largest spacing).

    Returns
    -------
    float
        max(0, 8π²h²/1.1 − B_min), Å²; 0 for an empty set. Reads the atoms' B (and U) to the host.
    """
    if len(atoms) == 0:
        return 0.0
    with torch.no_grad():
        b = atoms.b_iso.detach().to(torch.float64)
        if atoms.u_aniso is not None:
            from kernels.adp import U_TO_B

            u = atoms.u_aniso.detach().to(torch.float64)
            full = torch.stack(
                (u[:, 0], u[:, 3], u[:, 4], u[:, 3], u[:, 1], u[:, 5], u[:, 4], u[:, 5], u[:, 2]), dim=1
            ).reshape(-1, 3, 3)
            smallest = torch.linalg.eigvalsh(full)[:, 0] * U_TO_B
            b = torch.where(atoms.aniso.to(b.device), smallest, b)
        b_min = float(b.min())
    h = max(grid.spacing)
    return max(0.0, _SAMPLING_B_PER_H2 * h * h - b_min)


@dataclasses.dataclass(frozen=True, eq=False)
class StructureFactors:
    """Complex structure factors of a set of reflections, and what they belong to.

    F(h) = Σ_j f_j(s)·exp(2πi h·x_j) (the crystallographic sign, gemmi's and CCP4's):
    electrons for an X-ray map in e/Å³, the map's unit times Å³ otherwise.

    Attributes
    ----------
    hkl : torch.Tensor, shape (M, 3), int64
        Miller indices, on the same device as ``f``.
    f : torch.Tensor, shape (M,), complex64 or complex128
        The factors (differentiable when they came from a map that is).
    cell : Cell
    spacegroup : str
        The space group whose unique set ``hkl`` is (``"P 1"``: a hemisphere).
    d_min : float
        Resolution limit in Å the set was made for.
    """

    hkl: torch.Tensor
    f: torch.Tensor
    cell: Cell
    spacegroup: str = "P 1"
    d_min: float = math.nan
    _inv_d2: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    # the index set's value key when ``hkl`` is a whole set from structure_factors (shells keep their binning by it)
    _set_key: tuple | None = dataclasses.field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.hkl.shape[0])

    @property
    def inv_d2(self) -> torch.Tensor:
        """1/d² in Å⁻², shape (M,), float64 (kept from the index set when the factors came from a map)."""
        if self._inv_d2 is None:
            object.__setattr__(self, "_inv_d2", inverse_d_squared(self.hkl, self.cell))
        return self._inv_d2

    @property
    def d(self) -> torch.Tensor:
        """Resolution d in Å of each reflection, shape (M,), float64."""
        return self.inv_d2.rsqrt()

    @property
    def amplitudes(self) -> torch.Tensor:
        """|F|, shape (M,), real."""
        return self.f.abs()

    @property
    def phases(self) -> torch.Tensor:
        """Phase of F in degrees in (−180, 180], shape (M,), real."""
        return torch.rad2deg(torch.angle(self.f))

    def select(self, which: torch.Tensor) -> StructureFactors:
        """The reflections ``which`` picks (a (M,) bool mask or int64 indices), as a new set.

        For example ``f.select(f.d >= 3.0)``: the factors to 3 Å.
        """
        inv_d2 = None if self._inv_d2 is None else self._inv_d2[which]
        return dataclasses.replace(self, hkl=self.hkl[which], f=self.f[which], _inv_d2=inv_d2, _set_key=None)

    def replace(self, **changes) -> StructureFactors:
        """A copy with the given fields changed (``dataclasses.replace``; 1/d² is kept unless hkl or cell change)."""
        if "hkl" in changes or "cell" in changes:
            changes.setdefault("_inv_d2", None)
            changes.setdefault("_set_key", None)
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return (
            f"StructureFactors({len(self)} reflections to {self.d_min:g} Å, {self.spacegroup!r}, "
            f"{self.f.dtype}, {self.f.device})"
        )


def structure_factors(
    rho: torch.Tensor,
    grid: GridSpec,
    d_min: float,
    *,
    spacegroup: str | None = None,
    blur: float = 0.0,
    backend: str = "auto",
) -> StructureFactors:
    """Structure factors F(hkl) of a map, by FFT, up to ``d_min``.

    F(h) = V/N · Σ_x ρ(x)·exp(2πi h·x) over the N voxels of the cell (the voxel-volume scale makes
    a map in e/Å³ give F in electrons), divided by exp(−B·s²/4), s = 1/d, to undo a ``blur`` B
    the map was splatted with. The reflections are the unique set of ``spacegroup`` with d ≥ d_min
    (gemmi's reciprocal asymmetric unit, systematic absences and F(000) left out), in gemmi's order:
    for the map of a model's own atoms (:func:`kernels.splat_density`) that is P 1, a hemisphere;
    for a map with its symmetry mates added (:func:`kernels.symmetrize`), the space group's.
    Differentiable with respect to ``rho``. The index set is made once per (grid, space group,
    d_min) and kept on each device, so a repeated call copies nothing to the device and makes no
    host synchronisation.

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape, float32 or float64
        A whole-cell map on any device.
    grid : GridSpec
        The map's whole-cell grid; it must hold ``d_min`` (every index below half the grid size
        along its axis, :func:`finest_d_min`: about twice the spacing).
    d_min : float
        Resolution limit in Å.
    spacegroup : str, optional
        Hermann–Mauguin name of the unique set to return; default ``"P 1"``. Give the model's
        space group only for a map that is symmetrised: on the map of the atoms alone those
        reflections are not the crystal's.
    blur : float
        The B in Å² the map was splatted with (``splat_density(..., blur=B)``); 0 leaves F as the
        map gives it.
    backend : {"auto", "fft", "reference"}
        ``fft`` (what ``auto`` runs): a pruned real-to-complex transform in the map's dtype
        (complex64 from float32); ``reference``: a full complex transform in float64 (complex128).

    Returns
    -------
    StructureFactors
        ``hkl`` (M, 3) int64 and ``f`` (M,) complex, on ``rho``'s device.

    Raises
    ------
    kernels.GridError
        A box grid, a map of another shape, an unknown space group, or ``d_min`` finer than the
        grid holds (the message gives the finest it holds).
    ValueError
        ``d_min`` not a positive finite number, ``blur`` not finite, an unknown backend, or a map
        that is not real floating point.

    Notes
    -----
    The map's own errors carry over: a Gaussian cut at a radius loses its tails, which are its
    highest-resolution part, and the sampling folds the factors beyond the grid's Nyquist limit
    back onto those below it. Both grow towards d_min; ``shells`` measures them against exact
    factors (docs/kernels.md, "Structure factors").
    """
    d_min = positive_number(d_min, "d_min", "Å")
    blur = finite_number(blur, "blur", "Å²")
    if backend not in SF_BACKENDS:
        raise ValueError(f"backend must be one of {SF_BACKENDS}, got {backend!r}")
    if not isinstance(rho, torch.Tensor) or not rho.is_floating_point():
        raise ValueError(f"rho must be a real floating-point torch tensor, got {getattr(rho, 'dtype', type(rho))}")
    if tuple(rho.shape) != grid.shape:
        raise GridError(f"map shape {tuple(rho.shape)} does not match the grid {grid.shape}")
    sg = "P 1" if spacegroup is None else str(spacegroup)
    millers = miller_set(grid, sg, d_min)
    if backend == "reference":
        from kernels.reciprocal.reference import structure_factors_reference

        f = structure_factors_reference(rho, grid, millers, blur)
    else:
        from kernels.reciprocal.fft import structure_factors_fft

        if rho.dtype in (torch.float16, torch.bfloat16):
            rho = rho.float()  # torch's FFT of half precision is restricted to powers of two on CUDA
        f = structure_factors_fft(rho, grid, millers, blur)
    t = millers.on(rho.device)
    return StructureFactors(t["hkl"], f, grid.cell, sg, d_min, t["inv_d2"], millers.key)


def fourier_synthesis(factors: StructureFactors, grid: GridSpec, *, f000: float | torch.Tensor = 0.0) -> torch.Tensor:
    """The map of a P 1 set of structure factors: ρ(x) = (1/V)·Σ_h F(h)·exp(−2πi h·x).

    The inverse of :func:`structure_factors` on the reflections given: the map holds exactly those
    coefficients (and their Friedel mates), every other one zero. So the synthesis of
    ``structure_factors(rho, grid, d)`` with ``f000 = V/N·Σρ`` is ``rho`` with everything beyond d
    removed: the map a data set to d would show (a sharp truncation, with its ripples).

    Parameters
    ----------
    factors : StructureFactors
        A P 1 set (a hemisphere: no reflection with its Friedel mate; ``structure_factors`` without a
        space group gives one), on any device; complex64 or complex128.
    grid : GridSpec
        Whole-cell grid holding every index (each |h| < n/2 along its axis).
    f000 : float or 0-d tensor
        F(000) in electrons (the map's mean times V); default 0, a map of mean zero.

    Returns
    -------
    torch.Tensor, shape grid.shape, float32 from complex64 factors, float64 from complex128
        On the factors' device; differentiable with respect to ``factors.f``.

    Raises
    ------
    kernels.GridError
        A box grid, or an index outside the grid's Nyquist box.
    ValueError
        A set that is not P 1.
    """
    if factors.spacegroup.replace(" ", "") != "P1":
        raise ValueError(
            f"fourier_synthesis takes a P 1 set; this one is {factors.spacegroup}'s unique set: compute the "
            "factors of the map without spacegroup= (its P 1 hemisphere)"
        )
    if not grid.is_whole_cell:
        raise GridError("a Fourier synthesis needs a whole-cell grid (origin 0, shape = sampling)")
    nx, ny, nz = grid.shape
    hkl = factors.hkl
    limit = torch.tensor([(n + 1) // 2 for n in grid.shape], device=hkl.device)  # |h| < n/2
    if len(hkl) and bool((hkl.abs() >= limit).any()):
        raise GridError(f"an index of the set lies outside this {nx}×{ny}×{nz} grid's Nyquist box: use a finer grid")
    # c = conj(F)·N/V at h (and F·N/V at −h, its mate); irfftn then sums c·exp(+2πi h·x)/N
    scale = grid.n_voxels / grid.cell.volume
    c = factors.f.conj() * scale
    both_hkl = torch.cat((hkl, -hkl))
    both_c = torch.cat((c, c.conj()))
    keep = both_hkl[:, 2] >= 0  # the half an inverse real transform reads; l = 0 needs both mates
    both_hkl, both_c = both_hkl[keep], both_c[keep]
    flat = (torch.remainder(both_hkl[:, 0], nx) * ny + torch.remainder(both_hkl[:, 1], ny)) * (nz // 2 + 1)
    flat = flat + both_hkl[:, 2]
    half = torch.zeros(nx * ny * (nz // 2 + 1), dtype=c.dtype, device=c.device)
    half = half.index_put((flat,), both_c.resolve_conj())
    if isinstance(f000, torch.Tensor) or f000 != 0.0:
        half = half.index_put(
            (torch.zeros(1, dtype=torch.int64, device=c.device),),
            torch.as_tensor(f000 * scale, dtype=c.dtype, device=c.device).reshape(1),
            accumulate=True,
        )
    return torch.fft.irfftn(half.reshape(nx, ny, nz // 2 + 1), s=grid.shape)
