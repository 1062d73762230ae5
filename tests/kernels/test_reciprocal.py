"""Structure factors from maps, shell statistics and FSC: direct sums, gemmi's exact factors, gradients, errors."""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np
import pytest
import torch

import kernels
import kernels.testing
from kernels import GridError, GridSpec, StructureFactors, fsc, shells, structure_factors
from kernels.reciprocal.miller import finest_d_min
from kernels.reciprocal.shells import shell_index
from tests.helpers import assert_close, model, requires_cuda

BACKENDS = ("fft", "reference")


def as_real(f: torch.Tensor) -> torch.Tensor:
    """Complex values as (…, 2) real pairs, for the verbose comparison helper."""
    return torch.view_as_real(f.detach().to(torch.complex128).cpu())


def direct_sum(rho: torch.Tensor, grid: GridSpec, hkl: torch.Tensor) -> torch.Tensor:
    """F(h) = V/N · Σ_x ρ(x)·exp(2πi h·x), summed voxel by voxel in float64 (small grids only)."""
    frac = grid.voxel_fractional().reshape(-1, 3)
    phase = 2 * math.pi * (hkl.to(torch.float64) @ frac.T)  # (M, N)
    values = rho.detach().to(torch.float64).reshape(-1)
    return torch.complex(torch.cos(phase) @ values, torch.sin(phase) @ values) * grid.voxel_volume


