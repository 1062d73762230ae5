"""The Resolution tab's computations: a map's errors by shell in reciprocal space, FSC, truncated syntheses.

Pure functions of the pipeline's result (no widgets): the current map's structure factors
(:func:`kernels.structure_factors`, its blur divided out) against gemmi's exact factors of the same
atoms (:func:`kernels.testing.gemmi_structure_factors`, a direct sum over atoms) or against the
other backend of a comparison; and the map truncated at a resolution (:func:`kernels.fourier_synthesis`)
for the resolution slider. What does not depend on the settings that change (exact factors: the atoms;
a map's factors: the map) is kept between calls by :class:`ResolutionCache`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

import kernels
from kernels.reciprocal import finest_d_min

__all__ = [
    "EXACT_LIMIT",
    "ResolutionCache",
    "ResolutionReport",
    "resolution_range",
    "resolution_report",
    "truncated_map",
    "truncated_section",
]

#: Largest atoms × reflections for which exact factors are summed live (about 1 s on one core:
#: gemmi sums 10⁷ atom-reflection pairs a second). Beyond it the tab says so and compares backends only.
EXACT_LIMIT = 1.5e7

#: Highest resolution the tab reports (Å): the shells of the issue's targets.
REPORT_D_MIN = 2.0


@dataclasses.dataclass(frozen=True)
class ResolutionReport:
    """What the Resolution tab draws for one map.

    Attributes
    ----------
    table : kernels.ShellTable or None
        The map's factors against ``reference_name``'s, by shell (None: no reference could be made).
    reference_name : str
        ``"exact (gemmi, direct sum)"`` or the other backend's name.
    fsc : kernels.ShellTable or None
        FSC of a comparison's two maps (None without a comparison).
    d_min : float
        Resolution limit of ``table`` in Å.
    n_reflections : int
    note : str
        Why something is missing, or empty.
    """

    table: object
    reference_name: str
    fsc: object
    d_min: float
    n_reflections: int
    note: str = ""


class ResolutionCache:
    """Exact factors by atoms key, and the current map's factors and half-space transform by map key
    (one of each is kept)."""

    def __init__(self):
        self._exact: tuple | None = None
        self._map: tuple | None = None

    def exact(self, key, model, atoms, hkl: torch.Tensor, radiation: str) -> torch.Tensor:
        """gemmi's exact factors of ``atoms`` (as splatted: B mode, distortion) at ``hkl``, complex128."""
        want = (key, tuple(hkl.shape), int(hkl.abs().sum()))
        if self._exact is None or self._exact[0] != want:
            self._exact = (want, _exact_factors(model, atoms, hkl))
        return self._exact[1]

    def map_factors(self, key, rho: torch.Tensor, grid, blur: float) -> kernels.StructureFactors:
        """The P 1 factors of ``rho`` to the finest d its grid holds, its blur divided out.

        Also keeps the map's real-to-complex transform (numpy, float64, blur divided out, everything
        beyond that d zeroed) and each coefficient's 1/d², for :func:`truncated_section`.
        """
        want = (key, grid, blur)
        if self._map is None or self._map[0] != want:
            with torch.no_grad():
                f = kernels.structure_factors(rho.detach(), grid, finest_d_min(grid), blur=blur)
            values = rho.detach().to("cpu", torch.float64).numpy()
            half = np.fft.rfftn(values)
            inv_d2 = _half_inv_d2(grid)
            limit = 1.0 / finest_d_min(grid) ** 2
            half *= np.where(inv_d2 <= limit, np.exp(inv_d2 * (blur / 4)), 0.0)
            self._map = (want, f, half, inv_d2)
        return self._map[1]

    def transform(self) -> tuple[np.ndarray, np.ndarray]:
        """The kept map's half-space transform and the 1/d² of each coefficient (ValueError before any map)."""
        if self._map is None:
            raise ValueError("no map's factors are kept yet: make the report first")
        return self._map[2], self._map[3]


