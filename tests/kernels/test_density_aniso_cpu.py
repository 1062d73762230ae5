"""The CPU density splat of anisotropic atoms (and neutron/electron tables) against the float64 reference.

Every atom of a set with ``u_aniso`` goes through the anisotropic kernel with its effective U, so
mixed models are exact and gradients reach ``u_aniso`` of anisotropic atoms and ``b_iso`` of the
others. Tolerances: the float32 contract of docs/kernels.md (``assert_kernel_close``:
1e-5·max|ref| + 1e-5·|ref|) for maps and gradients; the forward and the backward multiply per-atom
factor tables in float64, walking each plane down its rows (relative error < 1e-13 before the map's
one float rounding; the backward's sums in float64), and atoms past the tables' range evaluate each
term's exponent in float from row constants formed in double (error ≤ ~1e-7 of the term's peak) and
exp with a polynomial (relative error < 3e-7): both well inside that bound. Against gemmi's
anisotropic calculator: relative L2 ≤ 1e-5 (gemmi sums in float with its own fast exp).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernels.testing
from kernels.adp import U_TO_B, adp_eigenvalues
from kernels.crystal import AtomSet, Cell, GridSpec, read_model
from kernels.density import cpu as density_cpu
from kernels.density.radius import atom_cutoff_radii
from kernels.density.reference import splat_frames_reference, splat_reference
from tests.helpers import STRUCTURES, assert_kernel_close, leaf_atoms

F32, F64 = torch.float32, torch.float64


_GRAD_FIELDS = ("xyz", "b_iso", "occ", "u_aniso")


def _check_against_reference(atoms: AtomSet, grid: GridSpec, seed: int = 0, **kw) -> torch.Tensor:
    """Forward and every gradient of splat_cpu against autograd through the float64 reference.

    The reference gets the very same float32-representable values in float64; ``kw`` (radius,
    cutoff, radius_rule) goes to both.
    """
    a32 = leaf_atoms(atoms.to(dtype=F32), F32)
    a64 = leaf_atoms(a32, F64)
    out = density_cpu.splat_cpu(a32, grid, **kw)
    ref = splat_reference(a64, grid, **kw)
    assert out.dtype == F32 and out.shape == grid.shape
    assert_kernel_close(out, ref)
    # the same sphere (r² < R² decided as the reference decides it): nothing outside it, and every
    # voxel inside it that the float32 exp does not flush (terms below 2^-43 of their peak are 0)
    assert not out[ref == 0].any(), "density outside the reference's voxel set"
    assert bool((out != 0)[ref.abs() > 1e-9 * ref.abs().max()].all()), "a voxel of the reference's set is missing"
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    out.backward(upstream.to(F32))
    ref.backward(upstream)
    for name in _GRAD_FIELDS:
        want = getattr(a64, name)
        if want is None:
            continue
        got = getattr(a32, name).grad
        assert got is not None and got.dtype == F32, name
        assert_kernel_close(got, want.grad)
    return out


def _random_u(n: int, rng: np.random.Generator, b_range=(8.0, 50.0), max_ratio: float = 10.0) -> np.ndarray:
    """(n, 6) U = R·diag(λ)·Rᵀ with random rotations R, eigenvalue ratios up to ``max_ratio`` and
    mean eigenvalue B/8π² for B uniform in ``b_range``: tilted off the cell axes."""
    out = np.empty((n, 6))
    for i in range(n):
        q, r = np.linalg.qr(rng.standard_normal((3, 3)))
        rot = q * np.sign(np.diag(r))
        lam = np.array([1.0, rng.uniform(1.0, max_ratio), max_ratio])
        lam *= rng.uniform(*b_range) / U_TO_B / lam.mean()
        u = rot @ np.diag(lam) @ rot.T
        out[i] = (u[0, 0], u[1, 1], u[2, 2], u[0, 1], u[0, 2], u[1, 2])
    return out


_ELEMENTS = ["C", "N", "O", "S", "Fe", "P", "H", "Cl"]


def _random_atoms(
    cell: Cell, n: int, seed: int, *, iso_every: int = 0, radiation: str = "xray", max_ratio: float = 10.0
) -> AtomSet:
    """``n`` random atoms in (and a little around) ``cell``; every ``iso_every``-th one isotropic (NaN row)."""
    rng = np.random.default_rng(seed)
    frac = rng.random((n, 3)) * 1.2 - 0.1  # some outside the cell: wrapping
    xyz = frac @ cell.orth.numpy().T
    els = [_ELEMENTS[i % len(_ELEMENTS)] for i in range(n)]
    u = _random_u(n, rng, max_ratio=max_ratio)
    if iso_every:
        u[::iso_every] = np.nan
    return AtomSet.from_elements(
        els, xyz, rng.uniform(5.0, 40.0, n), rng.uniform(0.3, 1.0, n), radiation=radiation, u_aniso=u
    )


CELLS = {
    "orthogonal-odd": ((11.0, 12.5, 13.3, 90, 90, 90), (17, 19, 23)),
    "monoclinic": ((12.0, 9.0, 14.0, 90, 104.5, 90), (20, 15, 24)),
    "hexagonal": ((10.0, 10.0, 13.0, 90, 90, 120), (18, 18, 21)),
    "triclinic": ((9.0, 10.0, 11.0, 75, 101.5, 112), (16, 17, 19)),
}


def _grid(kind: str) -> GridSpec:
    params, shape = CELLS[kind]
    cell = Cell.from_parameters(*params)
    assert cell.kind == kind.split("-")[0]
    return GridSpec(cell, shape)


# --------------------------------------------------------------------------- real structures


def test_1pfe_hexagonal_every_atom_anisotropic():
    m = read_model(STRUCTURES["1pfe"])
    assert m.cell.kind == "hexagonal" and bool(m.atoms.aniso.all())
    _check_against_reference(m.atoms, GridSpec.for_spacing(m.cell, 0.8, m.spacegroup))


def test_3o5r_mixed_with_the_bad_atom_isotropic():
    with pytest.warns(UserWarning, match="not positive definite"):
        m = read_model(STRUCTURES["3o5r"], on_bad_adp="iso")
    iso = ~m.atoms.aniso
    assert int(iso.sum()) >= 1  # A/MET 48/CB altloc A splats at its B_iso
    a32 = leaf_atoms(m.atoms.to(dtype=F32), F32)
    grid = GridSpec.for_spacing(m.cell, 1.0, m.spacegroup)
    a64 = leaf_atoms(a32, F64)
    out = density_cpu.splat_cpu(a32, grid)
    ref = splat_reference(a64, grid)
    assert_kernel_close(out, ref)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    out.backward(upstream.to(F32))
    ref.backward(upstream)
    for name in _GRAD_FIELDS:
        assert_kernel_close(getattr(a32, name).grad, getattr(a64, name).grad)
    # b_iso reaches the map only through the isotropic atoms, u_aniso only through the others
    assert bool((a32.b_iso.grad[iso] != 0).all()) and not a32.b_iso.grad[~iso].any()
    assert not a32.u_aniso.grad[iso].any() and bool((a32.u_aniso.grad[~iso] != 0).any(dim=1).all())


def test_1pfe_matches_gemmi_anisotropic():
    path = STRUCTURES["1pfe"]
    m = read_model(path)
    spacing = 2.0 / 3.0
    grid = GridSpec.for_spacing(m.cell, spacing, m.spacegroup)
    out = density_cpu.splat_cpu(m.atoms.to(dtype=F32), grid).double()
    ref = torch.from_numpy(kernels.testing.gemmi_density(path, spacing, 1e-5, adp="auto")).double()
    assert ref.shape == out.shape
    rel_l2 = float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))
    assert rel_l2 <= 1e-5, f"relative L2 against gemmi {rel_l2:.3e}"


# --------------------------------------------------------------------------- synthetic cells and atoms


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_synthetic_cells_mixed_iso_and_aniso(kind):
    # every cell kind (the anisotropic kernel has one path for all of them); a third isotropic
    atoms = _random_atoms(_grid(kind).cell, 18, seed=len(kind), iso_every=3)
    assert 0 < int(atoms.aniso.sum()) < len(atoms)
    _check_against_reference(atoms, _grid(kind))


@pytest.mark.parametrize("rule", ["gemmi", "eigen"])
@pytest.mark.parametrize("kind", ["orthogonal-odd", "triclinic"])
def test_strongly_anisotropic_tilted_atoms(kind, rule):
    grid = _grid(kind)
    atoms = _random_atoms(grid.cell, 10, seed=7, max_ratio=12.0)
    lam = adp_eigenvalues(atoms.u_aniso)
    assert bool((lam[:, 2] / lam[:, 0] >= 10).all())
    u = atoms.u_aniso
    assert bool((u[:, 3:].abs() > 0.05 * u[:, :3].max(dim=1).values[:, None]).any(dim=1).all())  # off the axes
    _check_against_reference(atoms, grid, radius_rule=rule)


def _kernel_radii(atoms: AtomSet, radiation: str, rule: str) -> torch.Tensor:
    """The radii the cpu backend gives an anisotropic set (float32 atoms)."""
    u8 = atoms.aniso.to(torch.uint8)
    return density_cpu._aniso_radii(atoms.u_aniso, u8, atoms.b_iso, atoms.a, atoms.b, radiation, 1e-5, rule)


@pytest.mark.parametrize("radiation", ["xray", "electron", "neutron"])
def test_radii_are_atom_cutoff_radii(radiation):
    # the C++ rules against kernels.density.radius.atom_cutoff_radii on a mixed set; the exact rule
    # reaches at least as far as gemmi's diagonal rule on tilted atoms
    grid = _grid("orthogonal-odd")
    atoms = _random_atoms(grid.cell, 30, seed=11, max_ratio=12.0, iso_every=5, radiation=radiation).to(dtype=F32)
    for rule in ("gemmi", "eigen"):
        want = atom_cutoff_radii(atoms, 1e-5, rule)
        # gemmi's rule: the same operations as the torch rule; eigen: closed-form eigenvalues
        tol = 1e-12 if rule == "gemmi" else 1e-9
        torch.testing.assert_close(_kernel_radii(atoms, radiation, rule), want, atol=tol, rtol=0)
    gemmi_r = atom_cutoff_radii(atoms, 1e-5, "gemmi")
    eigen_r = atom_cutoff_radii(atoms, 1e-5, "eigen")
    assert bool((eigen_r[atoms.aniso] > gemmi_r[atoms.aniso]).all())


@pytest.mark.parametrize("radiation", ["electron", "neutron"])
def test_radiation_types_with_aniso(radiation):
    grid = _grid("monoclinic")
    atoms = _random_atoms(grid.cell, 16, seed=5, iso_every=4, radiation=radiation)
    out = _check_against_reference(atoms, grid)
    if radiation == "neutron":
        # hydrogen's scattering length is negative: its density is too
        assert "H" in atoms.elements and float(out.detach().min()) < 0


def test_isotropic_neutron_set_takes_closed_form_radii():
    # an isotropic neutron set keeps the separable kernel, with the closed-form radii
    grid = _grid("triclinic")
    atoms = _random_atoms(grid.cell, 16, seed=4, radiation="neutron").replace(u_aniso=None, aniso=None)
    out = _check_against_reference(atoms, grid)
    assert float(out.detach().min()) < 0
    iso_default = density_cpu.splat_cpu(atoms.to(dtype=F32), grid)
    assert torch.equal(iso_default, out.detach())


def test_fixed_radius():
    grid = _grid("monoclinic")
    atoms = _random_atoms(grid.cell, 12, seed=9, iso_every=3)
    _check_against_reference(atoms, grid, radius=2.5)


def test_isotropic_u_gives_the_isotropic_map():
    # U = B/8π²·I on every atom: the anisotropic kernel's map is the isotropic kernel's
    grid = _grid("hexagonal")
    iso = _random_atoms(grid.cell, 12, seed=1).replace(u_aniso=None, aniso=None).to(dtype=F32)
    u = torch.zeros((len(iso), 6), dtype=F32)
    u[:, :3] = (iso.b_iso / U_TO_B)[:, None]
    aniso = iso.replace(u_aniso=u, aniso=torch.ones(len(iso), dtype=torch.bool))
    assert_kernel_close(density_cpu.splat_cpu(aniso, grid), density_cpu.splat_cpu(iso, grid).double())


def test_gradients_against_finite_differences_of_the_reference():
    # The reference's autograd is the truth above; here its central differences on a few U
    # components, and ours against them.
    grid = _grid("triclinic")
    atoms = _random_atoms(grid.cell, 4, seed=21).to(dtype=F32).to(dtype=F64)  # float32-representable
    w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
    radius = 4.0  # a fixed sphere: the differences move no voxel in or out

    def loss(u):
        return float((splat_reference(atoms.replace(u_aniso=u), grid, radius=radius) * w).sum())

    fixed = leaf_atoms(atoms.to(dtype=F32), F32)
    (density_cpu.splat_cpu(fixed, grid, radius=radius).double() * w).sum().backward()
    h = 1e-5
    for i, j in ((0, 0), (1, 3), (2, 5), (3, 4)):
        u_p, u_m = atoms.u_aniso.clone(), atoms.u_aniso.clone()
        u_p[i, j] += h
        u_m[i, j] -= h
        fd = (loss(u_p) - loss(u_m)) / (2 * h)
        got = float(fixed.u_aniso.grad[i, j])
        assert abs(got - fd) <= 1e-3 * abs(fd) + 1e-4 * float(fixed.u_aniso.grad.abs().max()), (i, j, got, fd)


# --------------------------------------------------------------------------- errors


def test_non_positive_definite_u_names_the_atom():
    grid = _grid("orthogonal-odd")
    atoms = _random_atoms(grid.cell, 6, seed=3).to(dtype=F32)
    u = atoms.u_aniso.clone()
    u[4] = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.0, 0.0])  # eigenvalues −0.1, 0.1, 0.3
    # unvalidated, as a user's own tensor can reach a backend
    bad = atoms.replace(u_aniso=u, _validate=False)
    with pytest.raises(ValueError) as ref_err:
        splat_reference(bad, grid)
    with pytest.raises(ValueError) as cpu_err:
        density_cpu.splat_cpu(bad, grid)
    assert str(cpu_err.value) == str(ref_err.value)
    assert str(atoms.labels[4]) in str(cpu_err.value) and "(index 4)" in str(cpu_err.value)
    assert "not positive definite" in str(cpu_err.value)
    u[4] = torch.tensor([0.1, float("nan"), 0.1, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"index 4\) has a non-finite anisotropic U"):
        density_cpu.splat_cpu(bad, grid)
    # an isotropic atom's row is never read: a bad row there is fine
    flags = atoms.aniso.clone()
    flags[4] = False
    ok = AtomSet(
        atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, u, flags, _validate=False
    )
    assert torch.isfinite(density_cpu.splat_cpu(ok, grid)).all()


def _sylvester_fails(u: torch.Tensor, aniso: torch.Tensor) -> torch.Tensor:
    """Which rows fail Sylvester's test as torch ops in float64 (what the C++ check must reproduce)."""
    u = u.to(F64)
    u11, u22, u33, u12, u13, u23 = u.unbind(-1)
    minor2 = u11 * u22 - u12 * u12
    det = u11 * (u22 * u33 - u23 * u23) - u12 * (u12 * u33 - u23 * u13) + u13 * (u12 * u23 - u22 * u13)
    return aniso & ~(torch.isfinite(u).all(dim=1) & (u11 > 0) & (minor2 > 0) & (det > 0))