def random_map(shape, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


TRICLINIC = kernels.Cell.from_parameters(11.3, 13.7, 9.1, 79.0, 101.0, 94.0)
MONOCLINIC = kernels.Cell.from_parameters(17.0, 9.5, 12.25, 90.0, 104.5, 90.0)


# --------------------------------------------------------------------------- the transform itself


@pytest.mark.parametrize("shape", [(7, 11, 13), (8, 10, 12), (9, 9, 16), (5, 17, 6)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_the_direct_sum_on_odd_even_and_prime_grids(shape, backend):
    grid = GridSpec(TRICLINIC, shape)
    rho = random_map(shape, seed=sum(shape))
    d_min = finest_d_min(grid)
    f = structure_factors(rho, grid, d_min, backend=backend)
    assert f.f.dtype == torch.complex128 and len(f) > 10
    want = direct_sum(rho, grid, f.hkl)
    # float64 transforms of ~10³ voxels: rounding of the sums, 1e-12 of the largest factor
    assert_close(as_real(f.f), as_real(want), atol=1e-12 * float(want.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_map_within_float32_rounding_of_float64(backend):
    grid = GridSpec(MONOCLINIC, (24, 15, 18))
    rho = random_map(grid.shape, seed=3)
    want = structure_factors(rho, grid, 2.0, backend="reference")
    got = structure_factors(rho.float(), grid, 2.0, backend=backend)
    assert got.f.dtype == (torch.complex128 if backend == "reference" else torch.complex64)
    # float32 rounding of each voxel (6e-8) and of the float32 FFT's log₂N stages bound the error by a few
    # 1e-7 of V/N·Σ|ρ| (F(000)'s size, which a random map's other factors are far below); measured 2.6e-7
    bound = grid.voxel_volume * float(rho.abs().sum())
    assert_close(as_real(got.f), as_real(want.f), atol=1e-6 * bound)


def test_unique_set_is_gemmis_without_absences_or_f000():
    import gemmi

    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, 0.8, m.spacegroup)
    rho = random_map(grid.shape, dtype=torch.float32)
    for sg in (None, m.spacegroup):
        f = structure_factors(rho, grid, 2.5, spacegroup=sg)
        group = gemmi.SpaceGroup(sg or "P 1")
        want = gemmi.make_miller_array(m.cell.to_gemmi(), group, 2.5, 0.0, True)
        want = want[np.any(want != 0, axis=1)]
        assert np.array_equal(f.hkl.numpy(), want)
        assert not any(group.operations().is_systematically_absent(h) for h in f.hkl.tolist())
        d = f.d.numpy()
        assert d.min() >= 2.5 and np.allclose(d, [m.cell.to_gemmi().calculate_d(h) for h in f.hkl.tolist()])
    p1 = structure_factors(rho, grid, 2.5)
    # a hemisphere: no reflection's Friedel mate is in the set
    keys = {tuple(h) for h in p1.hkl.tolist()}
    assert not any((-h, -k, -ell) in keys for h, k, ell in keys)


def test_negative_l_reflections_use_friedels_law():
    """Space groups whose unique set has l < 0 (P -3's ASU) take F(h) = conj(F(−h)): check against the direct sum."""
    cell = kernels.Cell.from_parameters(10.0, 10.0, 14.0, 90, 90, 120)
    grid = GridSpec.for_spacing(cell, 0.9, "P -3")
    rho = kernels.symmetrize(random_map(grid.shape, seed=5), grid, "P -3")
    f = structure_factors(rho, grid, 2.2, spacegroup="P -3")
    assert (f.hkl[:, 2] < 0).any() or (f.hkl[:, 0] < 0).any()
    want = direct_sum(rho, grid, f.hkl)
    assert_close(as_real(f.f), as_real(want), atol=1e-11 * float(want.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_blur_is_divided_out(backend):
    grid = GridSpec(MONOCLINIC, (24, 15, 18))
    rho = random_map(grid.shape, seed=4)
    plain = structure_factors(rho, grid, 2.5, backend=backend)
    for b in (25.0, -8.0):
        unblurred = structure_factors(rho, grid, 2.5, blur=b, backend=backend)
        ratio = unblurred.f / plain.f
        want = torch.exp(plain.inv_d2 * b / 4)
        assert_close(ratio.real, want, atol=0, rtol=1e-12)
        assert_close(ratio.imag, torch.zeros_like(want), atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend):
    grid = GridSpec(TRICLINIC, (4, 5, 7))
    rho = random_map(grid.shape, seed=6).requires_grad_()

    def fn(r):
        return structure_factors(r, grid, finest_d_min(grid), blur=3.0, backend=backend).f

    assert torch.autograd.gradcheck(fn, (rho,), fast_mode=True)


def test_gradient_of_a_loss_through_a_splat():
    """A loss on F reaches the atoms: the gradient of Σ|F|² by the density kernel's own chain."""
    m = model("1orc")
    atoms = m.atoms.to(dtype=torch.float64)
    xyz = atoms.xyz[:20].clone().requires_grad_()
    grid = GridSpec.for_spacing(m.cell, 1.0)
    sub = kernels.AtomSet(xyz, atoms.b_iso[:20], atoms.occ[:20], atoms.a[:20], atoms.b[:20])

    def loss(x):
        rho = kernels.splat_density(sub.replace(xyz=x), grid, backend="reference")
        return structure_factors(rho, grid, 3.0).f.real.sum()

    (g,) = torch.autograd.grad(loss(xyz), xyz)
    step = torch.zeros_like(xyz)
    step[3, 1] = 1e-4
    with torch.no_grad():
        numeric = (loss(xyz + step) - loss(xyz - step)) / 2e-4
    assert abs(float(g[3, 1]) - float(numeric)) <= 1e-5 * max(1.0, abs(float(numeric)))


# --------------------------------------------------------------------------- against gemmi's exact factors


@functools.cache
def exact_and_fft(name: str, symmetric: bool, spacing: float = 2 / 3, blur: float | str = "sampling", **splat):
    """The fast path's factors to 2 Å (CPU float32 splat, ``fft`` backend) and gemmi's exact ones."""
    m = model(name)
    grid = GridSpec.for_spacing(m.cell, spacing, m.spacegroup)
    if blur == "sampling":
        blur = kernels.sampling_blur(m.atoms, grid)
    rho = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, blur=blur, backend="cpu", **splat)
    sg = None
    if symmetric:
        rho, sg = kernels.symmetrize(rho, grid, m.spacegroup), m.spacegroup
    f = structure_factors(rho, grid, 2.0, spacegroup=sg, blur=blur)
    exact = kernels.testing.gemmi_structure_factors(m, f.hkl.numpy(), symmetry=symmetric)
    return f, f.replace(f=torch.from_numpy(exact))


CASES = [("1orc", False), ("1orc", True), ("1pfe", False), ("1pfe", True), ("1aki", False), ("3o5r", False)]


@pytest.mark.parametrize("name,symmetric", CASES)
def test_every_shell_to_2A_within_1e_3_of_gemmis_exact_factors(name, symmetric):
    """Default settings: a 0.667 Å grid, cutoff 1e-5, the sampling blur splatted and divided out, float32 on the
    CPU. 1PFE and 3O5R carry U (ANISOU); 1PFE's is P 6₃22 (hexagonal), symmetrised here."""
    f, exact = exact_and_fft(name, symmetric)
    table = shells(f, exact, n_shells=20)
    assert int(table.count.sum()) == len(f)
    assert (table.rel_error < 1e-3).all(), table.rel_error
    assert (table.phase_error < 0.05).all(), table.phase_error  # degrees


def test_triton_map_gives_gemmis_factors():
    """The Triton splat's map (the interpreter on CPU tensors in CI, CUDA in the GPU tier) through the FFT path:
    1ORC on a 1 Å grid to 3 Å with the sampling blur; measured 1.6e-4 in the worst shell."""
    m = model("1orc")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grid = GridSpec.for_spacing(m.cell, 1.0)
    blur = kernels.sampling_blur(m.atoms, grid)
    rho = kernels.splat_density(m.atoms.to(device, torch.float32), grid, blur=blur, backend="triton")
    f = structure_factors(rho, grid, 3.0, blur=blur)
    assert f.f.device.type == device
    exact = kernels.testing.gemmi_structure_factors(m, f.hkl.cpu().numpy())
    table = shells(f, f.replace(f=torch.from_numpy(exact).to(device)), n_shells=5)
    assert (table.rel_error.cpu() < 1e-3).all(), table.rel_error


@pytest.mark.parametrize("name", ["1orc", "1aki"])
def test_without_blur_aliasing_grows_towards_d_min_but_stays_below_1e_2(name):
    """Atoms of B ≥ 8 Å² on a 0.667 Å grid without blur: the error is sampling's (aliasing), largest at 2 Å."""
    f, exact = exact_and_fft(name, False, blur=0.0)
    table = shells(f, exact, n_shells=10)
    assert (table.rel_error < 1e-2).all(), table.rel_error
    assert table.rel_error[-1] > 10 * table.rel_error[0]


def test_without_blur_sharp_anisotropic_atoms_alias():
    """3O5R's sharpest U (8π²·λ_min = 1.5 Å²) on a 0.667 Å grid: unblurred, the 2 Å shell is off by several %."""
    f, exact = exact_and_fft("3o5r", False, blur=0.0)
    assert float(shells(f, exact, n_shells=10).rel_error[-1]) > 3e-2


@pytest.mark.parametrize("name", ["1aki", "1pfe", "3o5r"])
def test_sampling_blur_is_gemmis_refmac_compatible_blur(name):
    m = model(name)
    grid = GridSpec.for_spacing(m.cell, 2 / 3, m.spacegroup)
    st = kernels.testing.gemmi_structure_of_model(m)
    _, dc = kernels.testing.gemmi_density_calculator(st, max(grid.spacing))
    dc.set_refmac_compatible_blur(st[0])
    # gemmi rounds U to float32 (SMat33f): 1e-5 Å² of blur
    assert kernels.sampling_blur(m.atoms, grid) == pytest.approx(dc.blur, abs=1e-4)


# --------------------------------------------------------------------------- shells


def factors(f: torch.Tensor, hkl: torch.Tensor, cell=MONOCLINIC) -> StructureFactors:
    return StructureFactors(hkl, f, cell)


@functools.cache
def some_set():
    grid = GridSpec(MONOCLINIC, (40, 24, 30))
    return structure_factors(random_map(grid.shape, seed=7), grid, 1.0, backend="reference")


@pytest.mark.parametrize("binning", ["count", "volume", "width"])
@pytest.mark.parametrize("n_shells", [1, 7, 20])
def test_binning_partitions_the_set(binning, n_shells):
    f = some_set()
    which, edges = shell_index(f.inv_d2, n_shells, binning)
    s = f.inv_d2.sqrt()
    assert which.min() >= 0 and which.max() < n_shells
    assert torch.all(edges[1:] >= edges[:-1])
    assert float(edges[0]) == float(s.min()) and float(edges[-1]) == float(s.max())
    lo, hi = edges[which], edges[which + 1]
    assert torch.all((s >= lo - 1e-12) & (s <= hi + 1e-12))
    counts = torch.bincount(which, minlength=n_shells)
    if binning == "count":
        # equal up to the fine shells cut at each edge (1/8192 of the s³ range, each holding a few
        # reflections of nearly equal d): within 2 % of the share (measured: 1 % at 7 shells)
        share = len(f) / n_shells
        assert float((counts - share).abs().max()) <= 0.02 * share + 4, counts
    elif binning == "volume":
        cubes = edges**3
        assert_close(
            cubes[1:] - cubes[:-1],
            torch.full((n_shells,), float(cubes[-1] - cubes[0]) / n_shells, dtype=torch.float64),
            1e-12,
        )
    else:
        assert_close(
            edges[1:] - edges[:-1],
            torch.full((n_shells,), float(edges[-1] - edges[0]) / n_shells, dtype=torch.float64),
            1e-12,
        )


def test_statistics_of_known_differences():
    f = some_set()
    kept = f.f.clone()
    real = f.replace(f=f.f.abs())
    kept_real = real.f.clone()
    shells(f, real, n_shells=5)
    shells(real, f, n_shells=5)
    assert torch.equal(f.f, kept) and torch.equal(real.f, kept_real)  # the inputs are not written to
    same = shells(f, f, n_shells=5)
    assert torch.all(same.rel_error == 0) and torch.all(same.r_factor == 0) and torch.all(same.phase_error == 0)
    assert_close(same.fsc, torch.ones(5, dtype=torch.float64), 1e-12)
    assert_close(same.correlation, torch.ones(5, dtype=torch.float64), 1e-9)
    scaled = shells(f.replace(f=f.f * 1.25), f, n_shells=5)
    assert_close(scaled.rel_error, torch.full((5,), 0.25, dtype=torch.float64), 1e-12)
    assert_close(scaled.amplitude_error, torch.full((5,), 0.25, dtype=torch.float64), 1e-12)
    assert_close(scaled.r_factor, torch.full((5,), 0.25, dtype=torch.float64), 1e-12)
    assert_close(scaled.fsc, torch.ones(5, dtype=torch.float64), 1e-12)
    turned = shells(f.replace(f=f.f * complex(math.cos(0.3), math.sin(0.3))), f, n_shells=5)
    assert_close(turned.phase_error, torch.full((5,), math.degrees(0.3), dtype=torch.float64), 1e-9)
    assert_close(turned.fsc, torch.full((5,), math.cos(0.3), dtype=torch.float64), 1e-12)
    assert_close(turned.amplitude_error, torch.zeros(5, dtype=torch.float64), 1e-12)
    assert_close(turned.rel_error, torch.full((5,), 2 * math.sin(0.15), dtype=torch.float64), 1e-12)
    # by hand on one shell: R = Σ||F|−|G||/Σ|G|, correlation of amplitudes
    g = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.complex128)
    h = torch.tensor([1.5, 1.0, 3.0, 5.0], dtype=torch.complex128)
    hkl = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]])
    one = shells(factors(h, hkl), factors(g, hkl), n_shells=1)
    assert float(one.r_factor[0]) == pytest.approx((0.5 + 1 + 0 + 1) / 10)
    assert float(one.correlation[0]) == pytest.approx(float(np.corrcoef([1.5, 1, 3, 5], [1, 2, 3, 4])[0, 1]))
    assert int(one.count[0]) == 4 and float(one.mean_intensity[0]) == pytest.approx((2.25 + 1 + 9 + 25) / 4)


def _many_reflections(n_side: int = 21):
    """A set of (2n+1)³ − 1 reflections (many CPU blocks) and a perturbed copy, complex128."""
    r = torch.arange(-n_side, n_side + 1)
    hkl = torch.cartesian_prod(r, r, r)
    hkl = hkl[(hkl != 0).any(1)]
    gen = torch.Generator().manual_seed(3)
    f = torch.complex(torch.randn(len(hkl), generator=gen), torch.randn(len(hkl), generator=gen)).to(torch.complex128)
    g = f * (1 + 0.3 * torch.rand(len(hkl), generator=gen)) + 0.2 * torch.randn(len(hkl), generator=gen)
    return factors(f, hkl), factors(g, hkl)


def test_cpu_sums_over_many_blocks_are_the_same_bits_at_any_thread_count():
    f, g = _many_reflections()
    shell_module = importlib.import_module("kernels.reciprocal.shells")
    assert len(f) > 4 * shell_module._BLOCK  # several blocks to share out
    kept = torch.get_num_threads()
    try:
        tables = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            tables.append(shells(f, g, n_shells=9).as_dict())
    finally:
        torch.set_num_threads(kept)
    for other in tables[1:]:
        for key, want in tables[0].items():
            assert np.array_equal(np.asarray(other[key], dtype=float), np.asarray(want, dtype=float), equal_nan=True), (
                key
            )
    # and they are the sums: each shell's statistics from its reflections directly, in float64
    which, _ = shell_index(f.inv_d2, 9, "count")
    a, b = f.f.abs(), g.f.abs()
    for i in range(9):
        m = which == i
        assert float(tables[0]["r_factor"][i]) == pytest.approx(
            float((a[m] - b[m]).abs().sum() / b[m].sum()), rel=1e-12
        )
        fsc_i = (f.f[m] * g.f[m].conj()).real.sum() / (a[m].square().sum() * b[m].square().sum()).sqrt()
        assert float(tables[0]["fsc"][i]) == pytest.approx(float(fsc_i), rel=1e-12)


def _cpu_phase_errors(f, ref):
    """The CPU's phase-error column with one reflection per shell: each reflection's own |Δφ| in degrees."""
    n = len(f)
    shells_module = importlib.import_module("kernels.reciprocal.shells")
    each = np.arange(n, dtype=np.int64)
    edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
    plan = shells_module._ShellPlan(each, torch.ones(n, dtype=torch.int64), edges, which=each, which_sorted=each)
    with np.errstate(divide="ignore", invalid="ignore"):
        sums = shells_module._sums_cpu(f.numpy(), ref.numpy(), plan, n, ordered=False)
    return shells_module._table(plan, sums, True).phase_error


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_cpu_phase_differences_are_atan2s_over_the_whole_circle(dtype):
    g = torch.Generator().manual_seed(5)
    angles = torch.cat((torch.rand(200, generator=g, dtype=torch.float64) * 2 * math.pi - math.pi,
                        torch.tensor([0.0, math.pi, -math.pi, math.pi / 2, -math.pi / 2, 1e-9, math.pi - 1e-9])))  # fmt: skip
    ref = torch.polar(torch.rand(len(angles), generator=g, dtype=torch.float64) + 0.5, angles.flip(0))
    f = (ref * torch.polar(torch.full_like(angles, 1.7), angles)).to(dtype)
    f = torch.cat((f, torch.zeros(1, dtype=dtype)))  # F = 0 against F_ref: atan2(0, 0) = 0
    ref = torch.cat((ref, ref[:1])).to(dtype)
    got = _cpu_phase_errors(f, ref)
    prod = f.to(torch.complex128) * ref.to(torch.complex128).conj()
    want = torch.rad2deg(torch.atan2(prod.imag, prod.real).abs())
    assert_close(got[:-1], want[:-1], 1e-13)
    assert float(got[-1]) == 0.0  # no phase without an amplitude (torch's atan2 of a −0 real part gives 180)


def test_cpu_sums_in_cpp_are_numpys_sums_bit_for_bit_but_the_phase(monkeypatch):
    shells_module = importlib.import_module("kernels.reciprocal.shells")
    assert shells_module._extension() is not None, "kernels.reciprocal._shells is not built"
    f, g = _many_reflections()
    real = g.f.abs()  # observed amplitudes as real F: the other layout of the reference
    for ref in (g.f, g.f.to(torch.complex64), real, real.float()):
        for fset in (f.f, f.f.to(torch.complex64)):
            plan = shells_module._plan(f, 7, "volume")
            args = (fset.numpy(), ref.numpy(), plan, 7)
            cpp = shells_module._sums_cpu(*args, ordered=False)
            with monkeypatch.context() as patch:  # numpy's path, as on a checkout whose C++ is not built
                patch.setattr(shells_module, "_extension", lambda: None)
                ours = shells_module._sums_cpu(*args, ordered=False)
            phase = shells_module._ROWS.index("bphase")
            others = [c for c in range(len(shells_module._ROWS)) if c != phase]
            assert np.array_equal(cpp[others], ours[others]), (fset.dtype, ref.dtype)
            np.testing.assert_allclose(cpp[phase], ours[phase], rtol=1e-13)


def test_cpu_block_sums_refuse_bad_arrays():
    from kernels.reciprocal import _shells

    f = np.zeros(8, dtype=np.float32)
    which = np.zeros(4, dtype=np.int64)
    out = np.zeros((10, 2))
    _shells.block_sums(f, 2, f, 2, which, 0, 4, out)
    with pytest.raises(ValueError, match="shell index"):
        _shells.block_sums(f, 2, f, 2, np.array([0, 1, 2, 0]), 0, 4, out)
    with pytest.raises(ValueError, match="lie in the set"):
        _shells.block_sums(f, 2, f, 2, which, 0, 5, out)
    with pytest.raises(ValueError, match="different numbers"):
        _shells.block_sums(f, 2, f[:6], 2, which, 0, 4, out)
    with pytest.raises(TypeError):
        _shells.block_sums(f.astype(np.float16), 2, f, 2, which, 0, 4, out)
    with pytest.raises(TypeError):
        _shells.block_sums(f, 2, f, 2, which.astype(np.int32), 0, 4, out)


def _shells_in_child(f, g, queue):
    queue.put(float(shells(f, g, n_shells=3).r_factor.sum()))


def test_cpu_sums_work_in_a_process_forked_after_the_worker_threads_started():
    import multiprocessing

    f, g = _many_reflections()
    kept = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = float(shells(f, g, n_shells=3).r_factor.sum())  # the pool's threads now exist in this process
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_shells_in_child, args=(f, g, queue))  # inherited, not pickled
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive, "shells hung in a forked child"
        assert queue.get(timeout=5) == want
    finally:
        torch.set_num_threads(kept)


