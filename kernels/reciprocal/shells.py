"""Statistics by resolution shell: errors against a reference set, R-factor, correlation and FSC.

Every statistic is a ratio of sums over the reflections of a shell, so one pass gathers the sums
of all of them (a ``scatter_add_`` per sum, in float64) and the ratios are taken per shell.
Nothing here reads a value back to the host except :meth:`ShellTable.crossing` and
:meth:`ShellTable.as_dict`, so a table on a GPU costs no synchronisation until it is looked at.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["BINNINGS", "ShellTable", "shells", "fsc", "shell_index"]

#: ``count``: equal numbers of reflections; ``volume``: equal volumes of reciprocal space (equal steps of
#: s³, s = 1/d); ``width``: equal steps of s (one Fourier voxel thick shells, the cryo-EM FSC convention).
BINNINGS = ("count", "volume", "width")


def _parts(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Real and imaginary parts of complex (or real: amplitudes with phase 0) factors, as float64."""
    if f.is_complex():
        return f.real.to(torch.float64), f.imag.to(torch.float64)
    return f.to(torch.float64), torch.zeros_like(f, dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class ShellTable:
    """Shell-by-shell statistics, lowest resolution first; every field a tensor of shape (S,).

    Attributes
    ----------
    d_max, d_min : torch.Tensor, float64
        Each shell's resolution range in Å (d_max is its low-resolution edge).
    count : torch.Tensor, int64
        Reflections in the shell.
    mean_intensity : torch.Tensor, float64
        ⟨|F|²⟩ of the first set.
    rel_error : torch.Tensor, float64, or None
        ‖F − F_ref‖₂ / ‖F_ref‖₂: amplitude and phase together.
    amplitude_error : torch.Tensor, float64, or None
        ‖|F| − |F_ref|‖₂ / ‖F_ref‖₂: the relative |F| error.
    phase_error : torch.Tensor, float64, or None
        Mean |Δφ| in degrees, weighted by |F_ref| (reflections without signal, whose phase is
        noise, do not dominate).
    r_factor : torch.Tensor, float64, or None
        Σ ||F| − |F_ref|| / Σ |F_ref|, no scale applied.
    correlation : torch.Tensor, float64, or None
        Pearson correlation of |F| and |F_ref|.
    fsc : torch.Tensor, float64, or None
        Fourier shell correlation Re Σ F·F_ref* / √(Σ|F|²·Σ|F_ref|²).

    The statistics against a reference are None when no reference was given. A shell without
    reflections has NaN statistics.
    """

    d_max: torch.Tensor
    d_min: torch.Tensor
    count: torch.Tensor
    mean_intensity: torch.Tensor
    rel_error: torch.Tensor | None = None
    amplitude_error: torch.Tensor | None = None
    phase_error: torch.Tensor | None = None
    r_factor: torch.Tensor | None = None
    correlation: torch.Tensor | None = None
    fsc: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.count.shape[0])

    @property
    def s_mid(self) -> torch.Tensor:
        """Centre of each shell in s = 1/d (Å⁻¹), float64: where a curve over shells is plotted."""
        return 0.5 * (1.0 / self.d_max + 1.0 / self.d_min)

    def crossing(self, level: float, column: str = "fsc") -> float | None:
        """Resolution in Å where ``column`` first falls below ``level`` (0.143 and 0.5 for an FSC).

        Going out from the lowest-resolution shell, the first shell whose value is below ``level``
        and the shell before it are interpolated linearly in s = 1/d between their centres
        (empty shells are skipped). None when no shell falls below; the first shell's centre when
        it already is below.
        """
        values = getattr(self, column)
        if values is None:
            raise ValueError(f"this table has no {column!r} column (no reference set was given)")
        v = values.detach().double().cpu().tolist()
        s = self.s_mid.detach().cpu().tolist()
        prev = None
        for vi, si in zip(v, s):
            if math.isnan(vi):
                continue
            if vi < level:
                if prev is None:
                    return 1.0 / si
                vp, sp = prev
                t = (vp - level) / (vp - vi)
                return 1.0 / (sp + t * (si - sp))
            prev = (vi, si)
        return None

    def as_dict(self) -> dict:
        """The table as plain lists of floats (JSON-ready); columns that are None are left out."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                out[field.name] = value.detach().cpu().tolist()
        return out


# Fine bins of the equal-count binning: shells are drawn along their cumulative count, so each shell
# holds its share of the set to within one fine bin (1/8192 of the s³ range).
_FINE_BINS = 8192


def shell_index(inv_d2: torch.Tensor, n_shells: int, binning: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reflection's shell and the shells' edges in s = 1/d.

    Parameters
    ----------
    inv_d2 : torch.Tensor, shape (M,), float64
        1/d² in Å⁻² (M ≥ 1).
    n_shells : int
    binning : {"count", "volume", "width"}
        See :data:`BINNINGS`. The range is the set's own, from its lowest to its highest s. ``count``
        cuts the cumulative count of 8192 fine shells of equal s³ steps, so the shells' counts are
        equal to within one fine shell, and reflections of equal d stay together.

    Returns
    -------
    (torch.Tensor (M,) int64, torch.Tensor (n_shells + 1,) float64)
        Shell of each reflection (0 = lowest resolution) and the edges, ascending in s.
    """
    if binning not in BINNINGS:
        raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
    s = inv_d2.sqrt()
    lo, hi = s.min(), s.max()
    dev = s.device
    if binning == "count":
        s3 = s * inv_d2
        lo3, span3 = lo**3, (hi**3 - lo**3).clamp_min(1e-300)
        fine = ((s3 - lo3) * (_FINE_BINS / span3)).to(torch.int64).clamp_(0, _FINE_BINS - 1)
        hist = torch.zeros(_FINE_BINS, dtype=torch.int64, device=dev).scatter_add_(0, fine, torch.ones_like(fine))
        before = torch.cumsum(hist, 0) - hist  # reflections below each fine shell
        lut = torch.clamp(before * n_shells // s.shape[0], max=n_shells - 1)  # non-decreasing
        first = torch.searchsorted(lut, torch.arange(n_shells, device=dev))
        cuts = (lo3 + first.to(torch.float64) * (span3 / _FINE_BINS)) ** (1.0 / 3.0)
        edges = torch.cat((cuts[:1].clamp_max(lo), cuts[1:], hi.reshape(1)))
        edges[0] = lo
        return lut[fine], edges
    steps = torch.arange(n_shells + 1, dtype=torch.float64, device=dev) / n_shells
    if binning == "volume":
        edges = (lo**3 + steps * (hi**3 - lo**3)) ** (1.0 / 3.0)
    else:
        edges = lo + steps * (hi - lo)
    edges[0], edges[-1] = lo, hi  # exactly the set's range, whatever the rounding of the steps
    which = torch.bucketize(s, edges[1:-1], right=True)
    return which, edges


def shells(f, reference=None, *, n_shells: int = 20, binning: str = "count") -> ShellTable:
    """Statistics of ``f`` by resolution shell, against ``reference`` when given.

    Parameters
    ----------
    f : kernels.StructureFactors
        The set to judge (M reflections).
    reference : kernels.StructureFactors, optional
        The same reflections in the same order (for example exact factors, the other backend's,
        or observed amplitudes as real F): adds the relative errors, phase error, R-factor,
        correlation and FSC columns.
    n_shells : int
        Number of shells (≥ 1).
    binning : {"count", "volume", "width"}
        Equal reflection counts (default), equal reciprocal volumes, or equal widths in 1/d.

    Returns
    -------
    ShellTable
        Tensors of shape (n_shells,) on ``f``'s device (not differentiable: statistics to look at).

    Raises
    ------
    ValueError
        ``n_shells`` not a positive int, an unknown binning, an empty set, or a reference that is
        not the same reflections.
    """
    if isinstance(n_shells, bool) or not isinstance(n_shells, int) or n_shells < 1:
        raise ValueError(f"n_shells must be a positive int, got {n_shells!r}")
    if binning not in BINNINGS:
        raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
    m = len(f)
    if m == 0:
        raise ValueError("no reflections to put in shells")
    if reference is not None:
        if len(reference) != m:
            raise ValueError(f"the reference has {len(reference)} reflections, the set {m}: they must be the same")
        if reference.hkl is not f.hkl and not torch.equal(reference.hkl.to(f.hkl.device), f.hkl):
            raise ValueError("the reference's Miller indices differ from the set's (same reflections, same order)")
    with torch.no_grad():
        return _shells(f, reference, n_shells, binning)


def _shells(f, reference, n_shells: int, binning: str) -> ShellTable:
    which, edges = shell_index(f.inv_d2, n_shells, binning)
    dev = f.f.device
    re, im = _parts(f.f)
    aa = re * re + im * im
    a = aa.sqrt()
    sums = {}

    def add(name, values):
        # scatter_add_ rather than a weighted bincount: bincount checks its indices' range on every call
        sums[name] = torch.zeros(n_shells, dtype=torch.float64, device=dev).scatter_add_(0, which, values)

    add("n", torch.ones_like(aa))

    add("aa", aa)
    if reference is not None:
        rr, ri = _parts(reference.f.to(dev))
        bb = rr * rr + ri * ri
        b = bb.sqrt()
        cross_re = re * rr + im * ri
        cross_im = im * rr - re * ri
        add("bb", bb)
        add("a", a)
        add("b", b)
        add("ab", a * b)
        add("diff2", (re - rr).square_() + (im - ri).square_())
        d = a - b
        add("amp2", d * d)
        add("amp1", d.abs_())
        add("bphase", torch.atan2(cross_im, cross_re).abs_().mul_(b))
        add("cross", cross_re)
    n = sums["n"]
    d_edges = 1.0 / edges
    table = dict(
        d_max=d_edges[:-1],
        d_min=d_edges[1:],
        count=n.round().to(torch.int64),
        mean_intensity=sums["aa"] / n,
    )
    if reference is not None:
        cov = n * sums["ab"] - sums["a"] * sums["b"]
        var_a = n * sums["aa"] - sums["a"] ** 2
        var_b = n * sums["bb"] - sums["b"] ** 2
        table.update(
            rel_error=(sums["diff2"] / sums["bb"]).sqrt(),
            amplitude_error=(sums["amp2"] / sums["bb"]).sqrt(),
            phase_error=torch.rad2deg(sums["bphase"] / sums["b"]),
            r_factor=sums["amp1"] / sums["b"],
            correlation=cov / (var_a * var_b).sqrt(),
            fsc=sums["cross"] / (sums["aa"] * sums["bb"]).sqrt(),
        )
    return ShellTable(**table)


def fsc(
    rho1: torch.Tensor,
    rho2: torch.Tensor,
    grid,
    *,
    d_min: float | None = None,
    n_shells: int | None = None,
    binning: str = "width",
    backend: str = "auto",
) -> ShellTable:
    """Fourier shell correlation of two maps on one grid (the cryo-EM convention).

    FSC(shell) = Re Σ F₁·F₂* / √(Σ|F₁|²·Σ|F₂|²) over the shell's Fourier coefficients, F(000)
    left out. Friedel mates carry the same sums, so one hemisphere (the P 1 set) gives the same
    ratios as the whole sphere. Read its resolution with ``table.crossing(0.143)`` (two
    independent half-maps) or ``table.crossing(0.5)`` (a map against a model's map).

    Parameters
    ----------
    rho1, rho2 : torch.Tensor, shape grid.shape, real
        Two maps on the same device.
    grid : kernels.GridSpec
        Whole-cell grid of both.
    d_min : float, optional
        Highest resolution in Å; default the finest the grid holds (about twice its spacing).
    n_shells : int, optional
        Default: shells one reciprocal-lattice step thick along the cell's longest axis (for
        ``width``), so each is one Fourier voxel, as in cryo-EM; 20 for the other binnings.
    binning : {"width", "volume", "count"}
    backend : {"auto", "fft", "reference"}
        Of :func:`kernels.structure_factors`.

    Returns
    -------
    ShellTable
        With every reference column (``fsc`` among them), rho2 as the reference.
    """
    from kernels.reciprocal.factors import structure_factors
    from kernels.reciprocal.miller import finest_d_min

    if rho1.shape != rho2.shape:
        raise ValueError(f"the maps differ in shape: {tuple(rho1.shape)} and {tuple(rho2.shape)}")
    if d_min is None:
        d_min = finest_d_min(grid)
    f1 = structure_factors(rho1, grid, d_min, backend=backend)
    f2 = structure_factors(rho2, grid, d_min, backend=backend)
    if n_shells is None:
        if binning == "width":
            n_shells = max(4, int((1.0 / d_min) / max(grid.cell.reciprocal_lengths)))
        else:
            n_shells = 20
    return shells(f1, f2, n_shells=n_shells, binning=binning)
