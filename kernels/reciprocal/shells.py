"""Statistics by resolution shell: errors against a reference set, R-factor, correlation and FSC.

Every statistic is a ratio of sums over the reflections of a shell. A set's binning is made once and
kept (:class:`_ShellPlan`: the reflections in shell order, each shell's bounds, each reflection's shell).
On the CPU a call walks the set block by block, on torch's number of threads, computes the
per-reflection values in float64 and adds them to their shell's sums (C++ without the GIL), then takes
the ratios per shell. On a GPU one Triton launch (:func:`kernels.reciprocal.triton.shell_statistics`)
does all of it, one program per shell, with no atomics. On a GPU nothing here reads a value back to the
host except :meth:`ShellTable.crossing` and :meth:`ShellTable.as_dict`, so a table costs no
synchronisation until it is looked at.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import warnings
import weakref

import numpy as np
import torch

__all__ = ["BINNINGS", "ShellTable", "shells", "fsc", "shell_index"]

#: ``count``: equal numbers of reflections; ``volume``: equal volumes of reciprocal space (equal steps of
#: s³, s = 1/d); ``width``: equal steps of s (one Fourier voxel thick shells, the cryo-EM FSC convention).
BINNINGS = ("count", "volume", "width")


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

    def counts(self, which, n):
        # scatter_add_ rather than bincount: bincount checks its indices' range (a host sync on a GPU)
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


# Binning plans of recent sets. A set from structure_factors is keyed by its index set's value key (grid,
# space group, d_min), so every call on one grid shares one plan; any other set by the identity of its
# Miller-index tensor (checked through a weak reference).
_MAX_PLANS = 16
_PLANS: dict = {}


@dataclasses.dataclass(frozen=True)
class _ShellPlan:
    """A set's binning, made once: the reflections in shell order, and where the shells start.

    ``order`` (M,) int64 sorts the set by shell (stable). On a GPU ``bounds`` (S + 1,) int64 gives shell
    i as ``order[bounds[i]:bounds[i + 1]]``. On the CPU ``which`` (M,) int64 is each reflection's shell in
    the set's order and ``which_sorted`` the same in shell order (``which[order]``): the sums walk the set
    as it lies, block by block, adding each reflection to its shell's sums.
    """

    order: object
    count: torch.Tensor
    edges: torch.Tensor
    bounds: torch.Tensor | None = None
    which: np.ndarray | None = None
    which_sorted: np.ndarray | None = None


# Reflections per block on the CPU: a block's dozen float64 temporaries in numpy (128 kB each) stay in cache,
# and a torch op on a block (below torch's grain size, 32768 elements) runs on the calling thread.
_BLOCK = 1 << 14


def _plan(f, n_shells: int, binning: str) -> _ShellPlan:
    """The kept binning of set ``f`` (made on the first call for its index set or Miller-index tensor)."""
    device = f.f.device
    if f._set_key is not None:
        key, alive = (f._set_key, n_shells, binning, str(device)), None
    else:
        key, alive = (id(f.hkl), n_shells, binning, str(device)), weakref.ref(f.hkl)
    got = _PLANS.get(key)
    if got is not None and (got[0] is None or got[0]() is f.hkl):
        return got[1]
    plan = _make_plan(f.inv_d2.to(device), n_shells, binning)
    _keep(key, (alive, plan))
    return plan


def _keep(key, value) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = value


def _make_plan(inv_d2: torch.Tensor, n_shells: int, binning: str) -> _ShellPlan:
    """Bin reflections of 1/d² ``inv_d2`` (M,) float64: numpy on the CPU, torch (no host sync) elsewhere."""
    device = inv_d2.device
    xp = _ops(inv_d2)
    which, edges = _shell_index(xp, _host(inv_d2), n_shells, binning)
    if xp is _NumpyOps:
        which = which.astype(np.int64, copy=False)
        order = np.argsort(which, kind="stable")
        count = np.bincount(which, minlength=n_shells)
        return _ShellPlan(order, _tensor(count, device), _tensor(edges, device), which=which, which_sorted=which[order])
    order = torch.sort(which, stable=True).indices
    count = xp.counts(which, n_shells)
    bounds = torch.cat((count.new_zeros(1), torch.cumsum(count, 0)))
    return _ShellPlan(order, count, edges, bounds=bounds)


def _parts(f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Real and imaginary parts, float64 (real input: amplitudes, phase 0)."""
    if not np.iscomplexobj(f):
        return f.astype(np.float64), np.zeros(f.shape)
    return f.real.astype(np.float64), f.imag.astype(np.float64)