def test_crossings_interpolate_between_shell_centres():
    f = some_set()
    table = shells(f, f, n_shells=4, binning="width")
    s = table.s_mid
    curve = torch.tensor([0.9, 0.6, 0.3, 0.1], dtype=torch.float64)
    t = type(table)(**{**table.__dict__, "fsc": curve})
    want = 1 / (float(s[1]) + (0.6 - 0.5) / (0.6 - 0.3) * float(s[2] - s[1]))
    assert t.crossing(0.5) == pytest.approx(want)
    assert t.crossing(0.05) is None
    assert t.crossing(0.95) == pytest.approx(1 / float(s[0]))
    with pytest.raises(ValueError, match="no 'fsc' column"):
        shells(f, n_shells=4).crossing(0.5)


def test_fsc_of_a_map_and_its_noisy_copy():
    """White noise of constant power against a map whose power falls with resolution: FSC falls through 0.5."""
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, 2 / 3)
    rho = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, backend="cpu")
    same = fsc(rho, rho, grid)
    assert torch.all(same.fsc > 1 - 1e-6)
    assert same.crossing(0.143) is None
    # crosses 0.5 near 2.8 Å and 0.143 near 1.7 Å
    noise = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0)) * float(rho.std()) * 3.0
    table = fsc(rho, rho + noise, grid)
    assert len(table) >= 20 and float(table.fsc[0]) > 0.99
    d05, d0143 = table.crossing(0.5), table.crossing(0.143)
    assert d05 is not None and d0143 is not None and d05 > d0143 > float(table.d_min[-1])
    # the same FSC from the structure factors of both maps
    f1 = structure_factors(rho, grid, float(table.d_min[-1]) * (1 - 1e-9))
    f2 = structure_factors(rho + noise, grid, float(table.d_min[-1]) * (1 - 1e-9))
    again = shells(f1, f2, n_shells=len(table), binning="width")
    # structure_factors rounds V/N·R to float32 once more than fsc, which reads the transforms unscaled
    assert_close(again.fsc, table.fsc, 1e-7)
    assert_close(again.mean_intensity, table.mean_intensity, 0, rtol=1e-6)
    exact = fsc(rho.double(), (rho + noise).double(), grid)
    again = shells(
        structure_factors(rho.double(), grid, float(table.d_min[-1]) * (1 - 1e-9)),
        structure_factors((rho + noise).double(), grid, float(table.d_min[-1]) * (1 - 1e-9)),
        n_shells=len(table),
        binning="width",
    )
    for column in ("fsc", "rel_error", "amplitude_error", "phase_error", "r_factor", "correlation"):
        assert_close(getattr(exact, column), getattr(again, column), 1e-12)
    assert_close(exact.mean_intensity, again.mean_intensity, 0, rtol=1e-12)


