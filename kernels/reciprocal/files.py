"""Reflection files (MTZ, structure-factor mmCIF) in and out, and the R-factor against observed amplitudes.

Reading follows the model and map readers' rules: every problem is an error that names the file and
what is wrong (:class:`ReflectionFileError`), nothing is guessed silently, and what reading dropped
(reflections without a measured amplitude, F(000)) is said in ``notes``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import torch

from kernels._util import file_problem
from kernels.crystal import Cell

__all__ = [
    "ReflectionData",
    "ReflectionFileError",
    "RFactor",
    "read_structure_factors",
    "write_structure_factors",
    "r_factor",
    "match_reflections",
]

# Observed-amplitude column names tried in order when none is named (CCP4's, phenix's, the PDB's).
_OBSERVED_MTZ = ("FP", "F", "FOBS", "F-obs", "F_meas", "FO", "F-obs-filtered")
_OBSERVED_CIF = ("F_meas_au", "F_meas", "F_calc_au", "F_calc")
_SIGMA_CIF = {"F_meas_au": "F_meas_sigma_au", "F_meas": "F_meas_sigma"}
_PHASE_CIF = {"F_calc_au": "phase_calc", "F_calc": "phase_calc"}


class ReflectionFileError(ValueError):
    """A reflection file cannot be read as structure factors: the message names the file and the reason."""


@dataclasses.dataclass(frozen=True)
class ReflectionData:
    """Structure factors read from a file.

    Attributes
    ----------
    factors : kernels.StructureFactors
        ``hkl`` (M, 3) int64 as in the file and ``f`` (M,): float64 amplitudes, or complex128 when a
        phase column was read; ``cell``, ``spacegroup`` and ``d_min`` from the file.
    sigma : torch.Tensor or None
        (M,) float64 standard uncertainties of the amplitudes, when the file has them.
    columns : tuple of str
        The columns (MTZ labels or mmCIF ``_refln`` tags) read: amplitude, then phase and sigma if read.
    path : pathlib.Path
    notes : tuple of str
        What reading left out and why.
    """

    factors: object
    sigma: torch.Tensor | None
    columns: tuple[str, ...]
    path: Path
    notes: tuple[str, ...] = ()


def _fail(path, message: str) -> ReflectionFileError:
    return ReflectionFileError(f"{path}: {message}")


def read_structure_factors(
    path: str | os.PathLike,
    *,
    amplitudes: str | None = None,
    phases: str | None = None,
    sigmas: str | None = None,
) -> ReflectionData:
    """Read structure factors from an MTZ file or a structure-factor mmCIF (``-sf.cif``, gzipped or not).

    Parameters
    ----------
    path : str or os.PathLike
    amplitudes : str, optional
        The amplitude column (MTZ label, or ``_refln`` tag without the prefix). Default: the first
        of FP, F, FOBS, F-obs, F_meas, FO (MTZ) or F_meas_au, F_meas, F_calc_au, F_calc (mmCIF);
        in an MTZ with none of these, its one amplitude column (type F) when it has exactly one.
    phases : str, optional
        A phase column in degrees (MTZ type P, e.g. PHIC; mmCIF ``phase_calc``): ``f`` is then complex.
        Default: none for MTZ; mmCIF reads ``phase_calc`` with ``F_calc``.
    sigmas : str, optional
        The amplitudes' sigma column. Default: SIG + the amplitude label when the MTZ has it (type Q);
        ``F_meas_sigma_au`` with ``F_meas_au`` in mmCIF.

    Returns
    -------
    ReflectionData

    Raises
    ------
    ReflectionFileError
        (a ValueError) The file is missing, unreadable, empty, truncated or not MTZ/mmCIF; has no cell
        or an impossible one, no space group, no reflections, no such column (the message lists those
        there are), an amplitude column that is ambiguous, or negative or infinite amplitudes.
    """
    from kernels.reciprocal.factors import StructureFactors

    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise _fail(path, problem)
    if path.stat().st_size == 0:
        raise _fail(path, "is empty")
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head == b"MTZ ":
        hkl, values, columns, cell_params, sg_name, notes = _read_mtz(path, amplitudes, phases, sigmas)
    elif head[:2] == b"\x1f\x8b" or path.suffix.lower() in (".cif", ".mmcif", ".ent") or _looks_like_cif(path):
        hkl, values, columns, cell_params, sg_name, notes = _read_cif(path, amplitudes, phases, sigmas)
    else:
        raise _fail(path, "neither an MTZ file (no 'MTZ ' stamp) nor an mmCIF file: give MTZ or structure-factor mmCIF")
    try:
        cell = Cell.from_parameters(*cell_params)
    except ValueError as exc:
        raise _fail(path, f"its cell is not usable: {exc}") from None
    amp = values[0]
    if not np.all(np.isfinite(amp) | np.isnan(amp)):
        raise _fail(path, f"column {columns[0]} holds infinite amplitudes")
    missing = np.isnan(amp)
    if missing.any():
        notes.append(f"{int(missing.sum())} reflections without a value in {columns[0]} left out")
    f000 = np.all(hkl == 0, axis=1)
    if f000.any():
        notes.append("F(000) left out")
    keep = ~missing & ~f000
    if len(columns) > 1 and columns[1] is not None:
        bad_phase = keep & ~np.isfinite(values[1])
        if bad_phase.any():
            notes.append(f"{int(bad_phase.sum())} reflections without a phase in {columns[1]} left out")
            keep &= ~bad_phase
    if not keep.any():
        raise _fail(path, f"no reflection has a value in {columns[0]}")
    hkl, values = hkl[keep], [None if v is None else v[keep] for v in values]
    amp = values[0]
    if (amp < 0).any():
        i = int(np.argmax(amp < 0))
        raise _fail(path, f"{columns[0]} is negative at hkl {tuple(hkl[i])} ({amp[i]:g}): not an amplitude column")
    f = torch.from_numpy(amp.astype(np.float64))
    if values[1] is not None:
        f = torch.polar(f, torch.deg2rad(torch.from_numpy(values[1].astype(np.float64))))
    sigma = None if values[2] is None else torch.from_numpy(values[2].astype(np.float64))
    hkl_t = torch.from_numpy(hkl.astype(np.int64))
    inv_d2 = _inv_d2(hkl_t, cell)
    d_min = float(inv_d2.max().rsqrt())
    factors = StructureFactors(hkl_t, f, cell, sg_name, d_min, inv_d2)
    return ReflectionData(factors, sigma, tuple(c for c in columns if c), path, tuple(notes))


def _inv_d2(hkl: torch.Tensor, cell: Cell) -> torch.Tensor:
    from kernels.reciprocal.miller import inverse_d_squared

    return inverse_d_squared(hkl, cell)


def _looks_like_cif(path: Path) -> bool:
    with open(path, "rb") as fh:
        text = fh.read(4096).decode("utf-8", "replace")
    return "data_" in text and "_refln" in text


def _read_mtz(path: Path, amplitudes, phases, sigmas):
    import gemmi

    try:
        mtz = gemmi.read_mtz_file(str(path))
    except (RuntimeError, ValueError, OSError) as exc:
        raise _fail(path, f"not a readable MTZ file ({exc})") from None
    labels = [c.label for c in mtz.columns]
    types = {c.label: c.type for c in mtz.columns}
    if mtz.nreflections == 0:
        raise _fail(path, "holds no reflections")
    if mtz.spacegroup is None:
        raise _fail(path, "has no space group (SYMINF/SYMM records); add one (e.g. with gemmi or CCP4's reindex)")
    cell = mtz.cell
    params = tuple(float(p) for p in cell.parameters)
    if params == (1.0, 1.0, 1.0, 90.0, 90.0, 90.0) or not all(math.isfinite(p) for p in params):
        raise _fail(path, "has no unit cell (no CELL or DCELL record)")
    f_cols = [lab for lab in labels if types[lab] == "F"]
    if amplitudes is None:
        amplitudes = next((c for c in _OBSERVED_MTZ if c in f_cols), None)
        if amplitudes is None:
            if len(f_cols) == 1:
                amplitudes = f_cols[0]
            elif not f_cols:
                kinds = ", ".join(f"{lab} ({types[lab]})" for lab in labels[3:])
                raise _fail(path, f"has no amplitude column (type F); its columns: {kinds}")
            else:
                raise _fail(path, f"has several amplitude columns ({', '.join(f_cols)}): name one with amplitudes=")
    _need(path, amplitudes, labels, types, "F", "amplitude")
    if phases is not None:
        _need(path, phases, labels, types, "P", "phase")
    if sigmas is None and f"SIG{amplitudes}" in labels and types[f"SIG{amplitudes}"] == "Q":
        sigmas = f"SIG{amplitudes}"
    elif sigmas is not None:
        _need(path, sigmas, labels, types, "Q", "sigma")
    data = np.asarray(mtz.array)
    hkl = np.rint(data[:, :3]).astype(np.int64)
    col = {lab: i for i, lab in enumerate(labels)}

    def column(name):
        return None if name is None else data[:, col[name]].astype(np.float64)

    values = [column(amplitudes), column(phases), column(sigmas)]
    return hkl, values, [amplitudes, phases, sigmas], params, mtz.spacegroup.hm, []


def _need(path, name, labels, types, kind: str, what: str) -> None:
    if name not in labels:
        raise _fail(path, f"has no column {name!r}; its columns: {', '.join(labels)}")
    if types[name] != kind:
        raise _fail(path, f"column {name} is of MTZ type {types[name]}, not {kind} ({what})")


def _read_cif(path: Path, amplitudes, phases, sigmas):
    import gemmi

    try:
        doc = gemmi.cif.read(str(path))
    except (RuntimeError, ValueError, OSError) as exc:
        raise _fail(path, f"not a readable mmCIF file ({exc})") from None
    blocks = [b for b in doc if b.find_mmcif_category("_refln.")]
    if not blocks:
        raise _fail(path, "has no _refln category: not a structure-factor mmCIF (models are read with read_model)")
    block = blocks[0]
    notes = [] if len(blocks) == 1 else [f"the first of {len(blocks)} reflection blocks read ({block.name})"]
    refln = block.find_mmcif_category("_refln.")
    tags = [t[len("_refln.") :] for t in refln.tags]
    for needed in ("index_h", "index_k", "index_l"):
        if needed not in tags:
            raise _fail(path, f"_refln has no {needed}")
    if amplitudes is None:
        amplitudes = next((c for c in _OBSERVED_CIF if c in tags), None)
        if amplitudes is None:
            hint = (
                " (intensities only: convert them to amplitudes first, e.g. with CCP4's ctruncate)"
                if any(t.startswith("intensity") for t in tags)
                else ""
            )
            raise _fail(path, f"has no amplitude column; its _refln tags: {', '.join(tags)}{hint}")
    if phases is None:
        phases = _PHASE_CIF.get(amplitudes) if _PHASE_CIF.get(amplitudes) in tags else None
    if sigmas is None:
        sigmas = _SIGMA_CIF.get(amplitudes) if _SIGMA_CIF.get(amplitudes) in tags else None
    for name in (amplitudes, phases, sigmas):
        if name is not None and name not in tags:
            raise _fail(path, f"_refln has no {name}; its tags: {', '.join(tags)}")
    params = []
    for tag in ("length_a", "length_b", "length_c", "angle_alpha", "angle_beta", "angle_gamma"):
        value = block.find_value(f"_cell.{tag}")
        if value is None:
            raise _fail(path, f"has no unit cell (_cell.{tag} missing)")
        try:
            params.append(gemmi.cif.as_number(value))
        except (RuntimeError, ValueError):
            raise _fail(path, f"_cell.{tag} is not a number ({value})") from None
    sg_name = None
    for tag in ("_symmetry.space_group_name_H-M", "_space_group.name_H-M_alt"):
        value = block.find_value(tag)
        if value is not None and gemmi.cif.as_string(value).strip():
            sg_name = gemmi.cif.as_string(value).strip()
            break
    if sg_name is None:
        raise _fail(path, "has no space group (_symmetry.space_group_name_H-M)")
    sg = gemmi.find_spacegroup_by_name(sg_name)
    if sg is None:
        raise _fail(path, f"unknown space group {sg_name!r}")
    table = block.find("_refln.", ["index_h", "index_k", "index_l"])
    n = len(table)
    if n == 0:
        raise _fail(path, "holds no reflections")

    def numbers(tag, integer=False):
        column = block.find_values(f"_refln.{tag}")
        out = np.empty(n, dtype=np.float64)
        for i in range(n):
            text = column[i]
            if text in ("?", "."):
                out[i] = np.nan
                continue
            try:
                out[i] = float(text)
            except ValueError:
                raise _fail(path, f"_refln.{tag} row {i + 1} is not a number ({text!r})") from None
        if integer and not np.all(np.isfinite(out) & (out == np.rint(out))):
            raise _fail(path, f"_refln.{tag} holds a value that is not an integer")
        return out

    hkl = np.stack([numbers(t, True) for t in ("index_h", "index_k", "index_l")], axis=1).astype(np.int64)
    values = [
        numbers(amplitudes),
        None if phases is None else numbers(phases),
        None if sigmas is None else numbers(sigmas),
    ]
    return hkl, values, [amplitudes, phases, sigmas], tuple(params), sg.hm, notes


def write_structure_factors(path: str | os.PathLike, factors, *, labels: tuple[str, str] = ("FC", "PHIC")) -> Path:
    """Write complex factors to an MTZ file (H, K, L, amplitude as type F, phase in degrees as type P).

    Parameters
    ----------
    path : str or os.PathLike
    factors : kernels.StructureFactors
        Any device and complex dtype; the file holds them in float32, as MTZ does.
    labels : (str, str)
        Amplitude and phase column labels.

    Returns
    -------
    pathlib.Path
        The file written (through a temporary file in the same folder, renamed when complete).
    """
    import gemmi

    path = Path(path)
    hkl = factors.hkl.detach().cpu().numpy()
    f = factors.f.detach().to(torch.complex128).cpu()
    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup(factors.spacegroup)
    mtz.set_cell_for_all(factors.cell.to_gemmi())
    mtz.add_dataset("calculated")
    mtz.add_column(labels[0], "F")
    mtz.add_column(labels[1], "P")
    data = np.empty((len(hkl), 5), dtype=np.float32)
    data[:, :3] = hkl
    data[:, 3] = f.abs().numpy()
    data[:, 4] = torch.rad2deg(torch.angle(f)).numpy()
    mtz.set_data(data)
    mtz.history = ["density-workbench: structure factors from the map (kernels.structure_factors)"]
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        mtz.write_to_file(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def match_reflections(a_hkl: torch.Tensor, b_hkl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``a_hkl`` and ``b_hkl`` with the same Miller indices.

    Parameters
    ----------
    a_hkl, b_hkl : torch.Tensor, shape (Ma, 3) and (Mb, 3), integer, on one device

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        Indices ``ia`` into ``a_hkl`` and ``ib`` into ``b_hkl`` (int64, same length) with
        ``a_hkl[ia] == b_hkl[ib]``, in the order of ``a_hkl``. A Miller index repeated in ``b`` matches
        one of its rows.
    """
    both = torch.cat((a_hkl, b_hkl)).to(torch.int64)
    lo = both.min(dim=0).values
    span = both.max(dim=0).values - lo + 1

    def keys(h):
        h = h.to(torch.int64) - lo
        return (h[:, 0] * span[1] + h[:, 1]) * span[2] + h[:, 2]

    ka, kb = keys(a_hkl), keys(b_hkl)
    order = torch.argsort(kb)
    sorted_b = kb[order]
    pos = torch.searchsorted(sorted_b, ka).clamp_(max=max(len(kb) - 1, 0))
    hit = sorted_b[pos] == ka if len(kb) else torch.zeros_like(ka, dtype=torch.bool)
    ia = torch.nonzero(hit).squeeze(1)
    return ia, order[pos[ia]]


