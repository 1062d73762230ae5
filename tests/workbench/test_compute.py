"""The pure computations behind the views, against independent calculations."""

from __future__ import annotations

import math

import gemmi
import numpy as np
import pytest
import torch

import kernels
from tests.helpers import model
from workbench import compute
from workbench.compute import WorkbenchError
from workbench.state import WorkbenchState


def _angle(u, v):
    return math.degrees(math.acos(float(np.dot(u, v) / np.linalg.norm(u) / np.linalg.norm(v))))


@pytest.mark.parametrize(
    "params, axis, angle",
    [
        ((39.374, 39.374, 79.734, 90, 90, 120), 2, 120.0),  # 1PFE's hexagonal ab face
        ((20.0, 30.0, 40.0, 90, 110, 90), 1, 110.0),  # monoclinic: the ac face shows β
        ((20.0, 30.0, 40.0, 70, 80, 100), 0, 70.0),  # triclinic: the bc face shows α
        ((34.77, 39.17, 48.31, 90, 90, 90), 2, 90.0),
    ],
)
def test_section_is_drawn_with_the_true_cell_angles(params, axis, angle):
    cell = kernels.Cell.from_parameters(*params)
    grid = kernels.GridSpec(cell, (12, 10, 8))
    rho = torch.arange(grid.n_voxels, dtype=torch.float32).reshape(grid.shape)
    sec = compute.section(rho, grid, axis, 3)
    u, v = sec.in_plane
    assert _angle(sec.e_u, sec.e_v) == pytest.approx(angle, abs=1e-9)
    assert np.linalg.norm(sec.e_u) == pytest.approx(params[u]) and np.linalg.norm(sec.e_v) == pytest.approx(params[v])
    assert sec.e_u[1] == 0 and sec.e_v[1] > 0
    np.testing.assert_array_equal(sec.values, rho.select(axis, 3).numpy())
    # depth = index/n · interplanar spacing 1/|a*_k|
    assert sec.depth == pytest.approx(3 / grid.shape[axis] / cell.reciprocal_lengths[axis])
    with pytest.raises(WorkbenchError, match="slice index"):
        compute.section(rho, grid, axis, grid.shape[axis])


def test_atoms_near_a_section_are_found_across_the_periodic_boundary():
    cell = kernels.Cell.from_parameters(30, 30, 40, 90, 90, 120)
    grid = kernels.GridSpec(cell, (30, 30, 40))
    frac = torch.tensor([[0.25, 0.5, 0.0], [0.1, 0.2, 0.99], [0.5, 0.5, 0.5], [1.25, -0.5, 0.01]], dtype=torch.float64)
    xyz = frac @ cell.orth.T
    sec = compute.section(torch.zeros(grid.shape), grid, 2, 0)
    idx, uv, dist = compute.atoms_near_section(xyz, grid, sec, tolerance=0.5)
    assert idx.tolist() == [0, 1, 3]  # 0.99 wraps to 0.4 Å below the plane; 0.5 is 20 Å away
    np.testing.assert_allclose(dist, [0.0, 0.4, 0.4], atol=1e-9)
    # in-plane position: fractional (u, v) wrapped into the cell, times the in-plane vectors
    expected = np.array([0.25 * sec.e_u + 0.5 * sec.e_v, 0.1 * sec.e_u + 0.2 * sec.e_v, 0.25 * sec.e_u + 0.5 * sec.e_v])
    np.testing.assert_allclose(uv, expected, atol=1e-9)