# --------------------------------------------------------------------------- the GPU's shell kernel
#
# kernels.reciprocal.triton.shell_statistics is what shells() and fsc() run on a GPU. Here it runs on the
# CUDA device where there is one, and in Triton's interpreter on CPU tensors otherwise (CI), against the
# CPU's numpy tables of the same plans.

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the module, not the function kernels.reciprocal re-exports under the same name
SHELLS_MODULE = importlib.import_module("kernels.reciprocal.shells")


def _shell_kernel(f, reference, index, bounds):
    from kernels.reciprocal.triton import shell_statistics

    dev = torch.device(TRITON_DEVICE)
    ref = None if reference is None else reference.to(dev)
    out = shell_statistics(f.to(dev), ref, index.to(dev), bounds.to(dev)).cpu()
    return dict(zip(SHELLS_MODULE.STAT_COLUMNS, out))


def _same(got, want):
    """Equal to float64 rounding of the sums' order: 1e-12 of the column's largest value."""
    assert_close(got, want, 1e-12 * float(want.abs().max()))


def _bounds(plan) -> torch.Tensor:
    """Where each shell of a CPU plan starts in its shell order, and where the last ends (S + 1,) int64."""
    return torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(plan.count, 0)))


def _cpu_plan(f, n_shells, binning):
    """The CPU plan of ``f`` as the kernel takes it: the reflections in shell order and the shells' bounds."""
    plan = SHELLS_MODULE._plan(f, n_shells, binning)
    return torch.from_numpy(plan.order), _bounds(plan)