@dataclasses.dataclass(frozen=True)
class RFactor:
    """The R-factor of calculated factors against observed amplitudes, after an overall scale and B.

    |F_obs| ≈ k·exp(−B·s²/4)·|F_calc|, k and B fitted by least squares; R = Σ||F_obs| − k·e^{−Bs²/4}|F_calc||
    / Σ|F_obs| over the reflections the two sets share.

    Attributes
    ----------
    r : float
        Overall R.
    scale : float
        k.
    b : float
        B in Å² (0 when not fitted).
    n_used : int
        Reflections in common (the sums run over them).
    n_observed : int
        Observed reflections given.
    table : kernels.ShellTable
        By shell, the scaled calculated amplitudes against the observed (``r_factor``, ``correlation``).
    bulk_solvent : bool
        Always False: no bulk-solvent model is applied, so at low resolution (below about 1/6 Å⁻¹,
        where the solvent's contrast lowers the observed amplitudes) R is higher than a refinement
        program's with a solvent model.
    """

    r: float
    scale: float
    b: float
    n_used: int
    n_observed: int
    table: object
    bulk_solvent: bool = False

    def __str__(self) -> str:
        return (
            f"R = {self.r:.4f} over {self.n_used} of {self.n_observed} observed reflections "
            f"(scale {self.scale:.4g}, B {self.b:+.2f} Å²; no bulk-solvent model)"
        )