def _half_inv_d2(grid) -> np.ndarray:
    """1/d² (Å⁻²) of every coefficient of a real-to-complex transform of a map on ``grid``: (nx, ny, nz//2+1)."""
    nx, ny, nz = grid.shape
    h = np.fft.fftfreq(nx, 1.0 / nx)
    k = np.fft.fftfreq(ny, 1.0 / ny)
    l = np.arange(nz // 2 + 1, dtype=np.float64)  # noqa: E741
    frac = grid.cell.frac.numpy()
    g = frac @ frac.T
    return (
        g[0, 0] * h[:, None, None] ** 2
        + g[1, 1] * k[None, :, None] ** 2
        + g[2, 2] * l[None, None, :] ** 2
        + 2 * g[0, 1] * h[:, None, None] * k[None, :, None]
        + 2 * g[0, 2] * h[:, None, None] * l[None, None, :]
        + 2 * g[1, 2] * k[None, :, None] * l[None, None, :]
    )


def _exact_factors(model, atoms, hkl: torch.Tensor) -> torch.Tensor:
    """Exact factors of the splatted atoms: the model's structure with these positions, B and occupancies
    (and its ANISOU where the atoms use U)."""
    import kernels.testing

    moved = dataclasses.replace(model, atoms=atoms.to("cpu", torch.float64))
    st = kernels.testing.gemmi_structure_of_model(moved)
    xyz = atoms.xyz.detach().to("cpu", torch.float64).numpy()
    b = atoms.b_iso.detach().to("cpu", torch.float64).numpy()
    occ = atoms.occ.detach().to("cpu", torch.float64).numpy()
    i = 0
    import gemmi

    for chain in st[0]:
        for residue in chain:
            for atom in residue:
                atom.pos = gemmi.Position(*xyz[i])
                atom.b_iso = float(b[i])
                atom.occ = float(occ[i])
                i += 1
    st.spacegroup_hm = "P 1"
    st.setup_cell_images()
    name = {"xray": "StructureFactorCalculatorX", "electron": "StructureFactorCalculatorE"}.get(
        atoms.radiation, "StructureFactorCalculatorN"
    )
    calc = getattr(gemmi, name)(st.cell)
    first = st[0]
    values = [calc.calculate_sf_from_model(first, h) for h in hkl.tolist()]
    return torch.tensor(np.array(values, dtype=np.complex128))


def resolution_range(grid) -> tuple[float, float]:
    """The resolution slider's range in Å: from the finest d the grid holds (about twice its spacing) to 6 Å."""
    finest = finest_d_min(grid)
    return finest, max(6.0, finest)


def resolution_report(result, cache: ResolutionCache, comparison=None, *, n_shells: int = 10) -> ResolutionReport:
    """The current map's |F| and phase errors by shell, and a comparison's FSC.

    Parameters
    ----------
    result : workbench.compute.Result
        The pipeline's result for the current settings (its map, grid, atoms, blur).
    cache : ResolutionCache
    comparison : workbench.compute.DifferenceResult, optional
        A comparison of two backends on the current inputs: its two maps give the FSC, and, when exact
        factors are too costly, the reference set.
    n_shells : int

    Returns
    -------
    ResolutionReport
    """
    grid = result.grid
    blur = float(result.settings.blur)
    d_min = max(REPORT_D_MIN, finest_d_min(grid))
    full = cache.map_factors(result.map_key, result.rho, grid, blur)
    f = full.select(full.d >= d_min)
    note = ""
    table, reference_name = None, ""
    cost = len(result.atoms) * len(f)
    if cost <= EXACT_LIMIT:
        exact = cache.exact(result.atoms_key, result.model, result.atoms, f.hkl, result.atoms.radiation)
        table = kernels.shells(f, f.replace(f=exact), n_shells=n_shells)
        reference_name = "exact (gemmi, direct sum)"
    else:
        note = (
            f"exact factors not summed live ({len(result.atoms):,} atoms × {len(f):,} reflections); "
            "run a comparison to see one backend against another"
        )
    need = kernels.sampling_blur(result.atoms, grid)
    if blur < need - 0.05:
        # aliasing of the sharpest atoms, not the kernel: say what removes it (U atoms by their smallest eigenvalue)
        note = (note + "; " if note else "") + (
            f"blur {blur:g} Å² is below this grid's sampling blur {need:.1f} Å² (kernels.sampling_blur: the sharpest "
            "atom widened to B = 8π²h²/1.1, U by its smallest eigenvalue): the map's factors alias, most towards "
            f"d_min; set blur ≥ {need:.1f} Å² (divided out again) to see the kernel's own error"
        )
    fsc = None
    if comparison is not None:
        g = comparison.grid if hasattr(comparison, "grid") else grid
        fa = kernels.structure_factors(comparison.map_a, g, d_min, blur=blur)
        fb = kernels.structure_factors(comparison.map_b, g, d_min, blur=blur)
        fsc = kernels.fsc(comparison.map_a, comparison.map_b, g)
        if table is None:
            table = kernels.shells(fa, fb, n_shells=n_shells)
            reference_name = f"backend {comparison.b}"
    return ResolutionReport(table, reference_name, fsc, d_min, len(f), note)


def truncated_section(cache: ResolutionCache, grid, d: float, axis: int, index: int) -> np.ndarray:
    """A section of the kept map synthesised from its coefficients with d ≥ ``d`` (what data to d would show).

    Only the section is synthesised: the coefficients are summed along ``axis`` with the phases of plane
    ``index``, and the 2-D inverse transform of that sum is the section. Equal to
    ``kernels.fourier_synthesis`` of the map's factors with d ≥ ``d`` (and its F(000)), cut at ``index``.

    Parameters
    ----------
    cache : ResolutionCache
        Holding the map (:meth:`ResolutionCache.map_factors` called for it).
    grid : kernels.GridSpec
    d : float
        Resolution in Å.
    axis, index : int
        Which section: the voxel plane ``index`` across ``axis``.

    Returns
    -------
    numpy.ndarray, float64, 2-D (the two other axes in order)
        The section in the map's unit, the map's blur divided out.
    """
    if not math.isfinite(d) or d <= 0:
        raise ValueError(f"resolution must be a positive number of Å, got {d!r}")
    half, inv_d2 = cache.transform()
    c = np.where(inv_d2 <= 1.0 / (d * d) * (1 + 1e-12), half, 0.0)
    n = grid.shape
    if axis == 2:
        # the real axis: Σ_l w_l·C(h, k, l)·e^{2πi l z/nz}, w = 1 at l = 0 (and nz/2), 2 elsewhere; Re of the 2-D inverse
        l = np.arange(c.shape[2])  # noqa: E741
        w = np.where((l == 0) | (2 * l == n[2]), 1.0, 2.0) * np.exp(2j * np.pi * l * index / n[2])
        return np.fft.ifft2(c @ w, s=n[:2]).real / n[2]
    phase = np.exp(2j * np.pi * np.fft.fftfreq(n[axis], 1.0 / n[axis]) * index / n[axis]) / n[axis]
    summed = np.tensordot(phase, c, axes=([0], [axis]))  # (other complex axis, l)
    return np.fft.irfft2(summed, s=(n[1 - axis], n[2]))


def truncated_map(cache: ResolutionCache, grid, d: float) -> torch.Tensor:
    """The whole kept map synthesised from its coefficients with d ≥ ``d`` (for the 3D view).

    Returns
    -------
    torch.Tensor, shape grid.shape, float32, CPU
        In the map's unit, the map's blur divided out.
    """
    if not math.isfinite(d) or d <= 0:
        raise ValueError(f"resolution must be a positive number of Å, got {d!r}")
    half, inv_d2 = cache.transform()
    c = np.where(inv_d2 <= 1.0 / (d * d) * (1 + 1e-12), half, 0.0)
    return torch.from_numpy(np.fft.irfftn(c, s=grid.shape, axes=(0, 1, 2)).astype(np.float32))


_TRUNCATION_CLASS = "wb-truncated"


def truncation_note(d: float) -> str:
    """The line a view's caption starts with while it shows the map truncated at ``d`` Å (HTML)."""
    return (
        f"<span class='{_TRUNCATION_CLASS}'><b>map truncated at d = {d:.1f} Å</b> (Fourier synthesis of its factors "
        f"with d ≥ {d:.1f} Å; resolution slider off: the map itself)</span><br>"
    )


def without_truncation_note(caption: str) -> str:
    """``caption`` without the line :func:`truncation_note` put at its start."""
    start = f"<span class='{_TRUNCATION_CLASS}'>"
    if caption.startswith(start):
        return caption[caption.index("</span><br>") + len("</span><br>") :]
    return caption


def truncated_result(cache: ResolutionCache, result, d: float):
    """``result`` with its map replaced by the synthesis to ``d`` Å: the map, its mean and σ, and the section.

    Parameters
    ----------
    cache : ResolutionCache
        Holding ``result``'s map (:meth:`ResolutionCache.map_factors` called for it).
    result : workbench.compute.Result
    d : float
        Resolution in Å.

    Returns
    -------
    workbench.compute.Result
        ``rho`` (grid.shape, float32, CPU) the truncated map in the map's unit (its blur divided out), ``mean``
        and ``sigma`` of it, ``section`` cut from it at the result's section (coloured on its own range); the
        atoms, their marks and everything else as in ``result``.
    """
    from workbench.compute.sections import section

    rho = truncated_map(cache, result.grid, d)
    sec = result.section
    cut = section(rho, result.grid, sec.axis, sec.index, map_range=(float(rho.min()), float(rho.max())))
    return dataclasses.replace(result, rho=rho, mean=float(rho.mean()), sigma=float(rho.std()), section=cut)
