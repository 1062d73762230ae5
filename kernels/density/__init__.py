"""Gaussian density splatting: one public function, three backends.

``reference`` (float64 torch, the truth), ``cpu`` (separable C++/OpenMP) and ``triton``
(CUDA). :func:`splat_density` picks one through :mod:`kernels.dispatch`.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from kernels._util import finite_number, positive_number
from kernels.adp import U_TO_B, first_bad_adp, with_blur
from kernels.crystal import AtomSet, GridError, GridSpec
from kernels.density.positions import check_finite
from kernels.density.radius import DEFAULT_CUTOFF, RADIUS_RULES, atom_cutoff_radii, cutoff_radius
from kernels.dispatch import AUTO_ORDER, BackendError, get_backend, registered_backends, resolve_backend

__all__ = [
    "splat_density",
    "check_finite",
    "cutoff_radius",
    "atom_cutoff_radii",
    "density_unit",
    "density_integral_unit",
    "VOLTS_PER_INVERSE_SQUARE_ANGSTROM",
    "peak_density",
    "DEFAULT_CUTOFF",
    "RADIUS_RULES",
]

# Most voxels one atom's box may span (2^27: about a second of work per atom on one core, 1 GiB of
# float64 for the reference's per-atom chunk). A fixed radius beyond it is a unit mistake (nm, or
# "everything"), not a density; per-atom radii from the cutoff stay below 60 Å and never reach it.
MAX_BOX_VOXELS = 1 << 27


def _check_radius_extent(radius: float, grid: GridSpec) -> None:
    """GridError when a fixed ``radius`` makes each atom's box span more than MAX_BOX_VOXELS voxels."""
    per_angstrom = [r * m for r, m in zip(grid.cell.reciprocal_lengths, grid.sampling)]  # voxels per Å
    box = 1
    for k in per_angstrom:  # a loop, not math.prod over a generator: torch.compile traces this with the call
        box *= 2 * math.ceil(radius * k) + 1
    if box > MAX_BOX_VOXELS:
        # the largest radius whose box stays within the limit (a cube of side 2·R·k + 1 per axis)
        r_max = (MAX_BOX_VOXELS ** (1 / 3) - 1) / (2 * max(per_angstrom))
        nx, ny, nz = grid.shape
        raise GridError(
            f"radius={radius:g} Å makes each atom cover {box:.3g} voxels of this {nx}×{ny}×{nz} grid "
            f"(at most {MAX_BOX_VOXELS} per atom); a density radius is a few Å: use radius ≤ {r_max:.4g} Å, "
            "or radius=None for each atom's own radius from the cutoff"
        )


def _splat_arguments(radius, cutoff, blur, radius_rule: str, grid: GridSpec) -> tuple[float | None, float, float]:
    """The host scalar arguments of a splat, checked the same way for every function that takes them.

    ``radius`` None or a positive finite number of Å whose box per atom stays within
    ``MAX_BOX_VOXELS`` of ``grid``; ``cutoff`` a positive finite number; ``blur`` a finite number of
    Å²; ``radius_rule`` one of ``RADIUS_RULES``. Numbers may be Python, numpy or one-element torch
    scalars (:func:`kernels._util.positive_number`); bool, strings and tensors of several elements
    are refused. The usual Python floats skip the validator's call.

    Returns
    -------
    (radius, cutoff, blur) as Python floats (radius None when not given).

    Raises
    ------
    ValueError
        An argument of the wrong type or range, named with its value.
    kernels.GridError
        ``radius`` makes each atom's box larger than ``MAX_BOX_VOXELS`` voxels.
    """
    if radius_rule not in RADIUS_RULES:
        raise ValueError(f"radius_rule must be one of {RADIUS_RULES}, got {radius_rule!r}")
    if radius is not None:
        radius = positive_number(radius, "radius", "Å")
        _check_radius_extent(radius, grid)
    if type(cutoff) is not float or not 0.0 < cutoff < math.inf:
        cutoff = positive_number(cutoff, "cutoff", "the map's unit")
    if type(blur) is not float or not math.isfinite(blur):
        blur = finite_number(blur, "blur", "Å²")
    return radius, cutoff, blur