def r_factor(observed, calculated, *, fit_b: bool = True, n_shells: int = 10) -> RFactor:
    """R-factor of ``calculated`` against ``observed`` amplitudes with a fitted overall scale (and B).

    Parameters
    ----------
    observed : kernels.StructureFactors or ReflectionData
        Observed amplitudes (real ``f``, or complex whose phases are ignored).
    calculated : kernels.StructureFactors
        Factors of a model (e.g. :func:`kernels.structure_factors` of its symmetrised map, in the
        observed data's space group, to at most the data's d_min). Reflections are matched by Miller
        index; both sets must be in the same asymmetric unit convention (gemmi's and CCP4's are).
    fit_b : bool
        Fit an overall B as well as the scale k (default); False fits k alone.
    n_shells : int
        Shells of the returned table (equal counts).

    Returns
    -------
    RFactor

    Raises
    ------
    ValueError
        No reflection in common (different space groups or ASU conventions, or no overlap in resolution),
        or fewer than 2 with a non-zero amplitude.

    Notes
    -----
    Bulk solvent is not modelled (see :attr:`RFactor.bulk_solvent`). The fit minimises
    Σ(|F_obs| − k·e^{−Bs²/4}|F_calc|)²: k in closed form for each B, B by golden-section search in
    [−100, 300] Å² on the host, in float64.
    """
    from kernels.reciprocal.factors import StructureFactors
    from kernels.reciprocal.shells import shells

    if isinstance(observed, ReflectionData):
        observed = observed.factors
    obs_hkl = observed.hkl.to(calculated.hkl.device)
    io, ic = match_reflections(obs_hkl, calculated.hkl)
    if len(io) == 0:
        raise ValueError(
            f"the observed ({observed.spacegroup}) and calculated ({calculated.spacegroup}) sets share no "
            "reflection: compute the factors in the data's space group and to its resolution"
        )
    fo = observed.f.detach().to(calculated.hkl.device)[io].abs().double().cpu().numpy()
    fc = calculated.f.detach()[ic].abs().double().cpu().numpy()
    s2 = calculated.inv_d2[ic].double().cpu().numpy()
    usable = (fo > 0) | (fc > 0)
    if usable.sum() < 2:
        raise ValueError("fewer than 2 reflections in common have a non-zero amplitude")

    def fit(b):
        g = np.exp(-b * s2 / 4) * fc
        den = float(g @ g)
        k = float(fo @ g) / den if den > 0 else 0.0
        return k, float(((fo - k * g) ** 2).sum())

    b = 0.0
    if fit_b:
        lo, hi = -100.0, 300.0
        phi = (math.sqrt(5) - 1) / 2
        x1, x2 = hi - phi * (hi - lo), lo + phi * (hi - lo)
        r1, r2 = fit(x1)[1], fit(x2)[1]
        for _ in range(80):
            if r1 < r2:
                hi, x2, r2 = x2, x1, r1
                x1 = hi - phi * (hi - lo)
                r1 = fit(x1)[1]
            else:
                lo, x1, r1 = x1, x2, r2
                x2 = lo + phi * (hi - lo)
                r2 = fit(x2)[1]
        b = 0.5 * (lo + hi)
    k, _ = fit(b)
    scaled = k * np.exp(-b * s2 / 4) * fc
    r = float(np.abs(fo - scaled).sum() / fo.sum())
    hkl = calculated.hkl[ic].cpu()
    inv_d2 = calculated.inv_d2[ic].cpu()
    calc_set = StructureFactors(
        hkl, torch.from_numpy(scaled), calculated.cell, calculated.spacegroup, calculated.d_min, inv_d2
    )
    obs_set = calc_set.replace(f=torch.from_numpy(fo))
    table = shells(calc_set, obs_set, n_shells=min(n_shells, len(io)))
    return RFactor(r, k, b, int(len(io)), int(len(observed)), table)
