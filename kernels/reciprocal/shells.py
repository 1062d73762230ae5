"""Statistics by resolution shell: errors against a reference set, R-factor, correlation and FSC.

Every statistic is a ratio of sums over the reflections of a shell, so one pass gathers the sums
of all of them (float64: numpy's ``bincount`` on the CPU, a ``scatter_add_`` per sum on a GPU) and
the ratios are taken per shell. On a GPU nothing here reads a value back to the host except
:meth:`ShellTable.crossing` and :meth:`ShellTable.as_dict`, so a table costs no synchronisation until
it is looked at.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import numpy as np
import torch

__all__ = ["BINNINGS", "ShellTable", "shells", "fsc", "shell_index"]

#: ``count``: equal numbers of reflections; ``volume``: equal volumes of reciprocal space (equal steps of
#: s³, s = 1/d); ``width``: equal steps of s (one Fourier voxel thick shells, the cryo-EM FSC convention).
BINNINGS = ("count", "volume", "width")


def _parts(f: torch.Tensor, xp):
    """Real and imaginary parts of complex (or real: amplitudes with phase 0) factors, as float64 copies."""
    if not f.is_complex():
        re = xp.float64(_host(f))
        return re, re * 0
    if xp is _NumpyOps:
        g = _host(f)
        return g.real.astype(np.float64), g.imag.astype(np.float64)
    return f.real.to(torch.float64, copy=True), f.imag.to(torch.float64, copy=True)


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
# holds its share of the set to within one fine bin (1/8192 of the s² range).
_FINE_BINS = 8192


class _NumpyOps:
    """Array operations on the host. CPU tables are computed in numpy, on the calling thread: an elementwise op
    on 10⁵–10⁶ values takes torch's thread pool longer to start and join than to do, and far longer when the
    pool's threads are busy elsewhere."""

    sqrt, abs, arctan2, cumsum, arange = np.sqrt, np.abs, np.arctan2, np.cumsum, np.arange

    @staticmethod
    def sums(which, weights, n):
        return np.bincount(which, weights, minlength=n)

    @staticmethod
    def counts(which, n):
        return np.bincount(which, minlength=n)

    @staticmethod
    def right_of(edges, values):  # index i with edges[i-1] ≤ v < edges[i]
        return np.searchsorted(edges, values, side="right")

    @staticmethod
    def to_index(x, top):
        return np.clip(x.astype(np.int64), 0, top)

    @staticmethod
    def float64(x):
        return x.astype(np.float64)

    @staticmethod
    def at_least(x, floor):
        return max(x, floor)


class _TorchOps:
    """The same operations in torch, on the tensors' device (no host synchronisation)."""

    sqrt, abs, arctan2, cumsum = torch.sqrt, torch.abs, torch.atan2, torch.cumsum

    def __init__(self, device):
        self.device = device

    def arange(self, n):
        return torch.arange(n, device=self.device)

    def sums(self, which, weights, n):
        # scatter_add_ rather than bincount: bincount checks its indices' range (a host sync on a GPU)
        return torch.zeros(n, dtype=weights.dtype, device=self.device).scatter_add_(0, which, weights)

    def counts(self, which, n):
        return torch.zeros(n, dtype=torch.int64, device=self.device).scatter_add_(0, which, torch.ones_like(which))

    @staticmethod
    def right_of(edges, values):
        return torch.searchsorted(edges, values, right=True)

    @staticmethod
    def to_index(x, top):
        return x.to(torch.int64).clamp_(0, top)

    @staticmethod
    def float64(x):
        return x.to(torch.float64, copy=True)  # a copy even of float64: callers write into it

    @staticmethod
    def at_least(x, floor):
        return x.clamp_min(floor)


def _ops(t: torch.Tensor):
    return _NumpyOps if t.device.type == "cpu" else _TorchOps(t.device)


def _host(t: torch.Tensor):
    """A CPU tensor as a numpy array (a view), other devices' as they are."""
    return t.detach().resolve_conj().numpy() if t.device.type == "cpu" else t.detach()