def peak_density(atoms: AtomSet) -> torch.Tensor:
    """Each atom's density at its centre, in :func:`density_unit` (negative for neutron hydrogen).

    Isotropic atoms: occ·Σ_k a_k·(4π/(b_k + B))^{3/2}; anisotropic ones:
    occ·Σ_k a_k·(2π)^{-3/2}·det(U + b_k/(8π²)·I)^{-1/2}.

    Returns
    -------
    torch.Tensor, shape (N,), the atoms' dtype and device; not differentiable.
    """
    with torch.no_grad():
        if atoms.device.type == "cpu":
            return torch.from_numpy(_peak_density_host(atoms))
        if atoms.u_aniso is not None:
            from kernels.adp import effective_u, term_gaussians

            u = effective_u(atoms.u_aniso, atoms.aniso, atoms.b_iso)
            amp, _ = term_gaussians(u, atoms.occ, atoms.a, atoms.b, torch.eye(3, dtype=u.dtype))
            return amp.sum(dim=1)
        scale = torch.reciprocal(atoms.b + atoms.b_iso[:, None]).mul_(4 * math.pi)  # 4π/B_k
        scale.mul_(scale.sqrt()).mul_(atoms.a)  # a_k·(4π/B_k)^{3/2}, without pow
        return scale.sum(dim=1).mul_(atoms.occ)