def test_prepare_atoms_b_modes_and_distortion():
    m = model("1orc")
    state = WorkbenchState()
    base = compute.prepare_atoms(m, state.snapshot())
    assert torch.equal(base.b_iso, m.atoms.b_iso) and torch.equal(base.xyz, m.atoms.xyz)
    state.set_trait("b_mode", "global")
    state.b_global = 33.0
    assert (compute.prepare_atoms(m, state.snapshot()).b_iso == 33.0).all()
    state.b_mode = "offset"
    state.b_offset = 7.0
    torch.testing.assert_close(compute.prepare_atoms(m, state.snapshot()).b_iso, m.atoms.b_iso + 7.0)
    state.b_offset = -50.0
    low = float(m.atoms.b_iso.min())
    with pytest.raises(WorkbenchError, match=f"set the offset above {-low:.2f}"):
        compute.prepare_atoms(m, state.snapshot())
    # an offset that leaves B above 0 but below zero-point motion (0.5 Å²) is refused too, naming the floor
    state.b_offset = 0.2 - low
    with pytest.raises(
        WorkbenchError, match=rf"B below 0.5 Å² \(zero-point motion\) .* set the offset above {0.5 - low:.2f}"
    ):
        compute.prepare_atoms(m, state.snapshot())
    state.b_offset = 0.6 - low
    assert float(compute.prepare_atoms(m, state.snapshot()).b_iso.min()) == pytest.approx(0.6)
    aniso = model("1pfe")  # anisotropic atoms: the floor applies to U's narrowest axis
    u = aniso.atoms.u_aniso[aniso.atoms.aniso]
    lam = float(kernels.adp.adp_eigenvalues(u)[:, 0].min()) * 8 * math.pi**2  # as B, Å²
    state.b_offset = 0.3 - lam
    with pytest.raises(WorkbenchError, match=r"narrower than B = 0.5 Å² along some axis"):
        compute.prepare_atoms(aniso, state.snapshot())
    state.b_mode = "model"
    state.distort_amplitude = 0.3
    state.distort_seed = 7
    a = compute.prepare_atoms(m, state.snapshot())
    b = compute.prepare_atoms(m, state.snapshot())
    torch.testing.assert_close(a.xyz, b.xyz)  # same seed, same displacement
    shift = (a.xyz - m.atoms.xyz).numpy()
    assert shift.std() == pytest.approx(0.3, rel=0.1)
    assert torch.equal(compute.prepare_atoms(m, state.snapshot(), distorted=False).xyz, m.atoms.xyz)
    state.distort_seed = 8
    assert not torch.equal(compute.prepare_atoms(m, state.snapshot()).xyz, a.xyz)


def test_line_profile_and_density_at_points_interpolate_the_map():
    m = model("1orc")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.5, m.spacegroup)
    rho = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid)
    # Catmull-Rom passes through the nodes: sample exactly at voxels (5,6,7) and (9,6,7).
    p0 = (torch.tensor([5, 6, 7.0], dtype=torch.float64) / torch.tensor(grid.shape)) @ m.cell.orth.T
    p1 = (torch.tensor([9, 6, 7.0], dtype=torch.float64) / torch.tensor(grid.shape)) @ m.cell.orth.T
    dist, values = compute.line_profile(rho, grid, p0.numpy(), p1.numpy(), n=9)
    assert dist[0] == 0 and dist[-1] == pytest.approx(float(torch.linalg.norm(p1 - p0)))
    np.testing.assert_allclose(values[::2], rho[5:10, 6, 7].numpy(), rtol=1e-5, atol=1e-6)
    # and equals gemmi's tricubic interpolation in between
    g = gemmi.FloatGrid(rho.numpy(), m.cell.to_gemmi(), gemmi.SpaceGroup("P 1"))
    pts = (p0 + torch.linspace(0, 1, 9, dtype=torch.float64)[:, None] * (p1 - p0)).numpy()
    ref = [g.tricubic_interpolation(gemmi.Position(*p)) for p in pts]
    np.testing.assert_allclose(values, ref, rtol=1e-4, atol=1e-5)


def test_compare_arrays_counts_elements_over_the_float32_contract():
    ref = torch.linspace(0, 10, 1000, dtype=torch.float64)
    same = compare = compute.compare_arrays(ref.float(), ref)
    assert same.ok and same.max_abs < 1e-6 and same.n_total == 1000
    bad = ref.clone()
    bad[10] += 1e-3  # tolerance there is 1e-5·10 + 1e-5·0.1 ≈ 1e-4
    compare = compute.compare_arrays(bad, ref)
    assert compare.n_over == 1 and compare.max_abs == pytest.approx(1e-3)
    assert compare.rel_l2 == pytest.approx(1e-3 / float(torch.linalg.norm(ref)))
    with pytest.raises(WorkbenchError, match="cannot compare shapes"):
        compute.compare_arrays(ref[:5], ref)


