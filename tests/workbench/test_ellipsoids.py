"""ADP ellipsoids of the 3D view: their geometry (computed in workbench.compute) and what the view is sent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernels
from kernels.adp import U_TO_B, u_matrix
from workbench import compute
from workbench.compute import WorkbenchError


def _rotation(seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def _u6(eigenvalues, rot) -> list[float]:
    u = rot @ np.diag(eigenvalues) @ rot.T
    return [u[0, 0], u[1, 1], u[2, 2], u[0, 1], u[0, 2], u[1, 2]]


@pytest.fixture
def mixed():
    """Four atoms: a strongly anisotropic tilted one (eigenvalue ratio 20), a mild one, two isotropic."""
    rot = _rotation(7)
    u = [_u6([0.01, 0.05, 0.2], rot), [np.nan] * 6, _u6([0.08, 0.1, 0.12], _rotation(3)), [np.nan] * 6]
    atoms = kernels.AtomSet.from_elements(
        ["C", "O", "N", "S"], [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], [20.0, 30.0, 40.0, 15.0], u_aniso=u
    )
    return atoms, rot


def test_fifty_percent_scale_is_the_chi_square_median_of_three_degrees_of_freedom():
    # P(r² ≤ k²) for a 3-D unit normal is erf(k/√2) − √(2/π)·k·exp(−k²/2); at k = 1.5382 it is ½
    k = compute.ELLIPSOID_SCALE
    p = math.erf(k / math.sqrt(2)) - math.sqrt(2 / math.pi) * k * math.exp(-(k**2) / 2)
    assert p == pytest.approx(0.5, abs=2e-5)


def test_unit_sphere_is_closed_outward_and_on_the_sphere():
    for n, (nv, nf) in enumerate([(12, 20), (42, 80), (162, 320)]):
        v, f = compute.unit_sphere(n)
        assert v.shape == (nv, 3) and f.shape == (nf, 3)
        np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-12)
        a, b, c = v[f[:, 0]], v[f[:, 1]], v[f[:, 2]]
        assert (np.einsum("ij,ij->i", np.cross(b - a, c - a), a + b + c) > 0).all()  # counter-clockwise outside
        edges = {tuple(sorted(e)) for tri in f for e in ((tri[0], tri[1]), (tri[1], tri[2]), (tri[2], tri[0]))}
        assert nv - len(edges) + nf == 2  # Euler: one closed surface, no duplicated vertices


def test_axes_are_the_eigenvectors_scaled_to_the_fifty_percent_radii(mixed):
    atoms, rot = mixed
    ell = compute.adp_ellipsoids(atoms)
    k = compute.ELLIPSOID_SCALE
    assert ell.index.tolist() == [0, 1, 2, 3] and ell.anisotropic.tolist() == [True, False, True, False]
    # atom 0: eigenvalues 0.01, 0.05, 0.2 along the columns of rot (ascending)
    np.testing.assert_allclose(ell.eigenvalues[0], [0.01, 0.05, 0.2], rtol=1e-12)
    np.testing.assert_allclose(ell.radii[0], k * np.sqrt([0.01, 0.05, 0.2]), rtol=1e-12)
    np.testing.assert_allclose(np.abs(np.einsum("ik,ik->k", ell.directions[0], rot)), 1.0, atol=1e-12)
    assert ell.radii[0, 2] / ell.radii[0, 0] == pytest.approx(math.sqrt(20))
    # every atom: axes·axesᵀ = k²·U (U of an isotropic atom: B/8π² on the diagonal), right-handed frames
    u = u_matrix(kernels.adp.effective_u(atoms.u_aniso, atoms.aniso, atoms.b_iso)).numpy()
    np.testing.assert_allclose(ell.axes @ ell.axes.transpose(0, 2, 1), k**2 * u, atol=1e-12)
    assert (np.linalg.det(ell.directions) > 0).all()
    np.testing.assert_allclose(ell.radii[1], k * math.sqrt(30.0 / U_TO_B), rtol=1e-12)  # a sphere
    np.testing.assert_allclose(ell.centres, atoms.xyz.numpy())
    np.testing.assert_allclose(ell.colours[1], compute.element_colour("O"))


def test_mesh_vertices_lie_on_the_fifty_percent_surface_with_outward_normals(mixed):
    atoms, _ = mixed
    ell = compute.adp_ellipsoids(atoms)
    mesh = compute.ellipsoid_mesh(ell)
    nv, nf = mesh.per_ellipsoid
    assert (nv, nf) == (42, 80) and mesh.vertices.shape == (4 * nv, 6) and mesh.faces.shape == (4 * nf, 3)
    assert sorted(mesh.order.tolist()) == [0, 1, 2, 3]
    u = u_matrix(kernels.adp.effective_u(atoms.u_aniso, atoms.aniso, atoms.b_iso)).numpy()
    for block_index, m in enumerate(mesh.order):
        block = mesh.vertices[block_index * nv : (block_index + 1) * nv].astype(np.float64)
        d = block[:, :3] - ell.centres[m]
        u_inv = np.linalg.inv(u[m])
        # xᵀU⁻¹x = k² on every vertex (float32 positions)
        np.testing.assert_allclose(np.einsum("vi,ij,vj->v", d, u_inv, d), compute.ELLIPSOID_SCALE**2, rtol=1e-5)
        # the normal is the gradient of the quadratic form: ∝ U⁻¹x, unit length, outward
        grad = d @ u_inv
        grad /= np.linalg.norm(grad, axis=1, keepdims=True)
        np.testing.assert_allclose(block[:, 3:6], grad, atol=1e-5)
        assert (np.einsum("vi,vi->v", block[:, 3:6], d) > 0).all()
        # the longest semi-axis is reached along its eigenvector and never exceeded
        proj = d @ ell.directions[m]
        assert (np.abs(proj) <= ell.radii[m] * (1 + 1e-5)).all()
        assert np.abs(proj[:, 2]).max() >= 0.85 * ell.radii[m, 2]
    # one chunk per colour (four elements, four colours), each with its ellipsoid's colour
    assert len(mesh.chunks) == 4
    for v0, v1, f0, f1, colour in mesh.chunks:
        m = mesh.order[v0 // nv]
        assert (v1 - v0, f1 - f0) == (nv, nf)
        rgb = np.rint(ell.colours[m] * 255).astype(int)
        assert colour == (rgb[0] << 16) | (rgb[1] << 8) | rgb[2]
        # triangles wind counter-clockwise seen from outside after the transform too
        v, f = mesh.vertices[v0:v1, :3].astype(np.float64), mesh.faces[f0:f1].astype(np.int64)
        assert f.min() == 0 and f.max() == nv - 1
        a, b, c = v[f[:, 0]], v[f[:, 1]], v[f[:, 2]]
        out = (a + b + c) / 3 - ell.centres[m]
        assert (np.einsum("ij,ij->i", np.cross(b - a, c - a), out) > 0).all()


def test_mesh_chunks_are_one_colour_and_stay_under_3dmol_16_bit_indices():
    n = 3000
    gen = np.random.default_rng(1)
    elements = ["C"] * 2000 + ["O", "N"] * 500
    atoms = kernels.AtomSet.from_elements(elements, gen.uniform(0, 50, (n, 3)), 20.0)
    ell = compute.adp_ellipsoids(atoms, max_count=n)
    assert len(ell) == n and ell.n_dropped == 0 and not ell.anisotropic.any()
    mesh = compute.ellipsoid_mesh(ell)
    nv, nf = mesh.per_ellipsoid
    per_chunk = compute.scene.MESH_CHUNK_VERTICES // nv
    counts = {"C": 2000, "O": 500, "N": 500}
    assert len(mesh.chunks) == sum(math.ceil(c / per_chunk) for c in counts.values())
    assert mesh.chunks[0][0] == 0 and mesh.chunks[0][2] == 0 and mesh.chunks[-1][1] == n * nv
    drawn = {}
    for (v0, v1, f0, f1, colour), nxt in zip(mesh.chunks, [*mesh.chunks[1:], None]):
        assert v1 - v0 < 2**16 and (v1 - v0) % nv == 0 and (f1 - f0) == (v1 - v0) // nv * nf
        assert int(mesh.faces[f0:f1].max()) == v1 - v0 - 1 and int(mesh.faces[f0:f1].min()) == 0
        members = {elements[ell.index[m]] for m in mesh.order[v0 // nv : v1 // nv]}
        assert len(members) == 1  # one element, one colour per chunk
        (element,) = members
        rgb = np.rint(np.array(compute.element_colour(element)) * 255).astype(int)
        assert colour == (rgb[0] << 16) | (rgb[1] << 8) | rgb[2]
        drawn[element] = drawn.get(element, 0) + (v1 - v0) // nv
        if nxt is not None:
            assert nxt[0] == v1 and nxt[2] == f1
    assert drawn == counts
    v, f = compute.ellipsoid_arrays(mesh.vertex_bytes(), mesh.face_bytes())
    assert np.array_equal(v, mesh.vertices) and np.array_equal(f, mesh.faces)
    capped = compute.adp_ellipsoids(atoms)
    assert len(capped) == compute.MAX_ELLIPSOIDS and capped.n_dropped == n - compute.MAX_ELLIPSOIDS


def test_a_u_that_is_not_positive_definite_is_refused_naming_the_atom():
    atoms = kernels.AtomSet.from_elements(["C", "N"], [[0, 0, 0], [2, 0, 0]], 20.0)
    bad = torch.tensor([[0.1, 0.1, 0.1, 0, 0, 0], [0.1, 0.1, -0.02, 0, 0, 0]], dtype=torch.float64)
    atoms = kernels.AtomSet(
        atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, bad,
        torch.tensor([True, True]), _validate=False,
    )  # fmt: skip
    with pytest.raises(WorkbenchError, match=r"atom .*N2 has a U that is not positive definite .*-0.02"):
        compute.adp_ellipsoids(atoms)
    assert len(compute.adp_ellipsoids(atoms, [0])) == 1


def test_ellipsoid_checkbox_sends_the_region_mesh_to_the_3d_view(make_wb):
    wb = make_wb("1pfe", backend="reference")
    view = wb.scene.view
    assert view.ellipsoid_vertices == b"" and view.ellipsoid_chunks == [] and wb.scene.ellipsoids is None
    assert "ellipsoids" not in wb.scene.caption.value
    wb.controls.ellipsoids.value = True
    assert wb.state.ellipsoids and wb.result.settings.ellipsoids
    ell = wb.scene.ellipsoids
    n = len(wb.result.model)
    assert len(ell) == n and ell.anisotropic.all()  # the whole model is shown, all with ANISOU
    v, f = view.ellipsoid_arrays
    assert v.shape == (42 * n, 6) and f.shape == (80 * n, 3)
    chunks = view.ellipsoid_chunks
    assert chunks[0][:4] == [0, chunks[0][1], 0, chunks[0][3]] and chunks[-1][1] == 42 * n and chunks[-1][3] == 80 * n
    # one colour per element of 1PFE (C, N, O, P, Cl, S), every chunk under 16-bit indices
    assert len({c[4] for c in chunks}) == len(set(wb.result.atoms.elements))
    assert all(c[1] - c[0] < 2**16 for c in chunks)
    assert f"ADP ellipsoids at 50 % probability (semi-axes 1.5382·√λ of U): {n} anisotropic, 0 isotropic" in (
        wb.scene.caption.value
    )
    # a residue as region: its atoms and their neighbours within the padding, nothing else
    key = wb.controls.region.options[5][1]
    wb.controls.region.value = key
    shown = compute.shown_atoms(wb.result.atoms.xyz, compute.region_atoms(wb.result.model, key), 5.0)
    assert wb.scene.ellipsoids.index.tolist() == shown.tolist() and len(shown) < n
    assert view.ellipsoid_arrays[0].shape == (42 * len(shown), 6)
    # the B offset widens them: U + ΔB/8π² on the diagonal
    before = wb.scene.ellipsoids.eigenvalues
    wb.controls.b_offset.value = 20.0
    np.testing.assert_allclose(wb.scene.ellipsoids.eigenvalues, before + 20.0 / U_TO_B, rtol=1e-10)
    # isotropic ADPs: spheres
    wb.controls.adp.value = "isotropic"
    ell = wb.scene.ellipsoids
    assert not ell.anisotropic.any()
    np.testing.assert_allclose(ell.radii[:, 0], ell.radii[:, 2], rtol=1e-10)
    wb.controls.ellipsoids.value = False
    assert view.ellipsoid_vertices == b"" and view.ellipsoid_chunks == [] and "ellipsoids" not in wb.scene.caption.value


def test_to_py3dmol_carries_the_ellipsoids(make_wb):
    wb = make_wb("1pfe", backend="reference", ellipsoids=True)
    wb.controls.region.value = wb.controls.region.options[1][1]
    js = wb.to_py3dmol().startjs
    chunks = wb.scene.view.ellipsoid_chunks
    assert js.count("addCustom") == len(chunks) >= 2
    assert all(f"#{c[4]:06x}" in js for c in chunks)