def test_the_c_plus_plus_u_check_is_sylvesters_test():
    # the per-call check runs in C++ (no torch op over the (N, 6) U wakes torch's workers): the same
    # rows as the torch expression, on random U, rows at the boundary (det = 0 exactly, U11 = 0, a
    # singular 2×2 minor), non-finite rows, and bad rows of isotropic atoms (never read)
    from kernels.density import _scatter

    rng = np.random.default_rng(41)
    u = torch.from_numpy(_random_u(64, rng)).to(F32)
    u[:32] += torch.from_numpy(rng.normal(0.0, 0.05, (32, 6))).to(F32)  # some of these lose definiteness
    edge = torch.tensor(
        [
            [0.1, 0.1, 0.1, 0.1, 0.0, 0.0],  # U11·U22 − U12² = 0
            [0.0, 0.1, 0.1, 0.0, 0.0, 0.0],  # U11 = 0
            [0.1, 0.1, 0.1, 0.0, 0.0, 0.1],  # det = 0
            [0.1, float("inf"), 0.1, 0.0, 0.0, 0.0],
            [0.1, 0.1, float("nan"), 0.0, 0.0, 0.0],
            [0.1, 0.1, 0.1, 0.0, 0.0, 0.0],  # fine
        ],
        dtype=F32,
    )
    u = torch.cat([u, edge]).contiguous()
    for aniso in (torch.ones(len(u), dtype=torch.bool), torch.from_numpy(rng.random(len(u)) < 0.5)):
        fails = _sylvester_fails(u, aniso)
        assert 0 < int(fails.sum()) < len(u)
        got = _scatter.first_non_positive_definite(u, aniso.to(torch.uint8).contiguous())
        assert got == int(fails.nonzero()[0, 0])
        for i in fails.nonzero()[:, 0].tolist():  # each failing row alone, behind rows that pass
            ok = ~fails
            one = torch.cat([u[ok], u[i : i + 1]]).contiguous()
            flags = torch.cat([aniso[ok], aniso[i : i + 1]]).to(torch.uint8).contiguous()
            assert _scatter.first_non_positive_definite(one, flags) == len(one) - 1
        assert _scatter.first_non_positive_definite(u[~fails].contiguous(), aniso[~fails].to(torch.uint8)) == -1