@pytest.mark.parametrize("binning", ["count", "volume"])
def test_gpu_shell_kernel_gives_the_cpu_tables(binning):
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, 0.8)
    rho = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, backend="cpu")
    f = structure_factors(rho, grid, 2.5)  # complex64
    exact = structure_factors(rho.double(), grid, 2.5, backend="reference")  # complex128
    order, bounds = _cpu_plan(f, 12, binning)
    for reference in (exact, exact.replace(f=exact.f.abs()), exact.replace(f=exact.f.abs().float()), None):
        want = shells(f, reference, n_shells=12, binning=binning)
        got = _shell_kernel(f.f, None if reference is None else reference.f, order, bounds)
        for column, values in got.items():
            if getattr(want, column) is not None:
                _same(values, getattr(want, column))
        assert len(got) == (1 if reference is None else 7)
    # real amplitudes as the set, complex reference
    want = shells(f.replace(f=f.f.abs()), exact, n_shells=12, binning=binning)
    got = _shell_kernel(f.f.abs(), exact.f, order, bounds)
    for column, values in got.items():
        _same(values, getattr(want, column))


def test_gpu_shell_kernel_phase_differences_are_atan2s_over_the_whole_circle():
    # one reflection per shell: each shell's phase error is that reflection's |Δφ|, weighted by itself
    g = torch.Generator().manual_seed(3)
    angles = torch.cat((torch.rand(60, generator=g, dtype=torch.float64) * 2 * math.pi - math.pi,
                        torch.tensor([0.0, math.pi, -math.pi, math.pi / 2, -math.pi / 2, 1e-9, math.pi - 1e-9])))  # fmt: skip
    ref = torch.polar(
        torch.rand(len(angles), generator=g, dtype=torch.float64) + 0.5,
        torch.rand(len(angles), generator=g, dtype=torch.float64),
    )
    f = ref * torch.polar(torch.full_like(angles, 1.7), angles)
    f = torch.cat((f, torch.zeros(1, dtype=f.dtype), f[:1]))  # F = 0 against F_ref: atan2(0, 0) = 0
    ref = torch.cat((ref, ref[:1], torch.zeros(1, dtype=ref.dtype)))  # and F_ref = 0: a weight of 0, NaN
    n = len(f)
    with np.errstate(divide="ignore", invalid="ignore"):  # the interpreter's numpy, on the NaN shells
        got = _shell_kernel(f, ref, torch.arange(n), torch.arange(n + 1))
        empty = _shell_kernel(f, ref, torch.arange(n), torch.tensor([0, 3, 3, n]))
    want = torch.rad2deg(torch.atan2((f * ref.conj()).imag, (f * ref.conj()).real).abs())
    assert_close(got["phase_error"][:-1], want[:-1], 1e-13)
    assert torch.isnan(got["phase_error"][-1])
    # an empty shell: NaN in every column
    assert all(torch.isnan(values[1]) for values in empty.values())