# The rows summed per shell against a reference, in this order.
_ROWS = ("aa", "bb", "a", "b", "ab", "diff2", "amp2", "amp1", "bphase", "cross")


def _fill_rows(f: np.ndarray, reference: np.ndarray, rows: np.ndarray) -> None:
    """Write the per-reflection values of :data:`_ROWS` for the reflections ``f`` (B,) against ``reference`` (B,)
    into ``rows`` (10, B) float64: each row's last op writes it in place, so a block makes few temporaries."""
    aa, bb, a, b, ab, diff2, amp2, amp1, bphase, cross = rows
    re, im = _parts(f)
    rr, ri = _parts(reference)
    np.multiply(re, re, out=aa)
    aa += im * im
    np.multiply(rr, rr, out=bb)
    bb += ri * ri
    np.sqrt(aa, out=a)
    np.sqrt(bb, out=b)
    np.multiply(a, b, out=ab)
    np.multiply(re, rr, out=cross)
    cross += im * ri
    cross_im = im * rr
    cross_im -= re * ri
    d = a - b
    np.multiply(d, d, out=amp2)
    np.abs(d, out=amp1)
    # torch's vectorised atan2 (numpy's is scalar, 3x slower); a block of ≤ 32768 values (_BLOCK, torch's grain
    # size) runs on this thread, not the intra-op pool
    dphi = torch.atan2(torch.from_numpy(cross_im), torch.from_numpy(cross)).abs_().numpy()
    np.multiply(dphi, b, out=bphase)
    re -= rr
    im -= ri
    np.multiply(re, re, out=diff2)
    diff2 += im * im


