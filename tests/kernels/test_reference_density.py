"""The float64 reference splat: against gemmi on real structures, against a brute-force
sum over periodic images on synthetic cells, and its gradients by gradcheck."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import kernels
import kernels.testing
from kernels.density.reference import splat_reference
from tests.helpers import STRUCTURES, assert_close, gemmi_density, model, requires_cuda

SPACING = 2.0 / 3.0  # gemmi's d_min = 2.0 at its rate 1.5


@pytest.mark.parametrize("name", ["1orc", "1pfe", "1aki", "3o5r", "5h73", "3wip"])
def test_grid_shape_matches_gemmi(name):
    m = model(name)
    _, dc = kernels.testing.gemmi_density_calculator(STRUCTURES[name], SPACING)
    assert kernels.GridSpec.for_spacing(m.cell, SPACING, m.spacegroup).shape == tuple(dc.grid.shape)


@pytest.mark.parametrize("name", ["1orc", "1pfe", "1aki", "3o5r", "5h73", pytest.param("3wip", marks=pytest.mark.slow)])
def test_reference_matches_gemmi(name):
    m = model(name)
    grid = kernels.GridSpec.for_spacing(m.cell, SPACING, m.spacegroup)
    rho = kernels.splat_density(m.atoms, grid, backend="reference")
    assert rho.dtype == torch.float64
    ref = torch.from_numpy(gemmi_density(name, SPACING, 1e-5))
    # 1e-4 e/Å³ on every voxel, plus gemmi's own error: its float density sum uses a fast
    # exp approximation with relative error up to 1e-5 (gemmi formfact.hpp,
    # unsafe_expapprox), which alone reaches 1.7e-4 at 3o5r's 17 e/Å³ peaks.
    assert_close(rho, ref, atol=1e-4, rtol=1e-5)


def brute_force_density(atoms: kernels.AtomSet, grid: kernels.GridSpec, radius: torch.Tensor) -> torch.Tensor:
    """Σ over atoms, over every lattice translation, of the atom's density at each voxel
    within its radius: a direct transcription of the definition (slow, small cases only)."""
    pos = grid.voxel_positions().reshape(-1, 3)
    out = torch.zeros(pos.shape[0], dtype=torch.float64)
    orth = grid.cell.orth
    for i in range(len(atoms)):
        r = float(radius[i])
        reach = [int(math.ceil(r * float(torch.linalg.norm(grid.cell.frac[k])))) + 1 for k in range(3)]
        width = atoms.b[i] + atoms.b_iso[i]
        amp = atoms.occ[i] * atoms.a[i] * (4 * math.pi / width) ** 1.5
        for t in itertools.product(*(range(-n, n + 1) for n in reach)):
            centre = atoms.xyz[i] + orth @ torch.tensor(t, dtype=torch.float64)
            r2 = ((pos - centre) ** 2).sum(1)
            inside = r2 < r * r
            out[inside] += (amp * torch.exp(-4 * math.pi**2 * r2[inside, None] / width)).sum(1)
    return out.reshape(grid.shape)


SYNTHETIC_CELLS = {
    "tiny-self-overlap": ((4.0, 5.0, 6.0, 90, 90, 90), (6, 7, 8)),
    "hexagonal": ((12.0, 12.0, 15.0, 90, 90, 120), (16, 16, 20)),
    "monoclinic": ((11.0, 13.0, 14.0, 90, 107.5, 90), (15, 18, 18)),
    "triclinic": ((10.0, 11.0, 12.0, 77, 84, 101), (14, 15, 16)),
}


@pytest.mark.parametrize("case", sorted(SYNTHETIC_CELLS))
def test_reference_matches_brute_force_on_synthetic_cells(case):
    params, shape = SYNTHETIC_CELLS[case]
    cell = kernels.Cell.from_parameters(*params)
    grid = kernels.GridSpec(cell, shape)
    # a corner atom, an atom on an edge, a nitrogen and a chlorine at low B, a high-B sulfur
    frac = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 1.0], [0.31, 0.62, 0.17], [0.8, 0.25, 0.55], [0.1, 0.9, 0.4]])
    xyz = frac.double() @ cell.orth.T
    atoms = kernels.AtomSet.from_elements(
        ["C", "O", "N", "Cl", "S"], xyz, [15.0, 8.0, 2.0, 2.0, 80.0], [1, 0.5, 1, 1, 0.7]
    )
    radius = kernels.cutoff_radius(atoms.b_iso, atoms.a, atoms.b, 1e-5)
    if case == "tiny-self-overlap":
        assert float(radius.max()) > min(params[:3]), "this case must have spheres larger than the cell"
    rho = splat_reference(atoms, grid)
    expect = brute_force_density(atoms, grid, radius)
    assert_close(rho, expect, atol=1e-10, rtol=1e-10)


def test_global_radius_and_periodic_wrap_of_a_corner_atom():
    cell = kernels.Cell.from_parameters(20.0, 20.0, 20.0)
    grid = kernels.GridSpec(cell, (20, 20, 20))
    atoms = kernels.AtomSet.from_elements(["O"], [[0.0, 0.0, 0.0]], [10.0])
    rho = splat_reference(atoms, grid, radius=3.0)
    # the eight corners of the cell are one voxel; the density is symmetric about it
    assert torch.allclose(rho[1, 0, 0], rho[-1, 0, 0]) and torch.allclose(rho[0, 2, 0], rho[0, -2, 0])
    r2 = (grid.voxel_positions() - torch.tensor([20.0, 20.0, 20.0])).pow(2).sum(-1)
    nonzero = rho > 0
    within = (grid.voxel_positions().pow(2).sum(-1) < 9) | (r2 < 9)
    assert nonzero.sum() > 0 and not (nonzero & ~within.any()).any()
    assert_close(rho, brute_force_density(atoms, grid, torch.tensor([3.0])), atol=1e-12, rtol=1e-12)


def test_nitrogen_at_low_b_is_finite_and_positive_at_the_nucleus():
    cell = kernels.Cell.from_parameters(10.0, 10.0, 10.0)
    grid = kernels.GridSpec(cell, (40, 40, 40))
    atoms = kernels.AtomSet.from_elements(["N"], [[5.0, 5.0, 5.0]], [2.0])
    rho = splat_reference(atoms, grid)
    peak = rho[20, 20, 20]
    expect = float((atoms.a[0] * (4 * math.pi / (atoms.b[0] + 2.0)) ** 1.5).sum())
    assert torch.isfinite(rho).all() and float(peak) == pytest.approx(expect, rel=1e-12)
    assert float(peak) > 10 and float(peak) == float(rho.max())


def test_electron_count_and_empty_atom_set():
    m = model("1orc")
    grid = kernels.GridSpec.for_spacing(m.cell, 0.5, m.spacegroup)
    rho = splat_reference(m.atoms, grid, cutoff=1e-8)
    # ∑ρ·ΔV counts the form factors at s = 0 (weighted by occupancy) up to the cutoff's tail
    expected = float((kernels.crystal.it92_coefficients(m.atoms.elements)[0].sum(1) * m.atoms.occ).sum())
    assert expected > 0
    assert float(rho.sum()) * grid.voxel_volume == pytest.approx(expected, rel=2e-3)
    empty = m.atoms.select([])
    assert splat_reference(empty, grid).abs().max() == 0


def test_reference_gradcheck():
    cell = kernels.Cell.from_parameters(8.0, 9.0, 10.0, 90, 100, 90)
    grid = kernels.GridSpec(cell, (8, 9, 10))
    base = kernels.AtomSet.from_elements(["C", "N"], [[1.1, 2.3, 3.7], [4.2, 5.1, 6.3]], [12.0, 20.0], [0.9, 0.6])
    xyz = base.xyz.clone().requires_grad_()
    b_iso = base.b_iso.clone().requires_grad_()
    occ = base.occ.clone().requires_grad_()
    weights = torch.rand(grid.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def loss(x, b, o):
        atoms = kernels.AtomSet(x, b, o, base.a, base.b, base.elements, base.labels, _validate=False)
        return (splat_reference(atoms, grid, radius=2.5) * weights).sum()

    assert torch.autograd.gradcheck(loss, (xyz, b_iso, occ), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["1orc", "5h73"])
def test_symmetrize_matches_gemmi_put_model_density(name):
    m = model(name)
    grid = kernels.GridSpec.for_spacing(m.cell, SPACING, m.spacegroup)
    rho = kernels.symmetrize(splat_reference(m.atoms, grid), grid, m.spacegroup)
    ref = torch.from_numpy(gemmi_density(name, SPACING, 1e-5, symmetry=True))
    assert_close(rho, ref, atol=1e-4, rtol=1e-5)  # tolerance: see test_reference_matches_gemmi


def test_symmetrize_refuses_an_incompatible_grid():
    m = model("5h73")  # P 32 2 1: a and b are related, c has a 3-fold screw
    with pytest.raises(kernels.GridError, match="not compatible"):
        kernels.symmetrize(torch.zeros(10, 12, 20), kernels.GridSpec(m.cell, (10, 12, 20)), m.spacegroup)


def test_box_grid_matches_the_whole_cell_map():
    m = model("1pfe")
    whole = kernels.GridSpec.for_spacing(m.cell, 1.0, m.spacegroup)
    rho = splat_reference(m.atoms, whole)
    box = kernels.GridSpec(m.cell, (7, 50, 9), origin=(-4, 30, 5), sampling=whole.shape)
    rb = splat_reference(m.atoms, box)
    idx = [np.arange(o, o + n) % s for o, n, s in zip(box.origin, box.shape, whole.shape)]
    assert_close(rb, rho[np.ix_(*idx)], atol=1e-12, rtol=1e-12)


def test_grid_too_large_for_memory_is_refused_before_allocating():
    m = model("1orc")
    grid = kernels.GridSpec.for_spacing(m.cell, 0.01, m.spacegroup)  # ~3500×3900×4800 voxels
    with pytest.raises(kernels.GridError, match="coarser grid spacing"):
        kernels.splat_density(m.atoms, grid, backend="reference")


def test_bad_grid_arguments():
    cell = kernels.Cell.from_parameters(10, 10, 10)
    with pytest.raises(kernels.GridError):
        kernels.GridSpec(cell, (0, 4, 4))
    with pytest.raises(kernels.GridError, match="positive"):
        kernels.GridSpec.for_spacing(cell, -1.0)
    with pytest.raises(ValueError, match="radius"):
        splat_reference(
            kernels.AtomSet.from_elements(["C"], [[0, 0, 0]], [10]), kernels.GridSpec(cell, (4, 4, 4)), radius=-2
        )


@requires_cuda
def test_symmetrize_on_cuda_equals_the_cpu_sum():
    # The README's usage symmetrises the map where the atoms are: on a GPU, CUDA tensors (no int64 matmul there).
    m = model("1aki")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.0, m.spacegroup)
    rho = torch.rand(grid.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want = kernels.symmetrize(rho, grid, m.spacegroup)
    got = kernels.symmetrize(rho.cuda(), grid, m.spacegroup)
    assert torch.equal(got.cpu(), want)