def test_gpu_shell_kernel_gathers_an_fsc_through_the_flat_indices():
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, 0.8)
    rho = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, backend="cpu")
    other = rho + 0.05 * torch.randn(grid.shape, generator=torch.Generator().manual_seed(2))
    want = fsc(rho, other, grid, n_shells=15)
    plan, flat = SHELLS_MODULE._fsc_plan(grid, finest_d_min(grid), 15, "width", torch.device("cpu"))
    got = _shell_kernel(torch.fft.rfftn(rho).reshape(-1), torch.fft.rfftn(other).reshape(-1), flat, _bounds(plan))
    for column in ("fsc", "rel_error", "phase_error", "correlation"):
        _same(got[column], getattr(want, column))
    assert_close(got["mean_intensity"] * grid.voxel_volume**2, want.mean_intensity, 0, rtol=1e-12)


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_with_a_reason():
    grid = GridSpec(MONOCLINIC, (24, 15, 18))
    rho = random_map(grid.shape)
    with pytest.raises(GridError, match=r"finer than this 24×15×18 grid .* use d_min ≥ 1\.\d+ Å"):
        structure_factors(rho, grid, 1.0)
    with pytest.raises(GridError, match="does not match the grid"):
        structure_factors(rho[:-1], grid, 3.0)
    box = GridSpec(MONOCLINIC, (24, 15, 18), origin=(1, 0, 0), sampling=(24, 15, 18))
    with pytest.raises(GridError, match="whole-cell grid"):
        structure_factors(rho, box, 3.0)
    with pytest.raises(GridError, match="unknown space group 'P 7'"):
        structure_factors(rho, grid, 3.0, spacegroup="P 7")
    for bad in (0.0, -2.0, math.nan, math.inf, "2"):
        with pytest.raises(ValueError, match="d_min"):
            structure_factors(rho, grid, bad)
    with pytest.raises(ValueError, match="blur"):
        structure_factors(rho, grid, 3.0, blur=math.nan)
    with pytest.raises(ValueError, match="backend must be one of"):
        structure_factors(rho, grid, 3.0, backend="cpu")
    with pytest.raises(ValueError, match="real floating-point"):
        structure_factors(rho.to(torch.int32), grid, 3.0)
    f = structure_factors(rho, grid, 3.0)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n_shells must be a positive int"):
            shells(f, n_shells=bad)
    with pytest.raises(ValueError, match="binning must be one of"):
        shells(f, binning="log")
    other = structure_factors(rho, grid, 4.0)
    with pytest.raises(ValueError, match="the reference has"):
        shells(f, other)
    with pytest.raises(ValueError, match="Miller indices differ"):
        shells(f, f.replace(hkl=f.hkl.flip(0)))
    with pytest.raises(ValueError, match="no reflections"):
        shells(f.replace(hkl=f.hkl[:0], f=f.f[:0]))
    with pytest.raises(ValueError, match="differ in shape"):
        fsc(rho, rho[:, :, :-1], grid)