def _peak_density_host(atoms: AtomSet) -> np.ndarray:
    """:func:`peak_density` of CPU atoms in numpy: one pass over N×5 values on the calling thread.

    torch would split it over its thread pool, whose threads may be busy elsewhere (a browser,
    another kernel) and hold the splat call up behind them.
    """
    with torch.no_grad():
        a, b = _host_array(atoms.a), _host_array(atoms.b)
        b_iso, occ = _host_array(atoms.b_iso), _host_array(atoms.occ)
        if atoms.u_aniso is not None:
            u, flag = _host_array(atoms.u_aniso), atoms.aniso.numpy()
    # An atom with no peak (B ≤ 0, a U that is not positive definite) divides by zero here: the
    # kernels refuse it with its name, so the warning this estimate serves stays quiet about it.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = (4 * math.pi) / (b + b_iso[:, None])
        peaks = (a * (scale * np.sqrt(scale))).sum(axis=1) * occ
        if atoms.u_aniso is not None and flag.any():
            # det(U + c·I) from U's characteristic polynomial: c³ + tr·c² + m₂·c + det, per term width c.
            ua = u[flag]
            u11, u22, u33, u12, u13, u23 = ua.T
            tr = u11 + u22 + u33
            m2 = u11 * u22 + u11 * u33 + u22 * u33 - u12 * u12 - u13 * u13 - u23 * u23
            det = u11 * (u22 * u33 - u23 * u23) - u12 * (u12 * u33 - u23 * u13) + u13 * (u12 * u23 - u22 * u13)
            c = b[flag] / U_TO_B
            det_m = c**3 + tr[:, None] * c**2 + m2[:, None] * c + det[:, None]
            # a U that is not positive definite has no peak; the kernel refuses it, not this warning
            det_m = np.clip(det_m, 1e-300, None)
            peaks[flag] = (a[flag] * (2 * math.pi) ** -1.5 / np.sqrt(det_m)).sum(axis=1) * occ[flag]
    return peaks


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array: a view for the dtypes numpy has, float32 for bfloat16."""
    t = t.detach()
    return t.numpy() if t.dtype != torch.bfloat16 else t.to(torch.float32).numpy()


def _density_at(atoms: AtomSet, distance: float, radius_rule: str, rows: np.ndarray) -> np.ndarray:
    """|density| at occupancy 1, ``distance`` Å from the centres of host atoms ``rows`` (indices), where
    their radius rule measures it.

    Isotropic atoms (and anisotropic ones under the ``gemmi`` rule, at B = 8π²·max diag U):
    Σ_k a_k·(4π/W_k)^{3/2}·exp(−4π²d²/W_k), W_k = b_k + B. Anisotropic atoms under ``eigen``: along
    U's major axis, Σ_k a_k·(2π)^{-3/2}·det(M_k)^{-1/2}·exp(−d²/(2·λ_max(M_k))), M_k = U + b_k/(8π²)·I.
    """
    a, b = _host_array(atoms.a)[rows].astype(np.float64), _host_array(atoms.b)[rows].astype(np.float64)
    bb = _host_array(atoms.b_iso)[rows].astype(np.float64)
    flag = np.zeros(len(rows), dtype=bool) if atoms.u_aniso is None else atoms.aniso.numpy()[rows]
    if flag.any():
        u = _host_array(atoms.u_aniso)[rows][flag].astype(np.float64)
        bb[flag] = U_TO_B * u[:, :3].max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = (4 * math.pi) / (b + bb[:, None])
        rho = (a * (scale * np.sqrt(scale)) * np.exp(-math.pi * distance * distance * scale)).sum(axis=1)
        if radius_rule == "eigen" and flag.any():
            full = np.zeros((len(u), 3, 3))
            for k, (i, j) in enumerate(((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))):
                full[:, i, j] = full[:, j, i] = u[:, k]
            lam = np.linalg.eigvalsh(full)  # ascending
            m = lam[:, None, :] + (b[flag] / U_TO_B)[:, :, None]  # (n, 5, 3) eigenvalues of each M_k
            amp = a[flag] * (2 * math.pi) ** -1.5 / np.sqrt(np.clip(m.prod(axis=2), 1e-300, None))
            rho[flag] = (amp * np.exp(-(distance**2) / (2 * m[:, :, 2]))).sum(axis=1)
    return np.abs(rho)  # a neutron length can be negative (hydrogen)


def _atoms_below_spacing(atoms: AtomSet, cutoff: float, grid: GridSpec, radius_rule: str = "gemmi"):
    """Host atoms (occupancy > 0) whose cutoff radius is below the grid's spacing h, or None.

    Such an atom reaches only the grid points within its radius of its centre: none, or a few
    voxels of its peak, not its shape. The radius rule brackets the level between two points 0.5 Å
    apart and interpolates, so an atom whose density at d = h + 0.5 Å is still above the cutoff has
    a radius ≥ h. For an isotropic atom whose negative terms (IT92's c of N, …) have width exactly B,
    that density is at least its peak·exp(−4π²d²/B) (every other term is wider): one exp per atom.
    Anisotropic atoms and other coefficient tables take :func:`_density_at`. The few atoms left
    (normally none) get their radii from the rule the kernels use (:func:`atom_cutoff_radii`).
    The radius does not depend on the occupancy.

    Returns
    -------
    None, or (index, count, radius Å, peak at occupancy 1) of the first such atom and how many there are.
    """
    if len(atoms) == 0:
        return None
    d = max(grid.spacing) + 0.5
    occ = _host_array(atoms.occ)
    b_iso = _host_array(atoms.b_iso)
    unit = np.abs(_peak_density_host(atoms)) / np.maximum(occ, 1e-30)  # B > 0 (AtomSet): no warnings
    low = ~(unit * np.exp((-4 * math.pi**2 * d * d) / b_iso) >= cutoff) & (occ > 0)
    negative = (_host_array(atoms.a) < 0) & (_host_array(atoms.b) > 0)
    exact = negative.any(axis=1) if negative.any() else np.zeros(len(occ), dtype=bool)  # a flat any() is cheap
    if atoms.u_aniso is not None:
        exact |= atoms.aniso.numpy()
    if exact.any():
        rows = np.flatnonzero(exact & (occ > 0))
        low[exact] = False
        low[rows] = _density_at(atoms, d, radius_rule, rows) < cutoff * (1 + 1e-6)
    if not low.any():
        return None
    index = np.flatnonzero(low)
    radii = atom_cutoff_radii(atoms.select(torch.from_numpy(index)), cutoff, radius_rule).numpy()
    small = radii < max(grid.spacing)
    if not small.any():
        return None
    first = int(np.flatnonzero(small)[0])
    idx = int(index[first])
    peak = float(_density_at(atoms, 0.0, radius_rule, np.array([idx]))[0])
    return idx, int(small.sum()), float(radii[first]), peak


def _points_within(atoms: AtomSet, idx: int, radius: float, grid: GridSpec) -> int:
    """How many grid points lie closer than ``radius`` Å to atom ``idx`` (periodic lattice; ``radius`` < a few voxels)."""
    cell = grid.cell
    m = torch.tensor(grid.sampling, dtype=torch.float64)
    f = atoms.xyz[idx].detach().to(torch.float64) @ cell.frac.T
    reach = radius * torch.tensor(cell.reciprocal_lengths, dtype=torch.float64) * m
    lo = torch.floor(f * m - reach).to(torch.int64).tolist()
    hi = torch.ceil(f * m + reach).to(torch.int64).tolist()
    axes = [torch.arange(a, b + 1, dtype=torch.float64) for a, b in zip(lo, hi)]
    pts = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3) / m - f
    r2 = ((pts @ cell.metric) * pts).sum(dim=1)
    return int((r2 < radius * radius).sum())


def _warn_atoms_below_spacing(
    atoms: AtomSet, cutoff: float, grid: GridSpec, radius_rule: str = "gemmi", frame_size: int | None = None
) -> None:
    """Warn when some atom's cutoff radius is below the grid spacing, saying what the map keeps of it.

    Host tensors only (a few µs for 10^4 atoms); on a GPU the answer would have to be read back.
    ``frame_size``: the atoms are frames of that many atoms each (an ensemble); the message names the frame.
    """
    found = _atoms_below_spacing(atoms, cutoff, grid, radius_rule)
    if found is not None:
        _warn_small(atoms, found, cutoff, grid, frame_size)


def _warn_small(
    atoms: AtomSet, found, cutoff: float, grid: GridSpec, frame_size: int | None = None, first_frame: int = 0
) -> None:
    """The warning of :func:`_warn_atoms_below_spacing` for its finding ``found`` on ``atoms``
    (frames ``first_frame``, … of ``frame_size`` atoms each, when given)."""
    idx, count, radius, peak = found
    kept = _points_within(atoms, idx, radius, grid)
    h = max(grid.spacing)
    unit = density_unit(atoms.radiation)
    label = atoms.labels[idx] if len(atoms.labels) == len(atoms) else f"#{idx + 1}"
    where = f"atom {label} (index {idx})"
    if frame_size:
        where = f"frame {first_frame + idx // frame_size}: atom {label} (index {idx % frame_size})"
    more = f" and {count - 1} more atoms" if count > 1 else ""
    why = " (B too large, or the cutoff too high?)" if peak < cutoff else ""
    if kept == 0:
        what = "no grid point lies that close, so the map leaves it out"
    else:
        what = (
            f"the map holds it at only the {kept} grid point{'s' if kept > 1 else ''} that close to its centre, "
            "not its shape"
        )
    warnings.warn(
        f"{where}{more}: peak density {peak:.3g} {unit} (at occupancy 1), cutoff {cutoff:g} {unit}: its cutoff radius "
        f"{radius:.3g} Å is below the grid spacing {h:.3g} Å{why}; {what}. Lower the cutoff, pass radius= "
        "to splat it whole, or use a finer spacing",
        UserWarning,
        stacklevel=4 if frame_size is None else 5,
    )


#: Electrostatic potential in volts of a 1 Å⁻² electron map: h²/(2π·m_e·e) = 47.878 V·Å² (CODATA 2018).
VOLTS_PER_INVERSE_SQUARE_ANGSTROM = 47.878

# radiation -> (the map's unit, what the map's integral over the cell counts). The coefficients'
# unit sets both: X-ray form factors count electrons (ρ in e/Å³), electron form factors are
# lengths in Å (ρ in Å/Å³ = Å⁻², 47.878 V per Å⁻² of potential), neutron scattering lengths
# are in fm (ρ in fm/Å³).
_UNITS = {
    "xray": ("e/Å³", "electrons"),
    "electron": ("Å⁻²", "Å of Σ f_e(0)"),
    "neutron": ("fm/Å³", "fm of scattering length"),
}


def density_unit(radiation: str, *, ascii: bool = False) -> str:
    """The unit of a map splatted from the coefficients of ``radiation``.

    ``"e/Å³"`` for X-rays (electron density), ``"Å⁻²"`` for electrons (their form factors
    are lengths in Å, so the map is Å/Å³; multiply by :data:`VOLTS_PER_INVERSE_SQUARE_ANGSTROM`
    for the electrostatic potential in V), ``"fm/Å³"`` for neutrons (scattering-length density).
    The one place the units are named: the command line, the views and the docs use it.
    ``ascii=True`` spells it for a CCP4 map label (``"e/A^3"``, ``"A^-2"``, ``"fm/A^3"``).

    Raises
    ------
    ValueError
        ``radiation`` is not ``"xray"``, ``"electron"`` or ``"neutron"``.
    """
    unit = _radiation_units(radiation)[0]
    return unit.replace("Å", "A").replace("⁻²", "^-2").replace("³", "^3") if ascii else unit


def density_integral_unit(radiation: str) -> str:
    """What the integral of a ``radiation`` map over the cell counts: ``"electrons"`` for X-rays,
    ``"Å of Σ f_e(0)"`` for electrons, ``"fm of scattering length"`` for neutrons (Σ occ·f(0))."""
    return _radiation_units(radiation)[1]


def _radiation_units(radiation: str) -> tuple[str, str]:
    try:
        return _UNITS[radiation]
    except (KeyError, TypeError):
        raise ValueError(f"radiation must be one of {', '.join(map(repr, _UNITS))}, got {radiation!r}") from None


def splat_density(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    blur: float = 0.0,
    radius_rule: str = "gemmi",
) -> torch.Tensor:
    """Density of ``atoms`` on ``grid`` (periodic in the unit cell).

    Electron density in e/Å³ for X-ray coefficients; for electron coefficients (lengths in Å) a
    map in Å⁻², the electrostatic potential in units of 47.878 V (the map gemmi's
    ``DensityCalculatorE`` computes); scattering-length density in fm/Å³ for neutron lengths
    (:func:`density_unit`).

    Parameters
    ----------
    atoms : AtomSet
        Positions (N, 3) Å, B (N,) Å², occupancies (N,), form-factor coefficients (N, 5), and for
        anisotropic sets U (N, 6) Å² with the ``aniso`` (N,) mask. The device of its tensors picks
        where the work runs.
    grid : GridSpec
        Whole-cell grid (every backend) or box grid (``reference`` only).
    radius : float, optional
        One cutoff radius in Å for every atom. Default: each atom's radius is where its
        density falls to ``cutoff`` (gemmi's rule).
    cutoff : float
        Density level in the map's unit (:func:`density_unit`: e/Å³, Å⁻² or fm/Å³) setting the
        per-atom radius (default 1e-5).
    backend : {"auto", "reference", "cpu", "triton"}
        ``auto`` runs ``cpu`` for CPU tensors and ``triton`` for CUDA tensors.
    out : torch.Tensor, optional
        ``cpu`` backend only: a float32, C-contiguous CPU tensor of shape ``grid.shape`` that
        receives the map (every voxel overwritten) and is returned. For loops over the same grid:
        a reused map skips the page faults of a fresh one (~35 MB on a 0.667 Å grid of 3WIP). An
        in-place result is not differentiable: refused while gradients are recorded for ``atoms``
        (splat under ``torch.no_grad()``, or leave ``out`` out).
    blur : float
        Extra B in Å² added to every atom (gemmi's ``blur``): ``b_iso + blur`` for isotropic atoms,
        ``U + blur/(8π²)·I`` for anisotropic ones; it widens the radii too. Negative values sharpen,
        as long as every atom stays a Gaussian (B > 0, U positive definite): eager CPU calls name an
        atom that does not (ValueError); on a GPU and under ``torch.compile``, where that check would
        read values back, such an atom adds nothing.
    radius_rule : {"gemmi", "eigen"}
        The cutoff radius of anisotropic atoms when ``radius`` is None: ``gemmi`` (the isotropic
        rule at 8π² × the largest diagonal element of U; gemmi's maps voxel for voxel) or ``eigen``
        (the exact sphere of the largest eigenvalue). See :func:`kernels.density.atom_cutoff_radii`.

    Returns
    -------
    torch.Tensor, shape grid.shape
        Density in :func:`density_unit` (e/Å³; Å⁻² for electrons, fm/Å³ for neutrons): float64 from ``reference``, float32 from ``cpu``
        and ``triton``. Differentiable with respect to ``atoms.xyz``, ``atoms.b_iso`` (isotropic
        atoms), ``atoms.u_aniso`` (anisotropic atoms) and ``atoms.occ`` (``out`` itself when given,
        not differentiable).

    Warns
    -----
    UserWarning
        (``cpu``, ``reference``, whose atoms are read on the host anyway) An atom whose B, or whose
        U along its narrowest axis (8π²·λmin), is below ``MIN_PHYSICAL_B`` (0.5 Å²), as
        :meth:`AtomSet.check` warns: its density is a spike the grid samples at a few points, so
        the map's integral is off by orders of magnitude (U = 1e-8 Å² gives billions of electrons).
        On a GPU (``triton``) and under ``torch.compile`` no value is read back and nothing warns:
        call ``atoms.check()`` once where the atoms are built (``read_model`` and the CLI do).
        Also an atom whose cutoff radius is below the grid spacing.

    Raises
    ------
    kernels.BackendError
        The backend asked for cannot run here.
    kernels.GridError
        The map would not fit in memory, a fast backend got a box grid, or ``radius`` makes each
        atom's box larger than ``MAX_BOX_VOXELS`` voxels.
    ValueError
        ``radius``/``cutoff`` not a positive finite number, ``blur`` not finite or leaving an atom
        without a Gaussian (named), ``radius_rule`` unknown, or (``cpu``, ``reference``) an atom
        with a non-finite position or a U that is not positive definite, named. The ``triton`` backend does not read positions back
        (no host synchronisation): there such an atom adds nothing and gets zero gradients, and
        :func:`check_finite` raises the same error where the caller synchronises anyway.
        ``out`` given to another backend than ``cpu``, or of the wrong shape, dtype, device or
        layout, or while gradients are recorded (the message says which).

    Notes
    -----
    Under ``torch.compile`` the ``cpu`` and ``triton`` backends run as ``torch.library`` custom
    ops (``kernels.density.ops``), so a loop of splats compiles with ``fullgraph=True``; eager
    calls apply the same definitions' autograd Functions directly. A registered backend (and
    ``reference``) has no op: compiled without ``fullgraph`` its call runs eagerly at a graph
    break; under ``fullgraph=True`` it raises :class:`kernels.BackendError` saying why.
    """
    radius, cutoff, blur = _splat_arguments(radius, cutoff, blur, radius_rule, grid)
    if blur != 0.0:
        atoms = _blurred(atoms, blur)
    if torch.compiler.is_compiling():
        if out is not None:
            raise ValueError("out= is not supported under torch.compile; use the returned map")
        return _splat_compiling(atoms, grid, radius, cutoff, backend, radius_rule)
    name, fn = get_backend("density", atoms.device, backend)
    if atoms.device.type == "cpu":
        if name in _HOST_CHECKED:
            # These backends read the values on the host anyway: a bad B, occupancy or coefficient is
            # named here, not left to make NaN voxels (AtomSet(...) reads no value; positions and U
            # are checked by the backends themselves).
            # The tiny-B/U rule of AtomSet.check as well (a warning): an atom narrower than zero-point
            # motion allows is a spike the grid samples at a few points, so the map's integral is off by
            # orders of magnitude. A GPU splat reads no value back: there atoms.check() says it.
            atoms._check_values(physical=False, warn=True)
            atoms._warn_tiny_u(stacklevel=3)
        if radius is None:
            _warn_atoms_below_spacing(atoms, cutoff, grid, radius_rule)
    if name != "reference" and not grid.is_whole_cell:
        raise GridError(f"the {name} density backend splats whole-cell grids only; use backend='reference' for a box")
    dtype = torch.float64 if name == "reference" else torch.float32
    key = (grid.cell.parameters, grid.shape, dtype, atoms.device)
    if key not in _memory_checked:  # once per grid: the query is a driver call, and not allowed in graph capture
        grid.require_memory(dtype, atoms.device, copies=2)
        _memory_checked.add(key)
    extra = {} if atoms.u_aniso is None else {"radius_rule": radius_rule}
    if out is None:
        return fn(atoms, grid, radius=radius, cutoff=cutoff, **extra)
    if name != "cpu":
        raise ValueError(f"out= is supported by the cpu density backend only, not {name}; leave out= out")
    return fn(atoms, grid, radius=radius, cutoff=cutoff, out=out, **extra)


_memory_checked: set[tuple] = set()
# The backends whose CPU calls check the atoms' values (the triton backend never reads them back).
_HOST_CHECKED = ("cpu", "reference")


def _blurred(atoms: AtomSet, blur: float) -> AtomSet:
    """``atoms`` with ``blur`` Å² added to every atom (:func:`kernels.adp.with_blur`), checked."""
    blurred = with_blur(atoms, blur)
    if not torch.compiler.is_compiling():  # a host read; compiled, the kernels see what eager would refuse
        _check_blurred(blurred, blur)
    return blurred


def _check_blurred(blurred: AtomSet, blur: float, frame_size: int | None = None, first_frame: int = 0) -> None:
    """ValueError when a negative ``blur`` left an atom of host atoms ``blurred`` with B ≤ 0 or a U not positive definite.

    On a GPU that check would read values back, and such an atom adds nothing there. ``frame_size``:
    the atoms are frames ``first_frame``, ``first_frame + 1``, … of that many atoms each (an
    ensemble); the message names the frame.
    """
    if not (blur < 0 and blurred.device.type == "cpu" and len(blurred)):
        return

    def where(idx: int) -> str:
        if frame_size:
            return f"frame {first_frame + idx // frame_size}: atom {blurred.labels[idx]} (index {idx % frame_size})"
        return f"atom {blurred.labels[idx]} (index {idx})"

    b = blurred.b_iso.detach()
    iso = b <= 0 if blurred.aniso is None else (b <= 0) & ~blurred.aniso
    if iso.any():
        idx = int(iso.nonzero()[0, 0])
        raise ValueError(
            f"blur={blur:g} Å² leaves {where(idx)} with B = {float(b[idx]):.4g} Å² ≤ 0; "
            "use a blur above minus the smallest B"
        )
    if blurred.u_aniso is not None:
        bad = first_bad_adp(blurred.u_aniso, blurred.aniso)
        if bad is not None:
            idx, _count, what = bad
            raise ValueError(f"blur={blur:g} Å² leaves {where(idx)} that {what[4:]}")


def _splat_compiling(atoms: AtomSet, grid: GridSpec, radius, cutoff, backend: str, radius_rule: str) -> torch.Tensor:
    """:func:`splat_density` inside ``torch.compile``: the backend's custom op (``kernels.density.ops``).

    The ops are built from the same definitions as the eager autograd Functions (:mod:`kernels._opdef`);
    eager calls skip the ops' dispatch, which costs host time a direct call does not. What the eager path
    checks on the host with values read back (the memory query, the peak-density warning) is left out of
    the graph; the arguments came through :func:`_splat_arguments` at trace time.
    """
    from kernels.density.ops import splat_density_op

    if backend == "auto":  # the dispatch table's first choice for the device (both have ops)
        backend = AUTO_ORDER[atoms.device.type][0]
    if backend not in _COMPILED_BACKENDS:
        raise BackendError(_not_compiled(backend, atoms.device))
    if not grid.is_whole_cell:
        raise GridError(
            f"the {backend} density backend splats whole-cell grids only; use backend='reference' for a box"
        )
    extra = {} if atoms.u_aniso is None else {"radius_rule": radius_rule}
    return splat_density_op(atoms, grid, backend, radius, cutoff, **extra)


# The backends with torch.library ops (their definitions in kernels.density.triton and kernels.density.ops).
_COMPILED_BACKENDS = ("cpu", "triton")


def _not_compiled(backend: str, device: torch.device) -> str:
    """Why ``backend`` cannot run under ``torch.compile``, and what to do instead."""
    if backend in registered_backends("density"):
        return (
            f"density backend {backend!r} is a registered Python function, not a torch.library op, so "
            "splat_density does not put it in a compiled graph (the compiler would trace through its own "
            "code, whose host reads and kernel launches break or freeze the graph): without fullgraph the "
            "call runs eagerly at a graph break, and torch.compile(fullgraph=True) cannot take it. Call "
            f"splat_density(..., backend={backend!r}) outside the fullgraph function, compile with "
            "backend='cpu' or 'triton', or define your function as an op (kernels._opdef.OpDef, register) "
            "and call that op inside the compiled code"
        )
    if backend == "reference":
        return (
            "the float64 reference density backend runs eagerly only (it reads values back to check them): "
            "without fullgraph the call runs eagerly at a graph break, and torch.compile(fullgraph=True) "
            "cannot take it; call it outside the fullgraph function, or compile with backend='cpu' or 'triton'"
        )
    resolve_backend("density", device, backend)  # an unknown name: the eager call's error
    return f"density backend {backend!r} has no torch.library op; use backend='cpu' or 'triton' under torch.compile"