def test_density_fit_gradient_matches_an_independent_float64_autograd():
    m = model("1pfe")
    state = WorkbenchState(spacing=1.5, gradient_kind="density", distort_amplitude=0.2, backend="cpu")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.5, m.spacegroup)
    settings = state.snapshot()
    target, _, _ = compute.density_map(compute.prepare_atoms(m, settings, distorted=False), grid, settings)
    atoms = compute.prepare_atoms(m, settings)
    g, rho = compute.density_fit_gradient(atoms, grid, target, settings)
    # the same loss by hand, reference backend in float64
    xyz = atoms.xyz.clone().requires_grad_(True)
    ref_rho = kernels.splat_density(atoms.replace(xyz=xyz), grid, backend="reference")
    loss = 0.5 * ((ref_rho - target.double()) ** 2).sum()
    loss.backward()
    assert g.kind == "density" and g.backend == "cpu" and g.grad.shape == (len(m), 3)
    assert g.loss == pytest.approx(float(loss.detach()), rel=1e-3)
    scale = float(xyz.grad.abs().max())
    # float32 splat and map differences: per component within 1e-3 of the largest component
    np.testing.assert_allclose(g.grad, xyz.grad.numpy(), atol=1e-3 * scale)
    # undistorted: the model is its own target, so the gradient vanishes
    g0, _ = compute.density_fit_gradient(compute.prepare_atoms(m, settings, distorted=False), grid, target, settings)
    assert g0.loss == 0 and np.abs(g0.grad).max() == 0


def test_region_box_wraps_the_periodic_map_and_survives_a_ccp4_round_trip(tmp_path):
    m = model("1orc")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.5, m.spacegroup)
    rho = torch.rand(grid.shape)
    sel = m.atoms.xyz[:5]
    box, bgrid, stride = compute.region_box(rho, grid, sel, padding=3.0)
    assert stride == 1
    i, j, k = (np.arange(o, o + n) % s for o, n, s in zip(bgrid.origin, bgrid.shape, grid.shape))
    np.testing.assert_array_equal(box.numpy(), rho.numpy()[np.ix_(i, j, k)])
    frac = (sel @ m.cell.frac.T).numpy()
    assert (np.asarray(bgrid.origin) / grid.sampling <= frac.min(0)).all()
    assert ((np.asarray(bgrid.origin) + bgrid.shape - 1) / grid.sampling >= frac.max(0)).all()
    path = tmp_path / "box.ccp4"
    path.write_bytes(compute.map_ccp4_bytes(box, bgrid))
    back, back_grid = kernels.read_map(path)
    assert back_grid.origin == bgrid.origin and back_grid.sampling == grid.sampling
    np.testing.assert_array_equal(back.numpy(), box.numpy())
    # a large box is subsampled by a stride dividing the sampling, and still lines up
    big, big_grid, stride = compute.region_box(rho, grid, m.atoms.xyz, padding=3.0, max_voxels=2000)
    assert stride == 3 and all(s % 3 == 0 for s in grid.sampling) and big.numel() <= 2000 * 1.6
    assert big_grid.sampling == tuple(s // 3 for s in grid.sampling)
    i, j, k = (np.arange(o, o + n) * 3 % s for o, n, s in zip(big_grid.origin, big_grid.shape, grid.shape))
    np.testing.assert_array_equal(big.numpy(), rho.numpy()[np.ix_(i, j, k)])
    with pytest.raises(WorkbenchError, match="choose a residue"):
        compute.region_box(
            torch.zeros(401, 401, 401), kernels.GridSpec(grid.cell, (401, 401, 401)), m.atoms.xyz, padding=3.0
        )


def test_model_pdb_and_gradients_csv_carry_the_moved_atoms():
    m = model("1orc")
    xyz = m.atoms.xyz + 1.0
    st = gemmi.read_pdb_string(compute.model_pdb(m, xyz))
    first = st[0][0][0][0]
    assert first.pos.x == pytest.approx(float(xyz[0, 0]), abs=1e-3)
    assert st[0].count_atom_sites() == len(m)
    grad = np.arange(len(m) * 3, dtype=float).reshape(-1, 3)
    text = compute.gradients_csv(m, xyz.numpy(), grad, "planarity", "1/Å")
    lines = text.splitlines()
    assert len(lines) == len(m) + 2 and lines[0].startswith("# planarity gradient")
    row = lines[2].split(",")
    assert row[0] == "0" and float(row[9]) == 0.0 and float(row[11]) == 2.0


def test_load_model_errors_say_what_to_do(tmp_path):
    with pytest.raises(WorkbenchError, match="no such file.*bundled example"):
        compute.load_model(tmp_path / "missing.pdb")
    with pytest.raises(WorkbenchError, match="no structure given"):
        compute.load_model("  ")
    assert len(compute.load_model("1PFE")) == 342