# --------------------------------------------------------------------------- CUDA


@requires_cuda
def test_cuda_matches_cpu_and_makes_no_host_sync():
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, 2 / 3)
    rho = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, backend="cpu")
    want = structure_factors(rho.double(), grid, 2.0, backend="reference")
    cuda = rho.cuda()
    first = structure_factors(cuda, grid, 2.0)  # makes and keeps the index set on the device
    assert first.f.is_cuda and first.hkl.is_cuda
    reference = first.replace(f=first.f.to(torch.complex128))
    other = cuda * 1.01 + 1e-3
    fsc(cuda, other, grid)  # the first FSC on this grid makes its index set on the host
    torch.cuda.synchronize()
    # the steady state: every call below (the first binning of each kind included) queues work and reads nothing back
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = structure_factors(cuda, grid, 2.0, blur=0.0)
        table = shells(again, reference, n_shells=20)
        by_volume = shells(again, reference, n_shells=20, binning="volume")
        alone = shells(again, n_shells=20)
        curve = fsc(cuda, other, grid)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert table.rel_error.is_cuda and curve.fsc.is_cuda
    # the same tables as the CPU's (numpy) from the same factors
    on_cpu = again.replace(hkl=again.hkl.cpu(), f=again.f.cpu(), _inv_d2=again.inv_d2.cpu())
    ref_cpu = on_cpu.replace(f=reference.f.cpu())
    for got, on_host in (
        (table, shells(on_cpu, ref_cpu, n_shells=20)),
        (by_volume, shells(on_cpu, ref_cpu, n_shells=20, binning="volume")),
        (alone, shells(on_cpu, n_shells=20)),
        (curve, fsc(rho, rho * 1.01 + 1e-3, grid)),
    ):
        assert torch.equal(got.count.cpu(), on_host.count)
        assert_close(got.mean_intensity, on_host.mean_intensity, 0, rtol=1e-5)
        if on_host.fsc is not None:
            assert_close(got.fsc, on_host.fsc, 1e-6)
            assert_close(got.rel_error, on_host.rel_error, 1e-6)
    # float32 cuFFT against the float64 transform: 1e-6 of the largest factor (as the CPU float32 test)
    assert_close(as_real(again.f), as_real(want.f), atol=1e-6 * float(want.f.abs().max()))
    assert torch.all(table.rel_error.cpu() == 0)
    ref = structure_factors(cuda, grid, 2.0, backend="reference")
    assert_close(as_real(ref.f), as_real(want.f), atol=1e-10 * float(want.f.abs().max()))
    grad = torch.zeros_like(cuda).requires_grad_()
    structure_factors(cuda + grad, grid, 2.0).f.abs().sum().backward()
    assert grad.grad is not None and torch.isfinite(grad.grad).all()
    t = fsc(cuda, cuda, grid)
    assert torch.all(t.fsc.cpu() > 1 - 1e-6)


