"""The C++/OpenMP density splat (backend="cpu") against the float64 reference and gemmi.

Tolerances: forward and gradients use docs/kernels.md's float32 contract
(``assert_kernel_close``: 1e-5·max|ref| + 1e-5·|ref|); the kernel computes in float32
with a polynomial exp (relative error < 3e-7), so it lands ~20× inside that bound.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from kernels.crystal import AtomSet, Cell, GridSpec
from kernels.density import cpu as density_cpu
from kernels.density.radius import cutoff_radius
from kernels.density.reference import splat_reference
from tests.helpers import assert_close, assert_kernel_close, gemmi_density, leaf_atoms, model

SPACING = 2.0 / 3.0


def _leaf(atoms: AtomSet, dtype: torch.dtype) -> AtomSet:
    """Isotropic copy of ``atoms`` (every atom at its B) in ``dtype``, xyz, b_iso and occ requiring grad."""
    return leaf_atoms(atoms.replace(u_aniso=None, aniso=None, _validate=False), dtype)


def _check_against_reference(atoms: AtomSet, grid: GridSpec, radius=None, seed: int = 0) -> torch.Tensor:
    """Forward and all three gradients of the cpu path vs autograd through the reference."""
    a32 = _leaf(atoms.to(dtype=torch.float32), torch.float32)
    # The reference gets the very same (float32-representable) values in float64.
    a64 = _leaf(a32, torch.float64)
    out = kernels.splat_density(a32, grid, radius=radius, backend="cpu")
    ref = splat_reference(a64, grid, radius=radius)
    assert out.dtype == torch.float32 and out.shape == grid.shape
    assert_kernel_close(out, ref)
    # Same voxel set as the reference: r² < R² decided identically (ties included).
    assert torch.equal(out != 0, ref != 0), "voxel set differs from the reference"
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out.backward(upstream.to(torch.float32))
    ref.backward(upstream)
    for name in ("xyz", "b_iso", "occ"):
        got, want = getattr(a32, name).grad, getattr(a64, name).grad
        assert got is not None and got.dtype == torch.float32, name
        assert_kernel_close(got, want)
    return out


# --------------------------------------------------------------------------- real structures


@pytest.mark.parametrize("name", ["1orc", "1pfe", "1aki"])
def test_real_structure_matches_reference(name):
    m = model(name)
    _check_against_reference(m.atoms, GridSpec.for_spacing(m.cell, SPACING))


def test_5h73_matches_reference():
    # 3006 atoms on a hexagonal cell; a coarser grid keeps the float64 autograd reference
    # to a few seconds (the kernel path is the same at any spacing).
    m = model("5h73")
    _check_against_reference(m.atoms, GridSpec.for_spacing(m.cell, 1.0))


@pytest.mark.parametrize("name", ["1orc", "1pfe", "5h73"])
def test_forward_matches_gemmi(name):
    m = model(name)
    grid = GridSpec.for_spacing(m.cell, SPACING)
    out = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, backend="cpu")
    ref = torch.from_numpy(gemmi_density(name, SPACING, 1e-5))
    assert ref.shape == out.shape
    # gemmi sums in float with a fast exp approximation (relative error up to ~1e-5), so
    # the honest bound is 1e-4 e/Å³ (the issue's) plus 1e-5 of gemmi's value.
    assert_close(out, ref, atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------- synthetic cells

_RNG_ELEMENTS = ["C", "N", "O", "S", "Cl", "Fe", "P", "H"]


def _random_atoms(cell: Cell, n: int, seed: int, b_range=(2.0, 60.0)) -> AtomSet:
    rng = np.random.default_rng(seed)
    frac = rng.random((n, 3)) * 1.2 - 0.1  # some atoms outside the cell: wrapping
    xyz = frac @ cell.orth.numpy().T
    els = [_RNG_ELEMENTS[i % len(_RNG_ELEMENTS)] for i in range(n)]
    return AtomSet.from_elements(els, xyz, rng.uniform(*b_range, n), rng.uniform(0.2, 1.0, n))


CELLS = {
    "orthogonal-odd": ((11.0, 12.5, 13.3, 90, 90, 90), (17, 19, 23)),
    "monoclinic": ((12.0, 9.0, 14.0, 90, 104.5, 90), (20, 15, 24)),
    "hexagonal": ((10.0, 10.0, 13.0, 90, 90, 120), (18, 18, 21)),
    "triclinic": ((9.0, 10.0, 11.0, 75, 101.5, 112), (16, 17, 19)),
}


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_synthetic_cells(kind):
    params, shape = CELLS[kind]
    cell = Cell.from_parameters(*params)
    assert cell.kind == kind.split("-")[0]
    grid = GridSpec(cell, shape)
    _check_against_reference(_random_atoms(cell, 24, seed=len(kind)), grid)


# Cells a few times the atoms' reach: most atoms take the kernel's lane-blocked path (their
# z-range does not wrap), the rest (near z = 0 or the top of the cell) the general row path,
# so both are checked against the reference on every cell kind that factors.
BIG_CELLS = {
    "orthogonal": ((24.0, 21.0, 31.0, 90, 90, 90), (36, 32, 48)),
    "monoclinic": ((26.0, 19.0, 33.0, 90, 107.0, 90), (40, 30, 50)),
    "hexagonal": ((23.0, 23.0, 29.0, 90, 90, 120), (36, 36, 45)),
}


@pytest.mark.parametrize("kind", sorted(BIG_CELLS))
def test_big_cells_lane_and_row_paths(kind):
    params, shape = BIG_CELLS[kind]
    cell = Cell.from_parameters(*params)
    assert cell.kind == kind
    atoms = _random_atoms(cell, 40, seed=7 + len(kind))
    # some atoms pinned next to the z faces of the cell: their boxes wrap (row path)
    xyz = atoms.xyz.clone()
    frac = xyz.double() @ cell.frac.T.to(xyz.dtype).double()
    frac[:6, 2] = torch.tensor([0.0, 0.01, 0.03, 0.97, 0.99, 1.0], dtype=frac.dtype)
    atoms = AtomSet(
        (frac @ cell.orth.T.double()).to(xyz.dtype), atoms.b_iso, atoms.occ, atoms.a, atoms.b, atoms.elements
    )
    _check_against_reference(atoms, GridSpec(cell, shape), seed=3)


@pytest.mark.parametrize("kind", ["monoclinic", "triclinic"])
def test_global_radius(kind):
    params, shape = CELLS[kind]
    cell = Cell.from_parameters(*params)
    _check_against_reference(_random_atoms(cell, 16, seed=3), GridSpec(cell, shape), radius=2.5)


def test_tiny_cell_self_overlap():
    # Radius (~4-6 Å at B 20-80) far larger than the 2.6-3.5 Å cell: every atom adds many
    # periodic images of itself to each voxel, along all three axes.
    cell = Cell.from_parameters(2.6, 3.1, 3.5, 82, 97, 104)
    grid = GridSpec(cell, (5, 6, 7))
    atoms = _random_atoms(cell, 3, seed=7, b_range=(20.0, 80.0))
    assert float(cutoff_radius(atoms.b_iso, atoms.a, atoms.b).min()) > 3.5
    _check_against_reference(atoms, grid)
    _check_against_reference(atoms, grid, radius=9.0)


def test_atom_on_cell_corner_with_exact_ties():
    # Atom at the origin of a cubic cell with 0.5 Å voxels and a 2 Å radius: voxels at
    # exactly 2 Å (e.g. (4, 0, 0)) sit on the sphere; r² < R² must decide them as the
    # reference does.
    cell = Cell.from_parameters(10.0, 10.0, 10.0)
    grid = GridSpec(cell, (20, 20, 20))
    atoms = AtomSet.from_elements(["O", "C"], [[0.0, 0.0, 0.0], [10.0, 10.0, 0.0]], [12.0, 30.0])
    out = _check_against_reference(atoms, grid, radius=2.0)
    assert out[0, 0, 0] > 0 and out[19, 19, 0] > 0  # both corners (the same point) got density


@pytest.mark.parametrize("element", ["N", "Cl"])
def test_near_delta_gaussian_at_nucleus(element):
    # N and Cl have a near-delta IT92 term cancelled by a large negative c: at B = 2 the
    # density at the nucleus is a small difference of large terms.
    cell = Cell.from_parameters(12.0, 13.0, 14.0, 90, 98, 90)
    grid = GridSpec(cell, (48, 52, 56))
    frac = np.array([[20 / 48, 26 / 52, 28 / 56]])
    xyz = frac @ cell.orth.numpy().T  # exactly on voxel (20, 26, 28)
    atoms = AtomSet.from_elements([element], xyz, [2.0])
    out = _check_against_reference(atoms, grid)
    ref = splat_reference(atoms, grid)
    nucleus = ref[20, 26, 28]
    assert float(nucleus) == float(ref.max())
    assert abs(float(out.detach()[20, 26, 28]) - float(nucleus)) <= 1e-5 * float(nucleus)


def test_high_b():
    cell = Cell.from_parameters(20.0, 21.0, 22.0, 90, 90, 120)
    grid = GridSpec(cell, (24, 24, 27))
    _check_against_reference(_random_atoms(cell, 10, seed=11, b_range=(150.0, 400.0)), grid)


def test_empty_atom_set():
    cell = Cell.from_parameters(10.0, 11.0, 12.0, 90, 100, 90)
    grid = GridSpec(cell, (10, 11, 12))
    empty = AtomSet.from_elements([], np.zeros((0, 3)), np.zeros(0), dtype=torch.float32)
    xyz = empty.xyz.clone().requires_grad_()
    atoms = AtomSet(xyz, empty.b_iso, empty.occ, empty.a, empty.b, _validate=False)
    out = kernels.splat_density(atoms, grid, backend="cpu")
    assert out.shape == grid.shape and out.dtype == torch.float32 and not out.any()
    out.sum().backward()
    assert xyz.grad.shape == (0, 3)


# --------------------------------------------------------------------------- contract details


def test_auto_picks_cpu_and_float64_warns_once():
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, 1.0)
    from kernels import _util

    _util._warned.discard(("splat_density", torch.float64))
    with pytest.warns(UserWarning, match="float32") as record:
        out = kernels.splat_density(m.atoms, grid)  # float64 atoms, backend="auto"
        kernels.splat_density(m.atoms, grid)
    assert sum("float32" in str(w.message) for w in record) == 1
    assert out.dtype == torch.float32
    assert kernels.resolve_backend("density", "cpu") == "cpu"


def test_box_grid_is_refused():
    m = model("1orc")
    box = GridSpec(m.cell, (8, 8, 8), origin=(2, 3, 4), sampling=(54, 60, 80))
    with pytest.raises(kernels.GridError, match="whole-cell"):
        kernels.splat_density(m.atoms.to(dtype=torch.float32), box, backend="cpu")


def test_radius_rule_matches_torch_version():
    m = model("3o5r")
    a = m.atoms
    for cutoff in (1e-5, 1e-7, 1e-3):
        fast = density_cpu.cutoff_radius_cpu(a.b_iso, a.a, a.b, cutoff)
        slow = cutoff_radius(a.b_iso, a.a, a.b, cutoff)
        assert float((fast - slow).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="cutoff"):
        density_cpu.cutoff_radius_cpu(a.b_iso, a.a, a.b, -1.0)


def _run_with_threads(n: int, atoms: AtomSet, grid: GridSpec, upstream: torch.Tensor, **plan):
    """Map and gradients (xyz, b_iso, occ) at ``n`` threads; ``plan``: the kernel's private
    plan (:func:`~kernels.density.cpu._plan_hook`; none: the public path)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        leaf = _leaf(atoms, torch.float32)
        if plan:
            with density_cpu._plan_hook(**plan):
                out = density_cpu.splat_cpu(leaf, grid)
        else:
            out = kernels.splat_density(leaf, grid, backend="cpu")
        out.backward(upstream)
        return out.detach(), leaf.xyz.grad, leaf.b_iso.grad, leaf.occ.grad
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cutoff", [1e-5, 1e-3])
def test_radii_from_the_cutoff_inside_the_kernel(cutoff):
    # With radius=None the kernel derives each atom's radius from the cutoff in its per-atom
    # preparation (forward and backward); that must be exactly cutoff_radius_cpu's radius,
    # passed in as an array: bitwise the same map and gradients, at either cutoff.
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, SPACING)
    atoms = m.atoms.to(dtype=torch.float32)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(4))
    radii = density_cpu.cutoff_radius_cpu(atoms.b_iso, atoms.a, atoms.b, cutoff)

    def run(given):
        leaf = _leaf(atoms, torch.float32)
        if given:
            frac = (leaf.xyz.detach().double() @ grid.cell.frac.T).contiguous()
            call = density_cpu._CpuSplat(grid, frac, radii, cutoff, keep_rows=True)
            out = density_cpu._SplatCPU.apply(call, leaf.xyz, leaf.b_iso, leaf.occ, leaf.a, leaf.b)
        else:
            out = kernels.splat_density(leaf, grid, backend="cpu", cutoff=cutoff)
        out.backward(upstream)
        return out.detach(), leaf.xyz.grad, leaf.b_iso.grad, leaf.occ.grad

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_bitwise_deterministic_across_runs_and_thread_counts():
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, SPACING)
    atoms = m.atoms.to(dtype=torch.float32)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(5))
    one = _run_with_threads(1, atoms, grid, upstream)
    two = _run_with_threads(2, atoms, grid, upstream)
    again = _run_with_threads(2, atoms, grid, upstream)
    for a, b, c in zip(one, two, again):
        assert torch.equal(a, b) and torch.equal(b, c)