def test_unknown_radius_rule_is_refused():
    grid = _grid("orthogonal-odd")
    with pytest.raises(ValueError, match="radius_rule must be one of"):
        density_cpu.splat_cpu(_random_atoms(grid.cell, 2, seed=0).to(dtype=F32), grid, radius_rule="exact")


# --------------------------------------------------------------------------- determinism, first call, out=, frames


def test_first_call_equals_later_calls_and_any_thread_count():
    before = torch.get_num_threads()
    try:
        for kind, seed in (("hexagonal", 1), ("monoclinic", 2), ("triclinic", 3)):
            grid = _grid(kind)
            atoms = _random_atoms(grid.cell, 20, seed=seed, iso_every=4).to(dtype=F32)
            maps, grads = [], []
            for threads in (2, 2, 1):
                torch.set_num_threads(threads)
                leaf = leaf_atoms(atoms, F32)
                out = density_cpu.splat_cpu(leaf, grid)
                out.backward(torch.ones_like(out))
                maps.append(out.detach())
                grads.append([getattr(leaf, n).grad for n in _GRAD_FIELDS])
            ref = splat_reference(atoms, grid)
            assert_kernel_close(maps[0], ref)
            for m, g in zip(maps[1:], grads[1:]):
                assert torch.equal(m, maps[0]), kind
                for a, b in zip(g, grads[0]):
                    assert torch.equal(a, b), kind
    finally:
        torch.set_num_threads(before)