@pytest.mark.parametrize("shape", [(7, 11, 13), (8, 10, 12)])
def test_fourier_synthesis_is_the_direct_sum_and_inverts_structure_factors(shape):
    grid = GridSpec(TRICLINIC, shape)
    rho = random_map(shape, seed=11)
    f = structure_factors(rho, grid, finest_d_min(grid) * 1.3)
    f000 = float(rho.sum()) * grid.voxel_volume
    back = kernels.fourier_synthesis(f, grid, f000=f000)
    assert back.dtype == torch.float64 and back.shape == shape
    # ρ(x) = (F000 + Σ_h [F(h)·e^{−2πi h·x} + conj])/V over the hemisphere, voxel by voxel
    frac = grid.voxel_fractional().reshape(-1, 3)
    phase = 2 * math.pi * (frac @ f.hkl.to(torch.float64).T)
    want = (f000 + 2 * (torch.cos(phase) @ f.f.real + torch.sin(phase) @ f.f.imag)) / grid.cell.volume
    assert_close(back.reshape(-1), want, atol=1e-12 * float(want.abs().max()))
    again = structure_factors(back, grid, f.d_min)
    assert_close(as_real(again.f), as_real(f.f), atol=1e-12 * float(f.f.abs().max()))
    assert float(back.mean()) == pytest.approx(float(rho.mean()), rel=1e-12)
    # differentiable in F
    g = f.f.detach().clone().requires_grad_()
    kernels.fourier_synthesis(f.replace(f=g), grid).square().sum().backward()
    assert g.grad is not None and torch.isfinite(g.grad).all()


def test_fourier_synthesis_refuses_a_unique_set_and_indices_beyond_the_grid():
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, 1.0, m.spacegroup)
    rho = random_map(grid.shape, dtype=torch.float32)
    with pytest.raises(ValueError, match="takes a P 1 set"):
        kernels.fourier_synthesis(structure_factors(rho, grid, 3.0, spacegroup=m.spacegroup), grid)
    fine = structure_factors(rho, grid, 2.5)
    coarse = GridSpec.for_spacing(m.cell, 2.0)
    with pytest.raises(GridError, match="outside this .* Nyquist box"):
        kernels.fourier_synthesis(fine, coarse)