def _sums_cpu(g: np.ndarray, r, plan: _ShellPlan, n_shells: int, ordered: bool) -> np.ndarray:
    """(K, n_shells) float64 sums of the set ``g`` (M,) against ``r`` (M,); ``ordered``: both are in shell order
    (else in the set's order). K is 1 (⟨|F|²⟩'s sum) without a reference, else len(_ROWS).

    Against a reference the set is walked as it lies, in blocks of :data:`_BLOCK` reflections shared out among
    ``torch.get_num_threads()`` threads (this one and pool workers, each taking the next block when it is
    free, so a thread slowed by other work takes fewer). A block adds each reflection's values to its shell's
    sums in position order (C++, ``kernels.reciprocal._shells``, without the GIL; numpy where it is not
    built), into a row of its own; the rows are added in block order: the same bits at any thread count.
    """
    which = plan.which_sorted if ordered else plan.which
    if r is None:
        # one value per reflection: a weighted count
        re, im = _parts(g)
        return np.bincount(which, re * re + im * im, minlength=n_shells)[None]
    m = len(which)
    n_blocks = -(-m // _BLOCK)
    partial = np.zeros((n_blocks, len(_ROWS), n_shells))
    next_block = itertools.count()
    ext = _extension()
    if ext is not None:
        (gv, gc), (rv, rc) = _flat(g), _flat(r)

    def work() -> None:
        buffer = None if ext is not None else np.empty((len(_ROWS), _BLOCK))
        for i in iter(next_block.__next__, None):  # count() is consumed atomically under the GIL
            if i >= n_blocks:
                return
            lo, hi = i * _BLOCK, min(m, (i + 1) * _BLOCK)
            if ext is not None:  # the whole block in C++, without the GIL
                ext.block_sums(gv, gc, rv, rc, which, lo, hi, partial[i])
                continue
            rows = buffer[:, : hi - lo]
            _fill_rows(g[lo:hi], r[lo:hi], rows)
            for c in range(len(_ROWS)):  # bincount adds in position order, as the C++ does
                partial[i][c] = np.bincount(which[lo:hi], rows[c], minlength=n_shells)

    helpers = [] if n_blocks < 2 else _POOL.submit_many(work, min(torch.get_num_threads(), n_blocks) - 1)
    try:
        work()
    finally:
        for done in helpers:
            done.result()
    return partial.sum(axis=0)


def _flat(a: np.ndarray) -> tuple[np.ndarray, int]:
    """``a`` (M,) as the C++ sums read it: a complex array's (re, im) pairs as a float view of 2M values, or
    real amplitudes as they are (float32 or float64, C order); and the values per reflection."""
    if np.iscomplexobj(a):
        return np.ascontiguousarray(a).view(a.real.dtype), 2
    return np.ascontiguousarray(a, dtype=a.dtype if a.dtype in (np.float32, np.float64) else np.float64), 1


@functools.cache
def _extension():
    """The C++ sums (``kernels.reciprocal._shells``), or None with one RuntimeWarning when it is not built
    (numpy then computes the same sums, several times slower)."""
    try:
        from kernels.reciprocal import _shells
    except ImportError as exc:
        warnings.warn(
            f"kernels.reciprocal._shells is not built ({exc}); shells and fsc on the CPU run in numpy, "
            "several times slower. Build it with `pip install -e .` or `bash scripts/build.sh`.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return _shells


class _HelperPool:
    """Worker threads for the CPU sums (a block's C++ sums release the GIL, as do numpy's calls where it is not built),
    grown on demand.

    A process forked after the threads started has none of them: the pool is made anew there (by pid).
    """

    def __init__(self):
        self._executor, self._size, self._pid = None, 0, os.getpid()

    def submit_many(self, fn, n: int) -> list:
        if n <= 0:
            return []
        if n > self._size or self._pid != os.getpid():
            if self._executor is not None and self._pid == os.getpid():
                self._executor.shutdown(wait=False)
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="kernels-shells")
            self._size, self._pid = n, os.getpid()
        return [self._executor.submit(fn) for _ in range(n)]


_POOL = _HelperPool()


def _shells(f, reference, n_shells: int, binning: str) -> ShellTable:
    plan = _plan(f, n_shells, binning)
    ref = None if reference is None else reference.f.to(f.f.device)
    if f.f.device.type == "cpu":
        summed = _sums_cpu(_host(f.f), None if ref is None else _host(ref), plan, n_shells, ordered=False)
        return _table(plan, summed, reference is not None)
    from kernels.reciprocal.triton import shell_statistics

    return _device_table(plan, shell_statistics(f.f, ref, plan.order, plan.bounds))


#: The columns of a :class:`ShellTable` after d_max, d_min and count, in the order the GPU kernel writes its
#: rows (:func:`kernels.reciprocal.triton.shell_statistics`); the first alone when there is no reference.
STAT_COLUMNS = ("mean_intensity", "rel_error", "amplitude_error", "phase_error", "r_factor", "correlation", "fsc")


def _shell_table(plan: _ShellPlan, columns: dict, scale: float = 1.0) -> ShellTable:
    """The table of ``plan``'s shells with ``columns`` (:data:`STAT_COLUMNS`, ⟨|F|²⟩ unscaled), ``scale`` the
    factors' common scale (⟨|F|²⟩ by scale²)."""
    d_edges = 1.0 / plan.edges
    if scale != 1.0:
        columns["mean_intensity"] = columns["mean_intensity"] * (scale * scale)
    return ShellTable(d_max=d_edges[:-1], d_min=d_edges[1:], count=plan.count, **columns)


def _device_table(plan: _ShellPlan, stats: torch.Tensor, scale: float = 1.0) -> ShellTable:
    """The table from :func:`kernels.reciprocal.triton.shell_statistics`' rows (:data:`STAT_COLUMNS`)."""
    return _shell_table(plan, dict(zip(STAT_COLUMNS, stats.unbind(0))), scale)


def _table(plan: _ShellPlan, summed, with_reference: bool, scale: float = 1.0) -> ShellTable:
    """The table from the CPU's sums (rows of :data:`_ROWS`), ``scale`` the factors' common scale."""
    sums = dict(zip(_ROWS, _tensor(summed, plan.count.device)))
    n = plan.count.to(torch.float64)
    columns = {"mean_intensity": sums["aa"] / n}
    if with_reference:
        cov = n * sums["ab"] - sums["a"] * sums["b"]
        var_a = n * sums["aa"] - sums["a"] ** 2
        var_b = n * sums["bb"] - sums["b"] ** 2
        columns.update(
            rel_error=(sums["diff2"] / sums["bb"]).sqrt(),
            amplitude_error=(sums["amp2"] / sums["bb"]).sqrt(),
            phase_error=torch.rad2deg(sums["bphase"] / sums["b"]),
            r_factor=sums["amp1"] / sums["b"],
            correlation=cov / (var_a * var_b).sqrt(),
            fsc=sums["cross"] / (sums["aa"] * sums["bb"]).sqrt(),
        )
    return _shell_table(plan, columns, scale)


def _fsc_plan(grid, d_min: float, n_shells: int, binning: str, device: torch.device):
    """The binning of the P 1 set to ``d_min`` and each reflection's place in the half-space transform, both in
    shell order (kept by value: grid, d_min, shells, device)."""
    from kernels.reciprocal.miller import miller_set

    millers = miller_set(grid, "P 1", d_min)
    key = ("fsc", millers.key, n_shells, binning, str(device))
    got = _PLANS.get(key)
    if got is not None:
        return got[1]
    t = millers.on(device)
    plan = _make_plan(t["inv_d2"], n_shells, binning)
    nx, ny, nz = grid.shape
    half = t["half"]
    flat = (torch.remainder(half[:, 0], nx) * ny + torch.remainder(half[:, 1], ny)) * (nz // 2 + 1) + half[:, 2]
    order = plan.order if isinstance(plan.order, torch.Tensor) else torch.from_numpy(plan.order)
    got = (plan, flat.index_select(0, order))
    _keep(key, (None, got))
    return got


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
    from kernels._util import positive_number
    from kernels.crystal import GridError
    from kernels.reciprocal.factors import SF_BACKENDS, structure_factors
    from kernels.reciprocal.miller import finest_d_min, miller_set

    if rho1.shape != rho2.shape:
        raise ValueError(f"the maps differ in shape: {tuple(rho1.shape)} and {tuple(rho2.shape)}")
    if d_min is None:
        d_min = finest_d_min(grid)
    if n_shells is None:
        if binning == "width":
            n_shells = max(4, int((1.0 / d_min) / max(grid.cell.reciprocal_lengths)))
        else:
            n_shells = 20
    if backend == "reference":
        f1 = structure_factors(rho1, grid, d_min, backend=backend)
        f2 = structure_factors(rho2, grid, d_min, backend=backend)
        return shells(f1, f2, n_shells=n_shells, binning=binning)
    # the fast path: each map's half-space transform read straight in shell order. The statistics are those of
    # the structure factors: F is V/N times R or its conjugate, the same for both maps, so every ratio is R's
    # and only ⟨|F|²⟩ takes the scale.
    # structure_factors' refusals, each with its message: bad arguments, a box grid, d_min beyond the grid
    d_min = positive_number(d_min, "d_min", "Å")
    if backend not in SF_BACKENDS:
        raise ValueError(f"backend must be one of {SF_BACKENDS}, got {backend!r}")
    for rho in (rho1, rho2):
        if not isinstance(rho, torch.Tensor) or not rho.is_floating_point():
            raise ValueError(f"maps must be real floating-point torch tensors, got {getattr(rho, 'dtype', type(rho))}")
    if tuple(rho1.shape) != grid.shape:
        raise GridError(f"map shape {tuple(rho1.shape)} does not match the grid {grid.shape}")
    miller_set(grid, "P 1", d_min)
    rho2 = rho2.to(rho1.device)
    if rho1.dtype in (torch.float16, torch.bfloat16):
        rho1, rho2 = rho1.float(), rho2.float()
    plan, flat = _fsc_plan(grid, float(d_min), n_shells, binning, rho1.device)
    with torch.no_grad():
        g1 = torch.fft.rfftn(rho1.detach()).reshape(-1)
        g2 = torch.fft.rfftn(rho2.detach()).reshape(-1)
        if rho1.device.type == "cpu":
            summed = _sums_cpu(
                g1.index_select(0, flat).numpy(), g2.index_select(0, flat).numpy(), plan, n_shells, ordered=True
            )
            return _table(plan, summed, True, scale=grid.voxel_volume)
        from kernels.reciprocal.triton import shell_statistics

        # the kernel gathers both half-space transforms through the flat indices (in shell order)
        return _device_table(plan, shell_statistics(g1, g2, flat, plan.bounds), scale=grid.voxel_volume)