def test_out_is_filled_in_place():
    grid = _grid("monoclinic")
    atoms = _random_atoms(grid.cell, 10, seed=6, iso_every=2).to(dtype=F32)
    want = density_cpu.splat_cpu(atoms, grid)
    out = torch.full(grid.shape, float("nan"))
    assert density_cpu.splat_cpu(atoms, grid, out=out) is out and torch.equal(out, want)
    leaf = leaf_atoms(atoms, F32)
    with pytest.raises(ValueError, match="out= is not differentiable"):
        density_cpu.splat_cpu(
            leaf.replace(xyz=leaf.xyz.detach(), b_iso=leaf.b_iso.detach(), occ=leaf.occ.detach()), grid, out=out
        )
    with torch.no_grad():
        assert torch.equal(density_cpu.splat_cpu(leaf, grid, out=out), want)


def _frames(cell: Cell, n: int, n_frames: int, seed: int) -> AtomSet:
    frames = [_random_atoms(cell, n, seed=seed + f, iso_every=3) for f in range(n_frames)]
    return AtomSet(
        torch.cat([f.xyz for f in frames]),
        torch.cat([f.b_iso for f in frames]),
        torch.cat([f.occ for f in frames]),
        torch.cat([f.a for f in frames]),
        torch.cat([f.b for f in frames]),
        sum((f.elements for f in frames), ()),
        sum((f.labels for f in frames), ()),
        torch.cat([f.u_aniso for f in frames]),
        torch.cat([f.aniso for f in frames]),
    ).to(dtype=F32)