def _big_cell_case(kind: str, n_atoms: int, seed: int, grad_seed: int):
    """Random float32 atoms in one of BIG_CELLS, its grid and a random upstream gradient."""
    params, shape = BIG_CELLS[kind]
    cell = Cell.from_parameters(*params)
    grid = GridSpec(cell, shape)
    atoms = _random_atoms(cell, n_atoms, seed=seed).to(dtype=torch.float32)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(grad_seed))
    return atoms, grid, upstream


def test_bitwise_deterministic_monoclinic_lanes():
    # The monoclinic lane path (2-D (x,z) lane tables, rows wrapping along z) split over
    # slabs differently at 1 and 2 threads: still bitwise the same map and gradients.
    atoms, grid, upstream = _big_cell_case("monoclinic", 60, seed=11, grad_seed=2)
    one = _run_with_threads(1, atoms, grid, upstream)
    two = _run_with_threads(2, atoms, grid, upstream)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", sorted(BIG_CELLS))
def test_slab_count_does_not_change_results(kind):
    # The forward's slab count (a private tuning option) moves where atoms are split between
    # slabs; every voxel still receives its atoms in one global order: bitwise the same.
    atoms, grid, upstream = _big_cell_case(kind, 60, seed=7, grad_seed=3)
    first = _run_with_threads(1, atoms, grid, upstream, slabs_per_thread=1)
    # 0: the default slabs of decreasing size, taken by whichever thread is free
    for per_thread, threads in ((3, 1), (1, 2), (2, 2), (4, 2), (7, 3), (0, 2), (0, 3)):
        other = _run_with_threads(threads, atoms, grid, upstream, slabs_per_thread=per_thread)
        for a, b in zip(first, other):
            assert torch.equal(a, b), (per_thread, threads)