def _tensor(x, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def shell_index(inv_d2: torch.Tensor, n_shells: int, binning: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reflection's shell and the shells' edges in s = 1/d.

    Parameters
    ----------
    inv_d2 : torch.Tensor, shape (M,), float64
        1/d² in Å⁻² (M ≥ 1).
    n_shells : int
    binning : {"count", "volume", "width"}
        See :data:`BINNINGS`. The range is the set's own, from its lowest to its highest s. ``count``
        cuts the cumulative count of 8192 fine shells of equal s² steps, so the shells' counts are
        equal to within one fine shell, and reflections of equal d stay together.

    Returns
    -------
    (torch.Tensor (M,) int64, torch.Tensor (n_shells + 1,) float64)
        Shell of each reflection (0 = lowest resolution) and the edges, ascending in s, on ``inv_d2``'s device.
    """
    which, edges = _shell_index(_ops(inv_d2), _host(inv_d2), n_shells, binning)
    return _tensor(which, inv_d2.device), _tensor(edges, inv_d2.device)


def _shell_index(xp, inv_d2, n_shells: int, binning: str):
    if binning not in BINNINGS:
        raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
    lo2, hi2 = inv_d2.min(), inv_d2.max()
    lo, hi = xp.sqrt(lo2), xp.sqrt(hi2)
    if binning == "count":
        span2 = xp.at_least(hi2 - lo2, 1e-300)  # one d in the whole set: every reflection in fine shell 0
        fine = xp.to_index((inv_d2 - lo2) * (_FINE_BINS / span2), _FINE_BINS - 1)
        hist = xp.counts(fine, _FINE_BINS)
        before = xp.cumsum(hist, 0) - hist  # reflections below each fine shell
        lut = (before * n_shells) // inv_d2.shape[0]  # non-decreasing, < n_shells
        first = xp.right_of(lut, xp.arange(n_shells) - 1)  # first fine shell of each shell (≥ that index)
        edges = xp.sqrt(lo2 + xp.float64(first) * (span2 / _FINE_BINS))
        edges = _append(edges, hi)
        edges[0] = lo
        return lut[fine], edges
    steps = xp.float64(xp.arange(n_shells + 1)) / n_shells
    edges = (lo**3 + steps * (hi**3 - lo**3)) ** (1.0 / 3.0) if binning == "volume" else lo + steps * (hi - lo)
    edges[0], edges[-1] = lo, hi  # exactly the set's range, whatever the rounding of the steps
    which = xp.right_of(edges[1:-1], xp.sqrt(inv_d2))
    return which, edges


def _append(edges, value):
    if isinstance(edges, np.ndarray):
        return np.append(edges, value)
    return torch.cat((edges, value.reshape(1)))


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


# Shell indices of recent sets, by the identity of their Miller-index tensor: a set from
# structure_factors shares its index tensor with every other call on the same grid and d_min, so the
# binning of a repeated comparison (the workbench's, a benchmark's) is made once.
_INDEX_CACHE: dict = {}


def _cached_shell_index(xp, f, n_shells: int, binning: str):
    key = (id(f.hkl), n_shells, binning, str(f.f.device))
    got = _INDEX_CACHE.get(key)
    if got is not None and got[0]() is f.hkl:
        return got[1], got[2]
    which, edges = _shell_index(xp, _host(f.inv_d2.to(f.f.device)), n_shells, binning)
    if len(_INDEX_CACHE) >= 16:
        _INDEX_CACHE.clear()
    _INDEX_CACHE[key] = (weakref.ref(f.hkl), which, edges)
    return which, edges


def _shells(f, reference, n_shells: int, binning: str) -> ShellTable:
    xp = _ops(f.f)
    dev = f.f.device
    which, edges = _cached_shell_index(xp, f, n_shells, binning)
    re, im = _parts(f.f, xp)
    aa = re * re + im * im
    sums = {"n": xp.float64(xp.counts(which, n_shells)), "aa": xp.sums(which, aa, n_shells)}
    if reference is not None:
        rr, ri = _parts(reference.f.to(dev), xp)
        a = xp.sqrt(aa)
        bb = rr * rr + ri * ri
        b = xp.sqrt(bb)
        cross_re = re * rr + im * ri
        cross_im = im * rr - re * ri
        re -= rr
        im -= ri
        diff2 = re * re + im * im
        d = a - b
        for name, values in (
            ("bb", bb),
            ("a", a),
            ("b", b),
            ("ab", a * b),
            ("diff2", diff2),
            ("amp2", d * d),
            ("amp1", xp.abs(d)),
            ("bphase", xp.abs(xp.arctan2(cross_im, cross_re)) * b),
            ("cross", cross_re),
        ):
            sums[name] = xp.sums(which, values, n_shells)
    sums = {k: _tensor(v, dev) for k, v in sums.items()}
    edges = _tensor(edges, dev)
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