@pytest.mark.parametrize("kind", ["hexagonal", "triclinic"])
def test_frames_are_the_single_splats_and_the_reference(kind):
    grid = _grid(kind)
    n, n_frames = 8, 3
    atoms = _frames(grid.cell, n, n_frames, seed=30)
    leaf = leaf_atoms(atoms, F32)
    maps = density_cpu.splat_frames_cpu(leaf, grid, n_frames=n_frames)
    upstream = torch.randn((n_frames, *grid.shape), generator=torch.Generator().manual_seed(1), dtype=F64)
    maps.backward(upstream.to(F32))
    ref_atoms = leaf_atoms(atoms, F64)
    ref = splat_frames_reference(ref_atoms, grid, n_frames=n_frames)
    ref.backward(upstream)
    assert_kernel_close(maps.detach(), ref.detach())
    for name in _GRAD_FIELDS:
        assert_kernel_close(getattr(leaf, name).grad, getattr(ref_atoms, name).grad)
    for f in range(n_frames):
        single = leaf_atoms(atoms.select(list(range(f * n, (f + 1) * n))), F32)
        one = density_cpu.splat_cpu(single, grid)
        one.backward(upstream[f].to(F32))
        assert torch.equal(maps[f].detach(), one.detach()), f
        rows = slice(f * n, (f + 1) * n)
        for name in _GRAD_FIELDS:
            assert torch.equal(getattr(leaf, name).grad[rows], getattr(single, name).grad), (f, name)