def _forward_slabs(atoms: AtomSet, grid: GridSpec, threads: int, **plan) -> int:
    """How many slabs one forward of ``atoms`` cut the map into at ``threads`` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), density_cpu._plan_hook(**plan) as record:
            density_cpu.splat_cpu(atoms, grid)
    finally:
        torch.set_num_threads(previous)
    return record.forward[0]["tasks"]


def test_default_slab_count_follows_the_cost_of_splitting_atoms():
    # Each slab edge splits the atoms whose boxes cross it, and every piece repeats its atom's set-up
    # (measured: an edge costs 4 % of 1AKI's forward at 0.667 Å). The default schedule keeps the edges'
    # estimated cost within a few per cent: a small map gets one slab per thread, a map with many
    # atoms along a long x axis the decreasing slabs that hedge against a slowed thread.
    small = model("1aki")
    small_grid = GridSpec.for_spacing(small.cell, SPACING)
    small_atoms = small.atoms.to(dtype=torch.float32)
    assert _forward_slabs(small_atoms, small_grid, 2) == 2
    assert _forward_slabs(small_atoms, small_grid, 3) == 3
    large = model("3wip")
    large_grid = GridSpec.for_spacing(large.cell, SPACING)
    n_large = _forward_slabs(large.atoms.to(dtype=torch.float32), large_grid, 2)
    assert 4 < n_large <= 16, n_large
    # one thread: one slab, unless a benchmark asks for equal slabs
    assert _forward_slabs(small_atoms, small_grid, 1) == 1
    assert _forward_slabs(small_atoms, small_grid, 1, slabs_per_thread=3) == 3


@pytest.mark.skipif(
    density_cpu._scatter.build_info()["backward_isa"] != "x86-64-v4",
    reason="the 16-lane backward runs only in the kernel's AVX-512 (x86-64-v4) variant, which this CPU or build "
    "does not take: both runs would take 8 lanes and compare a path with itself",
)
@pytest.mark.parametrize("kind", sorted(BIG_CELLS))
def test_backward_lane_width_does_not_change_gradients(kind):
    # On CPUs that run the kernel's AVX-512 variant the backward contracts 16 lanes at a time
    # (boxes rounded up to whole 16-lane blocks, the extra lanes wrapping past the top of the
    # cell); every lane's arithmetic is that of the 8-lane blocks, so forcing 8 lanes must
    # give bitwise the same gradients.
    atoms, grid, upstream = _big_cell_case(kind, 60, seed=9, grad_seed=5)
    picked = _run_with_threads(2, atoms, grid, upstream)
    eight = _run_with_threads(2, atoms, grid, upstream, lanes=8)
    for a, b in zip(picked, eight):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["hexagonal", "monoclinic"])
def test_backward_reuses_forward_rows(kind):
    # With a gradient wanted, the forward keeps every lane-path atom's row intervals and
    # the backward reads them instead of solving again. The atoms' x-ranges are split over
    # slabs at 2 threads, so the kept rows are written by several slabs; solving again
    # (keep_rows=False) must give bitwise the same gradients.
    atoms, grid, upstream = _big_cell_case(kind, 50, seed=4, grad_seed=6)
    kept = _run_with_threads(2, atoms, grid, upstream)
    leaf = _leaf(atoms, torch.float32)
    with density_cpu._plan_hook() as record:  # the default plan, recorded
        out = kernels.splat_density(leaf, grid, backend="cpu")
        assert out.grad_fn.state.rows is not None
        out.backward(upstream)
    assert record.backward[0]["rows_reused"] > 25  # most atoms take the lane path
    for got, want in zip((out.detach(), leaf.xyz.grad, leaf.b_iso.grad, leaf.occ.grad), kept):
        assert torch.equal(got, want)
    solved = _run_with_threads(2, atoms, grid, upstream, keep_rows=False)
    with density_cpu._plan_hook(keep_rows=False):
        out = density_cpu.splat_cpu(_leaf(atoms, torch.float32), grid)
    assert out.grad_fn.state.rows is None
    for a, b in zip(kept, solved):
        assert torch.equal(a, b)
    _check_against_reference(atoms, grid, seed=8)


# Cells for the float interval pass: voxels of ~0.6 Å, the lane path for every atom.
NEAR_TIE_CELLS = {
    "orthogonal": ((20.0, 21.0, 22.0, 90, 90, 90), (32, 34, 36)),
    "monoclinic": ((21.0, 19.0, 23.0, 90, 104.0, 90), (34, 30, 36)),
    "hexagonal": ((20.0, 20.0, 22.0, 90, 90, 120), (32, 32, 36)),
}


def _near_tie_radii(cell: Cell, shape, frac: torch.Tensor, seed: int):
    """Per-atom radii that put one row end of each atom 1e-7..1e-4 voxel from a lattice point.

    For atom i a voxel (ix, iy, w) is picked (a few voxels from its centre, or next to the vertex
    of its row: a grazing row); R² = r²(w) + δ·dr²/dw
    moves the root of that row's quadratic to w + δ (δ log-uniform in ±[1e-7, 1e-4] voxel), and
    a few atoms get δ = 0 (R = the voxel's distance: a tie or a near tie in double).
    Returns the radii (float64) and the roots' offsets from w, solved again in double.
    """
    rng = np.random.default_rng(seed)
    g = cell.metric.numpy()
    m = np.asarray(shape, dtype=np.float64)
    f = frac.numpy()
    n = f.shape[0]
    ix = np.floor(f[:, 0] * m[0]) + rng.choice([-2, -1, 2, 3], n)  # >= 1 voxel off: R > 0.5 Å
    iy = np.floor(f[:, 1] * m[1]) + rng.integers(-2, 3, n)
    up = rng.random(n) < 0.5
    dx, dy = ix / m[0] - f[:, 0], iy / m[1] - f[:, 1]
    q = g[0, 0] * dx * dx + g[1, 1] * dy * dy + 2 * g[0, 1] * dx * dy
    lz = 2 * g[0, 2] * dx + 2 * g[1, 2] * dy
    # half of the rows end a few voxels from the centre, the other half graze the sphere: w is
    # the lattice point next to the row's vertex wc, so the row is < 1 voxel long (there the
    # float roots are least accurate)
    wc = f[:, 2] * m[2] - lz * m[2] / (2 * g[2, 2])
    far = np.floor(f[:, 2] * m[2]) + np.where(up, rng.integers(2, 4, n), -rng.integers(1, 3, n))
    w = np.where(rng.random(n) < 0.5, far, np.where(up, np.ceil(wc), np.floor(wc)))
    dz = w / m[2] - f[:, 2]
    r2 = q + lz * dz + g[2, 2] * dz * dz
    deriv = (lz + 2 * g[2, 2] * dz) / m[2]  # dr²/dw, w in voxels
    delta = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-7, -4, n)
    delta[:4] = 0.0
    r2_target = r2 + deriv * delta
    # where the row's root lies now, relative to w (voxels)
    root = f[:, 2] * m[2] + m[2] * (-lz + np.where(up, 1, -1) * np.sqrt(lz * lz - 4 * g[2, 2] * (q - r2_target))) / (
        2 * g[2, 2]
    )
    return torch.from_numpy(np.sqrt(r2_target)), root - w


@pytest.mark.parametrize("kind", sorted(NEAR_TIE_CELLS))
def test_float_row_intervals_near_lattice_points(kind):
    # The lane path solves each row's z interval in float and settles in double every row
    # whose float end lies within a bound on its float error of a lattice point. Here every
    # atom has a row end 1e-7..1e-4 voxel from a lattice point (float rounding of the ends
    # is ~1e-6..1e-5 voxel): the maps and gradients must be bitwise those of the double
    # pass (float_rows=False), and the voxel sets identical. A band narrower than the
    # float error fails this (checked by shrinking it in the kernel).
    params, shape = NEAR_TIE_CELLS[kind]
    cell = Cell.from_parameters(*params)
    assert cell.kind == kind
    grid = GridSpec(cell, shape)
    atoms = _random_atoms(cell, 60, seed=11 + len(kind), b_range=(30.0, 60.0)).to(dtype=torch.float32)
    frac = (atoms.xyz.to(torch.float64) @ cell.frac.T).contiguous()  # as the kernel forms it
    radii, offset = _near_tie_radii(cell, shape, frac, seed=len(kind))
    assert (offset[:4] == 0).all() or np.abs(offset[:4]).max() < 1e-9
    near = np.abs(offset[4:])
    assert near.min() > 0.5e-7 and near.max() < 2e-4  # the construction did what it says
    assert 0.5 < float(radii.min()) and float(radii.max()) < 3.5
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(2))

    def run(threads: int, float_rows: bool):
        # keep_rows=False: the backward solves the rows too
        plan = density_cpu._Plan({"keep_rows": False, "float_rows": float_rows})
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            leaf = _leaf(atoms, torch.float32)
            call = density_cpu._CpuSplat(grid, frac, radii, 1e-5, plan=plan)
            out = density_cpu._SplatCPU.apply(call, leaf.xyz, leaf.b_iso, leaf.occ, leaf.a, leaf.b)
            out.backward(upstream)
            return out.detach(), leaf.xyz.grad, leaf.b_iso.grad, leaf.occ.grad
        finally:
            torch.set_num_threads(before)

    fast = run(2, float_rows=True)
    assert (fast[0] != 0).sum() > 1000
    exact = run(2, float_rows=False)
    assert torch.equal(fast[0] != 0, exact[0] != 0), "float intervals changed the voxel set"
    for a, b in zip(fast, exact):
        assert torch.equal(a, b)
    for a, b in zip(run(1, float_rows=True), fast):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- std::thread build


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the system g++ to build the std::thread variant")
def test_no_openmp_build_gives_identical_maps(tmp_path):
    # Build the same sources with -DKERNELS_NO_OPENMP (what CMakeLists.txt does where the compiler
    # has no OpenMP), import the module and compare with the installed OpenMP build. The
    # translation units compile in parallel; nanobind's runtime at -O0 (it only converts arguments).
    import nanobind

    here = Path(density_cpu.__file__).parent
    nb_src = Path(nanobind.include_dir()).parent / "src"
    includes = [
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{nanobind.include_dir()}",
        f"-I{nb_src.parent / 'ext' / 'robin_map' / 'include'}",
    ]
    common = ["g++", "-c", "-fPIC", "-std=c++17", "-pthread", "-DKERNELS_NO_OPENMP", *includes]
    ours = ["-O1", "-fno-math-errno", "-Wall", "-Werror"]
    # A source marked "Compiled once per variant" is compiled once per instruction set, as
    # CMakeLists.txt compiles it (kernels/density/gaussians.hpp: KERNELS_ISA).
    units = {}
    for src in sorted(here.glob("*.cpp")):
        if "// Compiled once per variant" in src.read_text():
            for isa in (0, 3, 4):
                units[f"{src.stem}_isa{isa}.o"] = [*ours, f"-DKERNELS_ISA={isa}", str(src)]
        else:
            units[f"{src.stem}.o"] = [*ours, str(src)]
    units |= {
        "nanobind.o": ["-O0", "-fno-strict-aliasing", "-DNB_COMPACT_ASSERTIONS", str(nb_src / "nb_combined.cpp")],
    }
    jobs = [
        subprocess.Popen([*common, *args, "-o", str(tmp_path / obj)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for obj, args in units.items()
    ]
    for job in jobs:
        log = job.communicate()[0].decode()
        assert job.returncode == 0, log
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    target = tmp_path / "noomp" / f"_scatter{ext}"
    target.parent.mkdir()
    link = ["g++", "-shared", "-pthread", *(str(tmp_path / obj) for obj in units), "-o", str(target)]
    subprocess.run(link, check=True, capture_output=True, text=True)
    script = textwrap.dedent(
        f"""
        import importlib.util, sys, torch
        spec = importlib.util.spec_from_file_location("_scatter", {str(target)!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        assert mod.build_info()["threads"] == "std::thread", mod.build_info()
        from kernels.density import cpu
        cpu._scatter = mod
        from tests.helpers import model
        import kernels
        m = model("1pfe")
        grid = kernels.GridSpec.for_spacing(m.cell, 1.0)
        atoms = m.atoms.to(dtype=torch.float32)
        maps = []
        for n in (1, 2):
            torch.set_num_threads(n)
            xyz = atoms.xyz.clone().requires_grad_()
            leaf = kernels.AtomSet(
                xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, u_aniso=atoms.u_aniso, aniso=atoms.aniso,
                _validate=False,
            )
            assert leaf.u_aniso is not None  # 1PFE: the anisotropic path of the std::thread build
            out = cpu.splat_cpu(leaf, grid)
            out.backward(torch.ones_like(out))
            maps.append((out.detach(), xyz.grad))
        torch.save(maps, {str(tmp_path / "maps.pt")!r})
        """
    )
    root = Path(kernels.__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, capture_output=True, text=True)
    maps = torch.load(tmp_path / "maps.pt")
    m = model("1pfe")
    grid = GridSpec.for_spacing(m.cell, 1.0)
    atoms = m.atoms.to(dtype=torch.float32)
    ref = splat_reference(atoms.to(dtype=torch.float64), grid)
    for out, gx in maps:
        assert_kernel_close(out, ref)
        assert torch.equal(out, maps[0][0]) and torch.equal(gx, maps[0][1])


# --------------------------------------------------------------------------- frames (splat_frames_cpu)


def _frames(cell: Cell, n_atoms: int, n_frames: int, seed: int) -> AtomSet:
    """``n_frames`` frames of the same ``n_atoms`` random atoms (frame-major), each frame's
    positions, B and occupancies drawn anew."""
    frames = [_random_atoms(cell, n_atoms, seed=seed + f) for f in range(n_frames)]
    return AtomSet(
        torch.cat([f.xyz for f in frames]),
        torch.cat([f.b_iso for f in frames]),
        torch.cat([f.occ for f in frames]),
        torch.cat([f.a for f in frames]),
        torch.cat([f.b for f in frames]),
    ).to(dtype=torch.float32)


def _frame(atoms: AtomSet, f: int, n: int) -> AtomSet:
    return _leaf(atoms.select(list(range(f * n, (f + 1) * n))), torch.float32)


@pytest.mark.parametrize("kind", ["orthogonal", "monoclinic", "hexagonal", "triclinic"])
@pytest.mark.parametrize("threads", [1, 2])
def test_frames_are_the_single_splats_bitwise(kind, threads):
    # Map f and frame f's gradients are exactly what splat_cpu gives for frame f alone (the same
    # voxel order per map, the same per-atom gather), whatever the thread count.
    params, shape = {**CELLS, **BIG_CELLS}[kind]  # BIG_CELLS: lane paths; triclinic: the full exponent
    cell = Cell.from_parameters(*params)
    grid = GridSpec(cell, shape)
    n, n_frames = 25, 3
    atoms = _frames(cell, n, n_frames, seed=40)
    upstream = torch.randn((n_frames, *grid.shape), generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaf = _leaf(atoms, torch.float32)
        maps = density_cpu.splat_frames_cpu(leaf, grid, n_frames=n_frames)
        assert maps.shape == (n_frames, *grid.shape) and maps.dtype == torch.float32
        maps.backward(upstream)
        for f in range(n_frames):
            single = _frame(atoms, f, n)
            one = density_cpu.splat_cpu(single, grid)
            one.backward(upstream[f])
            assert torch.equal(maps[f].detach(), one.detach()), f
            rows = slice(f * n, (f + 1) * n)
            for name in ("xyz", "b_iso", "occ"):
                assert torch.equal(getattr(leaf, name).grad[rows], getattr(single, name).grad), (f, name)
    finally:
        torch.set_num_threads(before)


def test_frames_with_one_radius_and_against_the_reference():
    # A fixed radius, and the float64 reference of each frame as the truth (forward and gradients).
    params, shape = CELLS["monoclinic"]
    cell = Cell.from_parameters(*params)
    grid = GridSpec(cell, shape)
    n, n_frames = 6, 2
    atoms = _frames(cell, n, n_frames, seed=3)
    leaf = _leaf(atoms, torch.float32)
    maps = density_cpu.splat_frames_cpu(leaf, grid, n_frames=n_frames, radius=3.0)
    upstream = torch.randn((n_frames, *grid.shape), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    maps.backward(upstream.to(torch.float32))
    for f in range(n_frames):
        ref_atoms = _leaf(_frame(atoms, f, n), torch.float64)
        ref = splat_reference(ref_atoms, grid, radius=3.0)
        assert_kernel_close(maps[f].detach(), ref.detach())
        ref.backward(upstream[f])
        rows = slice(f * n, (f + 1) * n)
        for name in ("xyz", "b_iso", "occ"):
            assert_kernel_close(getattr(leaf, name).grad[rows], getattr(ref_atoms, name).grad)


def test_frames_edge_cases():
    cell = Cell.from_parameters(*CELLS["orthogonal-odd"][0])
    grid = GridSpec(cell, CELLS["orthogonal-odd"][1])
    atoms = _frames(cell, 4, 2, seed=9)
    one = density_cpu.splat_frames_cpu(atoms, grid, n_frames=1)
    assert one.shape == (1, *grid.shape) and torch.equal(one[0], density_cpu.splat_cpu(atoms, grid))
    empty = atoms.select([])
    zeros = density_cpu.splat_frames_cpu(empty, grid, n_frames=3)
    assert zeros.shape == (3, *grid.shape) and not zeros.any()
    with pytest.raises(ValueError, match="do not split into 3 frames"):
        density_cpu.splat_frames_cpu(atoms, grid, n_frames=3)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n_frames must be a positive integer"):
            density_cpu.splat_frames_cpu(atoms, grid, n_frames=bad)


# --------------------------------------------------------------------------- out=


def test_out_is_filled_in_place_and_returned():
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, SPACING)
    atoms = m.atoms.to(dtype=torch.float32)
    want = kernels.splat_density(atoms, grid, backend="cpu")
    out = torch.full(grid.shape, float("nan"))  # every voxel must be overwritten
    got = kernels.splat_density(atoms, grid, out=out)
    assert got is out and torch.equal(out, want)
    out.fill_(7.0)
    assert kernels.splat_density(atoms, grid, out=out) is out and torch.equal(out, want)
    # atoms that require grad are fine where no gradient is recorded
    leaf = _leaf(atoms, torch.float32)
    with torch.no_grad():
        assert torch.equal(kernels.splat_density(leaf, grid, out=out), want)


def test_out_that_does_not_fit_is_refused():
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, SPACING)
    atoms = m.atoms.to(dtype=torch.float32)
    nx, ny, nz = grid.shape
    cases = [
        (torch.empty(nx, ny, nz + 1), "shape is"),
        (torch.empty(grid.shape, dtype=torch.float64), "dtype is torch.float64"),
        (torch.empty(nz, ny, nx).permute(2, 1, 0), "not contiguous"),
        (np.empty(grid.shape, dtype=np.float32), "must be a torch.Tensor"),
        (torch.empty(grid.shape, requires_grad=True), "not differentiable"),
    ]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            kernels.splat_density(atoms, grid, out=out)
    with pytest.raises(ValueError, match="not differentiable"):
        kernels.splat_density(_leaf(atoms, torch.float32), grid, out=torch.empty(grid.shape))
    with pytest.raises(ValueError, match="cpu density backend only"):
        kernels.splat_density(atoms, grid, out=torch.empty(grid.shape), backend="reference")


def test_fractional_positions_round_as_torch_matmul():
    # The kernel forms frac·xyz itself (on the calling thread) and relies on it being the product
    # the reference forms (kernels.density.positions, one rounded op at a time in a fixed order, on
    # every CPU): voxel membership at exact ties depends on it.
    from kernels.density.positions import _fractional

    for params in [(31.2, 47.3, 55.1, 81, 97, 104), (12.0, 9.0, 14.0, 90, 104.5, 90), (10, 10, 13, 90, 90, 120)]:
        cell = Cell.from_parameters(*params)
        xyz = (torch.rand(5000, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 200 - 50).float()
        got = torch.empty(5000, 3, dtype=torch.float64)
        near = density_cpu._scatter.fractional(got, xyz, cell.frac.contiguous(), -1e9, 1e9)
        assert near
        assert torch.equal(got, _fractional(xyz, cell)), params
    far = torch.tensor([[1e6, 0.0, 0.0]])
    assert not density_cpu._scatter.fractional(
        torch.empty(1, 3, dtype=torch.float64), far, cell.frac.contiguous(), -1, 2
    )


def test_concurrent_calls_from_host_threads_agree():
    # The kernel's helper threads serve one call at a time; a call made while they are busy runs
    # on its own thread. Either way the map and gradients are bitwise those of a lone call.
    import concurrent.futures

    atoms, grid, upstream = _big_cell_case("monoclinic", 60, seed=13, grad_seed=4)
    want = _run_with_threads(2, atoms, grid, upstream)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:

        def call(_):
            leaf = _leaf(atoms, torch.float32)
            out = density_cpu.splat_cpu(leaf, grid)
            out.backward(upstream)
            return out.detach(), leaf.xyz.grad, leaf.b_iso.grad, leaf.occ.grad

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(call, range(8)))
    finally:
        torch.set_num_threads(before)
    for got in results:
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_importing_the_cpu_backend_runs_nothing_until_its_first_call():
    # Importing kernels.density.cpu only defines things: whether the kernel shares torch's OpenMP
    # runtime (read from /proc/self/maps) is decided at the first kernel call, and then as before.
    script = textwrap.dedent(
        """
        import builtins, torch
        opened = []
        real_open = builtins.open
        def recording_open(file, *args, **kwargs):
            opened.append(str(file))
            return real_open(file, *args, **kwargs)
        builtins.open = recording_open
        from kernels.crystal import AtomSet, Cell, GridSpec
        from kernels.density import cpu
        assert "/proc/self/maps" not in opened, opened
        assert not cpu._scatter.build_info()["shared_openmp"]
        atoms = AtomSet.from_elements(["C"], [[1.0, 2.0, 3.0]], [20.0]).to(dtype=torch.float32)
        grid = GridSpec(Cell.from_parameters(10, 10, 10, 90, 90, 90), (16, 16, 16))
        cpu.splat_cpu(atoms, grid)
        builtins.open = real_open
        assert cpu._scatter.build_info()["shared_openmp"] == cpu._openmp_is_torchs()
        """
    )
    root = Path(kernels.__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_torchs_openmp_threads_and_the_kernels_own_give_the_same_results():
    # Where the extension's OpenMP runtime is torch's (with pip's torch on Linux both name
    # libgomp.so.1, and `import torch` loads torch's first), the parallel loops run on torch's
    # intra-op threads, awake right after the caller's torch ops; otherwise on the kernel's own
    # threads. The map and every gradient are bitwise the same either way (isotropic and
    # anisotropic paths, 2 threads).
    info = density_cpu._kernel().build_info()
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"  # pip's Linux wheels of torch
    if sys.platform.startswith("linux") and info["openmp_library"] and bundled.exists():
        assert info["shared_openmp"], info
        assert Path(info["openmp_library"]).resolve() == bundled.resolve(), info
    m = model("1pfe")  # every atom anisotropic
    grid = GridSpec.for_spacing(m.cell, SPACING)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(8))

    def run(atoms: AtomSet):
        leaf = leaf_atoms(atoms.to(dtype=torch.float32), torch.float32)
        out = kernels.splat_density(leaf, grid, backend="cpu")
        out.backward(upstream)
        grads = [leaf.xyz.grad, leaf.b_iso.grad, leaf.occ.grad]
        return [out.detach(), *grads, *([] if leaf.u_aniso is None else [leaf.u_aniso.grad])]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = {}
        for shared in (True, False):
            density_cpu._scatter.set_shared_openmp(shared)
            results[shared] = [run(m.atoms), run(m.atoms.replace(u_aniso=None, aniso=None, _validate=False))]
    finally:
        density_cpu._scatter.set_shared_openmp(info["shared_openmp"])
        torch.set_num_threads(before)
    for torch_team, own in zip(results[True], results[False]):
        assert len(torch_team) == len(own)
        for a, b in zip(torch_team, own):
            assert torch.equal(a, b)


def test_map_storage_is_reused_only_after_the_map_is_freed():
    # A freed map's memory serves the next map of its size (no fresh pages to fault in); a map in
    # use is never handed out again, and every voxel of a reused block is written anew.
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, SPACING)
    atoms = m.atoms.to(dtype=torch.float32)
    first = kernels.splat_density(atoms, grid, backend="cpu")
    want = first.clone()
    second = kernels.splat_density(atoms, grid, backend="cpu")
    assert second.data_ptr() != first.data_ptr()
    ptr = first.data_ptr()
    first.fill_(float("nan"))  # what a reused block holds before the kernel writes it
    del first
    third = kernels.splat_density(atoms, grid, backend="cpu")
    assert third.data_ptr() == ptr
    assert torch.equal(third, want) and torch.equal(second, want)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork (POSIX)")
def test_kernel_in_a_forked_child_after_the_helpers_started():
    # A forked child has none of the parent's threads: neither the kernel's helpers (its loops never
    # wait for a helper to arrive) nor torch's OpenMP team, which the parent's loops ran on where it
    # is shared and which the child stops using. A 2-thread splat in the child runs on its own
    # thread and gives the same map. (The child calls the extension directly on numpy arrays: torch's own OpenMP ops hang in
    # a child forked after they ran multi-threaded, which is torch's limitation, not the kernel's.)
    script = textwrap.dedent(
        """
        import os, sys, numpy as np, torch
        import kernels
        from kernels.density import cpu
        from tests.helpers import model
        m = model("1orc")
        grid = kernels.GridSpec.for_spacing(m.cell, 1.0)
        atoms = m.atoms.to(dtype=torch.float32)
        frac = (atoms.xyz.to(torch.float64) @ grid.cell.frac.T).contiguous().numpy()
        f32 = [t.contiguous().numpy() for t in (atoms.b_iso, atoms.occ, atoms.a, atoms.b)]
        cell = cpu._kernel_cell(grid)
        katoms = cpu._scatter.Atoms(frac, *f32, cutoff=1e-5)
        want = np.empty(grid.shape, dtype=np.float32)
        cpu._scatter.splat(want, cell, katoms, n_threads=2)  # starts the helper
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            got = np.empty(grid.shape, dtype=np.float32)
            cpu._scatter.splat(got, cell, katoms, n_threads=2)
            os.write(w, b"1" if np.array_equal(got, want) else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        sys.exit(0 if os.read(r, 1) == b"1" else 1)
        """
    )
    root = Path(kernels.__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