def test_empty_anisotropic_set():
    grid = _grid("orthogonal-odd")
    atoms = _random_atoms(grid.cell, 3, seed=0).to(dtype=F32).select([])
    leaf = leaf_atoms(atoms, F32)
    out = density_cpu.splat_cpu(leaf, grid)
    assert out.shape == grid.shape and not out.any()
    out.sum().backward()
    assert leaf.u_aniso.grad.shape == (0, 6)


def test_large_u_sphere_bigger_than_the_cell():
    # B ~ 150 Å² spheres reach past a 9–11 Å cell: several images of one atom add to one voxel
    grid = _grid("triclinic")
    rng = np.random.default_rng(8)
    atoms = AtomSet.from_elements(
        ["S", "O"], rng.random((2, 3)) @ grid.cell.orth.numpy().T, [150.0, 150.0], u_aniso=_random_u(2, rng, (120, 180))
    )
    _check_against_reference(atoms, grid)
    assert math.isfinite(float(density_cpu.splat_cpu(atoms.to(dtype=F32), grid).sum()))


@pytest.mark.parametrize(
    "plan",
    [{"slabs_per_thread": 3}, {"float_rows": False}],
    ids=["3-slabs-per-thread", "double-row-intervals"],
)
def test_kernel_plans_give_bitwise_the_same_results(plan):
    # another slab partition and the double-only row-interval pass: the same voxels summed in the
    # same order, so the same bits (maps and every gradient)
    grid = _grid("monoclinic")
    atoms = _random_atoms(grid.cell, 14, seed=12, iso_every=3).to(dtype=F32)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        for fields in ({}, plan):
            leaf = leaf_atoms(atoms, F32)
            with density_cpu._plan_hook(**fields):
                out = density_cpu.splat_cpu(leaf, grid)
                out.backward(upstream)
            results.append([out.detach()] + [getattr(leaf, n).grad for n in _GRAD_FIELDS])
    finally:
        torch.set_num_threads(before)
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- factor tables and the exp fallback


def _sharp_and_broad(grid: GridSpec, seed: int) -> tuple[AtomSet, AtomSet, AtomSet]:
    """Four sharp atoms (B 1–3 Å², eigenvalue ratio 100), four broad ones (B 20–60 Å², ratio 10) and the
    eight together, every U tilted off the cell axes."""
    rng = np.random.default_rng(seed)
    u = np.concatenate(
        [_random_u(4, rng, (1.0, 3.0), max_ratio=100.0), _random_u(4, rng, (20.0, 60.0), max_ratio=10.0)]
    )
    xyz = rng.random((8, 3)) @ grid.cell.orth.numpy().T
    occ = rng.uniform(0.5, 1.0, 8)
    els = ["C", "O", "N", "S"] * 2

    def atoms(sel):
        return AtomSet.from_elements([els[i] for i in sel], xyz[sel], [10.0] * len(sel), occ[sel], u_aniso=u[sel])

    return atoms(list(range(4))), atoms(list(range(4, 8))), atoms(list(range(8)))


def _exp_visits(atoms: AtomSet, grid: GridSpec, **kw) -> int:
    """(atom, slab) visits of the forward that took the exp per voxel instead of the factor tables."""
    with density_cpu._plan_hook() as record:
        density_cpu.splat_cpu(atoms.to(dtype=F32), grid, **kw)
    return record.forward[0]["exp_visits"]


@pytest.mark.parametrize("kind", ["hexagonal", "monoclinic", "triclinic"])
def test_factor_tables_and_the_exp_fallback_against_the_reference(kind):
    # A 4 Å sphere around sharp, 100:1 tilted atoms: their narrow terms' table factors would pass
    # e^±680 in the box's corners, so they take the exp per voxel; the broad ones the tables, with
    # factors up to e^hundreds whose products are the Gaussian (never inf·0). One set with both.
    grid = _grid(kind)
    sharp, broad, both = _sharp_and_broad(grid, seed=31)
    assert _exp_visits(broad, grid, radius=4.0) == 0
    assert _exp_visits(sharp, grid, radius=4.0) > 0
    _check_against_reference(both, grid, radius=4.0)
    _check_against_reference(broad, grid, radius_rule="eigen")


def test_extreme_anisotropy_in_a_large_sphere():
    # ratio 100, tilted, B 20–60 Å² in an 8 Å sphere (past a 10 Å cell): whichever way each atom runs,
    # the map and gradients are the reference's, finite everywhere
    grid = _grid("hexagonal")
    rng = np.random.default_rng(33)
    atoms = AtomSet.from_elements(
        ["C", "Fe", "O"],
        rng.random((3, 3)) @ grid.cell.orth.numpy().T,
        [10.0] * 3,
        u_aniso=_random_u(3, rng, (20.0, 60.0), 100.0),
    )
    assert bool((adp_eigenvalues(atoms.u_aniso)[:, 2] / adp_eigenvalues(atoms.u_aniso)[:, 0] > 99).all())
    _check_against_reference(atoms, grid, radius=8.0)


def _wide_tilted(grid: GridSpec, seed: int) -> AtomSet:
    """Three strongly anisotropic atoms (eigenvalue ratio 12, tilted off the axes, B 40–80 Å²): one in
    the cell, one across the z = 0 face and one across the x = 0 and y = 0 edges, so that with a wide
    sphere their boxes wrap around the cell."""
    rng = np.random.default_rng(seed)
    frac = np.array([[0.45, 0.5, 0.55], [0.4, 0.6, 0.02], [0.99, 0.01, 0.97]])
    return AtomSet.from_elements(
        ["C", "S", "O"],
        frac @ grid.cell.orth.numpy().T,
        [10.0] * 3,
        [1.0, 0.8, 0.6],
        u_aniso=_random_u(3, rng, (40.0, 80.0), max_ratio=12.0),
    )


@pytest.mark.parametrize("kind", ["orthogonal-odd", "hexagonal", "triclinic"])
def test_factor_table_walk_of_wide_tilted_atoms_across_the_cell_faces(kind):
    # 6 Å spheres of 12:1 tilted atoms (rows of 14–23 voxels: the walk's one-block, two-block and
    # many-block planes, blocks that run past the top of the map row and go voxel by voxel, boxes that
    # wrap along every axis), all through the factor tables, against the reference: map and gradients
    grid = _grid(kind)
    atoms = _wide_tilted(grid, seed=51)
    lam = adp_eigenvalues(atoms.u_aniso)
    assert bool((lam[:, 2] / lam[:, 0] >= 11.9).all())
    assert _exp_visits(atoms, grid, radius=6.0) == 0
    _check_against_reference(atoms, grid, radius=6.0)
    _check_against_reference(atoms, grid, radius_rule="eigen")


def test_factor_tables_are_bitwise_the_same_for_any_slab_partition():
    # Every chain of the factor tables starts at the atom's box, and a lane's arithmetic does not depend
    # on the block or the slab it falls in: one slab at one thread, 18 thin slabs at two threads and the
    # default partition give the same bits, fallback atoms and wide wrapping atoms included.
    grid = _grid("monoclinic")
    sharp, broad, both = _sharp_and_broad(grid, seed=32)
    wide = _wide_tilted(grid, seed=52)
    maps = []
    before = torch.get_num_threads()
    try:
        for threads, plan in ((1, {}), (2, {"slabs_per_thread": 9}), (2, {})):
            torch.set_num_threads(threads)
            with density_cpu._plan_hook(**plan):
                maps.append(
                    [density_cpu.splat_cpu(a.to(dtype=F32), grid, radius=4.0) for a in (both, broad)]
                    + [density_cpu.splat_cpu(wide.to(dtype=F32), grid, radius=6.0)]
                )
    finally:
        torch.set_num_threads(before)
    for other in maps[1:]:
        for got, want in zip(other, maps[0]):
            assert torch.equal(got, want)
