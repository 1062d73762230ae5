"""What the views draw, computed without them: section geometry, the 3D scene, the atom table."""

from __future__ import annotations

import ast
import base64
import dataclasses
import importlib
import pkgutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
import workbench.compute
import workbench.views
from tests.helpers import model
from workbench import compute
from workbench.compute import WorkbenchError


@pytest.mark.parametrize(
    "params, axis, angle",
    [
        ((39.374, 39.374, 79.734, 90, 90, 120), 2, 120.0),
        ((20.0, 30.0, 40.0, 90, 110, 90), 1, 110.0),
        ((20.0, 30.0, 40.0, 70, 80, 100), 0, 70.0),
        ((34.77, 39.17, 48.31, 90, 90, 90), 2, 90.0),
    ],
)
def test_section_affine_puts_each_voxel_at_its_place_in_the_cell_face(params, axis, angle):
    cell = kernels.Cell.from_parameters(*params)
    grid = kernels.GridSpec(cell, (12, 10, 7))  # 7: odd, so n_u ≠ n_v on every face
    sec = compute.section(torch.zeros(grid.shape), grid, axis, 2)
    n_u, n_v = sec.values.shape
    m = sec.voxel_affine
    assert m.shape == (3, 3) and m.dtype == np.float64
    for p, q in [(0, 0), (3, 1), (n_u, 0), (0, n_v), (n_u, n_v), (n_u - 1, n_v - 2)]:
        x, y, one = m @ np.array([p, q, 1.0])
        np.testing.assert_allclose([x, y], p / n_u * sec.e_u + q / n_v * sec.e_v, atol=1e-12)
        assert one == 1.0
    np.testing.assert_allclose((m @ np.array([n_u, n_v, 1.0]))[:2], sec.corners[2], atol=1e-12)
    # the in-plane angle is the cell's, independently from the cell parameters
    assert sec.in_plane_angle == pytest.approx(angle, abs=1e-9)
    assert sec.is_rectangular == (angle == 90.0)


def test_atoms_within_matches_a_brute_force_distance_check():
    gen = torch.Generator().manual_seed(3)
    xyz = torch.rand((200, 3), generator=gen, dtype=torch.float64) * 20.0
    centre = np.array([5, 17, 150])
    got = compute.atoms_within(xyz, centre, 4.0)
    x = xyz.numpy()
    d = np.sqrt(((x[:, None, :] - x[None, centre, :]) ** 2).sum(-1)).min(1)
    assert got.tolist() == np.nonzero(d <= 4.0)[0].tolist()
    assert set(centre) <= set(got.tolist()) and got.dtype.kind == "i"
    # the bound is inclusive, and distance 0 keeps only the centre atoms (no duplicates here)
    line = torch.tensor([[0.0, 0, 0], [1.5, 0, 0], [3.0, 0, 0], [3.0001, 0, 0]], dtype=torch.float64)
    assert compute.atoms_within(line, np.array([0]), 3.0).tolist() == [0, 1, 2]
    assert compute.atoms_within(line, np.array([1]), 0.0).tolist() == [1]


def _gradient(grad: np.ndarray, kind: str = "planarity") -> compute.GradientResult:
    return compute.GradientResult(
        kind=kind, loss=0.0, grad=grad, units="1/Å", backend="cpu", forward_s=0.0, backward_s=0.0
    )


def test_region_arrows_cover_the_residue_and_its_neighbours_only():
    xyz = torch.tensor([[0.0, 0, 0], [2.0, 0, 0], [4.0, 0, 0], [10.0, 0, 0]], dtype=torch.float64)
    grad = np.full((4, 3), 0.0)
    grad[:, 1] = [500.0, 600.0, 700.0, 900.0]  # 1e-3 Å per 1/Å: 0.5 … 0.9 Å arrows, all drawn
    whole = compute.region_arrows(xyz, _gradient(grad), None, 3.0)
    assert whole.segments.shape == (4, 6) and whole.segments.dtype == np.float32
    assert whole.scale == compute.ARROW_SCALE["planarity"]
    near = compute.region_arrows(xyz, _gradient(grad), np.array([0]), 3.0)  # atoms 0, 1 (2 Å); 2 is 4 Å away
    expected, caption = compute.gradient_arrows(xyz.numpy()[[0, 1]], grad[[0, 1]], "planarity", "1/Å")
    np.testing.assert_array_equal(near.segments, expected)
    assert near.caption == caption and "2 of 2 atoms" in caption
    # arrows point along −∇: the start is the atom, the end moved by −scale·∇
    np.testing.assert_allclose(near.segments[0, 3:], [2.0, -0.6, 0.0], rtol=1e-6)
    none = compute.region_arrows(xyz, None, None, 3.0, missing="planarity is unavailable")
    assert none.segments.shape == (0, 6) and none.scale == 0.0 and none.to_bytes() == b""
    assert none.caption == "no arrows (planarity is unavailable)"


def test_arrow_bytes_round_trip_as_float32_rows_of_six():
    seg = np.arange(18, dtype=np.float64).reshape(3, 6) / 7
    data = compute.arrow_bytes(seg)
    assert len(data) == 3 * 6 * 4
    back = compute.arrow_segments(data)
    assert back.shape == (3, 6) and back.dtype == np.float32
    np.testing.assert_array_equal(back, seg.astype(np.float32))
    assert compute.arrow_segments(b"").shape == (0, 6)


def test_region_volume_is_the_region_box_as_a_ccp4_file(tmp_path):
    m = model("1orc")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.5, m.spacegroup)
    rho = torch.rand(grid.shape, generator=torch.Generator().manual_seed(0))
    sel = compute.region_atoms(m, compute.residue_keys(m)[3][0])
    box, bgrid, stride = compute.region_box(rho, grid, m.atoms.xyz[sel], 4.0)
    vol = compute.region_volume(rho, grid, m.atoms.xyz[sel], 4.0)
    assert vol.shape == tuple(box.shape) == bgrid.shape and vol.stride == stride == 1
    assert vol.n_voxels == box.numel()
    path = tmp_path / "vol.ccp4"
    path.write_bytes(vol.ccp4)
    back, back_grid = kernels.read_map(path)
    assert back_grid.origin == bgrid.origin
    # the map within the padding of the residue, and below every level beyond it
    keep = compute.near_atoms_mask(bgrid, m.atoms.xyz[sel], 4.0)
    assert 0 < vol.n_clipped == int((~keep).sum()) < keep.size
    np.testing.assert_array_equal(back.numpy()[keep], box.numpy()[keep])
    assert (back.numpy()[~keep] < float(box.min())).all()
    whole = compute.region_volume(rho, grid, m.atoms.xyz[sel], 4.0, clip=False)
    path.write_bytes(whole.ccp4)
    np.testing.assert_array_equal(kernels.read_map(path)[0].numpy(), box.numpy())
    # the whole model, above max_voxels: subsampled, and the volume says by how much
    sub = compute.region_volume(rho, grid, m.atoms.xyz, 3.0, max_voxels=2000)
    assert sub.stride == 3 and sub.n_voxels == int(np.prod(sub.shape)) <= 2000 * 1.6
    assert base64.b64decode(compute.volume_base64(vol.ccp4)) == vol.ccp4
    assert compute.volume_base64(vol.ccp4).isascii()


def test_region_volume_from_the_cached_mask_warns_nothing():
    # The second call takes near_atoms_mask's cached, read-only mask: clipping with it must not go through
    # torch.from_numpy, whose "not writable" UserWarning reached the notebook's stderr.
    m = model("1orc")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.5, m.spacegroup)
    rho = torch.rand(grid.shape, generator=torch.Generator().manual_seed(1))
    xyz = m.atoms.xyz[:40]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = compute.region_volume(rho, grid, xyz, 4.0)
        again = compute.region_volume(rho, grid, xyz, 4.0)
    assert first.ccp4 == again.ccp4 and first.n_clipped == again.n_clipped > 0


def test_focus_selection_names_the_residue_or_everything():
    m = model("1orc")
    key, _ = compute.residue_keys(m)[5]
    first = m.atoms.labels[int(compute.region_atoms(m, key)[0])]
    assert compute.focus_selection(m, key) == {"chain": first.chain, "resi": first.seq_num}
    assert compute.focus_selection(m, "") == {}
    with pytest.raises(WorkbenchError, match="no residue"):
        compute.focus_selection(m, "Q/9999")


def test_atom_table_order_sorts_with_nan_ratios_last_and_ties_stable():
    rho = np.array([1.0, 2.0, 0.0, 4.0, 2.0])
    target = np.array([0.5, 4.0, 1.0, 4.0, 4.0])
    ratio, order = compute.atom_table_order(rho, target, sort="ratio", ascending=True)
    np.testing.assert_array_equal(ratio, [0.5, 2.0, np.nan, 1.0, 2.0])
    assert order.tolist() == [0, 3, 1, 4, 2]  # ties 1, 4 in index order; no density (2) last
    _, order = compute.atom_table_order(rho, target, sort="ratio", ascending=False)
    assert order.tolist() == [2, 4, 1, 3, 0]
    _, order = compute.atom_table_order(rho, target, sort="rho", ascending=True)
    assert order.tolist() == [2, 0, 1, 4, 3]
    _, order = compute.atom_table_order(rho, target, sort="index", ascending=False)
    assert order.tolist() == [4, 3, 2, 1, 0]


def test_result_is_built_with_keywords_only():
    names = [f.name for f in dataclasses.fields(compute.Result)]
    assert names[:3] == ["settings", "model", "grid"]
    with pytest.raises(TypeError):
        compute.Result(*range(len(names)))  # a positional call could swap two same-typed fields


def test_every_stage_module_is_reexported_by_the_package():
    modules = [
        importlib.import_module(f"workbench.compute.{info.name}")
        for info in pkgutil.iter_modules(workbench.compute.__path__)
    ]
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} >= {"atoms", "maps", "sections", "pipeline", "scene"}
    for mod in modules:
        for name in mod.__all__:
            if name == "sentence":  # the errors module's message helper is internal to the stages
                continue
            assert name in workbench.compute.__all__, f"{mod.__name__}.{name} is not re-exported"
            assert getattr(workbench.compute, name) is getattr(mod, name)
    assert sorted(workbench.compute.__all__) == sorted(set(workbench.compute.__all__))


# Names that would mean a view computes instead of drawing (cropping, serialising, distances).
_COMPUTE_IN_VIEWS = {"torch", "base64", "tempfile", "gemmi", "kernels"}
_COMPUTE_CALLS = {"cdist", "region_box", "map_ccp4_bytes", "b64encode", "frombuffer", "argsort"}


@pytest.mark.parametrize("path", sorted(Path(workbench.views.__file__).parent.glob("*.py")), ids=lambda p: p.name)
def test_views_only_draw(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = {a.name.split(".")[0] for a in node.names}
            assert not roots & _COMPUTE_IN_VIEWS, f"{path.name} imports {roots & _COMPUTE_IN_VIEWS}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] not in _COMPUTE_IN_VIEWS, f"{path.name} imports {node.module}"
        elif isinstance(node, ast.Attribute | ast.Name):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            assert name not in _COMPUTE_CALLS, f"{path.name} uses {name}: that belongs in workbench.compute"


def test_a_map_cut_in_a_given_geometry_is_the_map_cut_from_its_atoms():
    """region_volume with the RegionGeometry of the same atoms gives the same bytes; with the geometry
    of atoms moved a little (a relax frame) the box keeps its place and size, the values are the map's."""
    import torch

    from workbench import compute
    from workbench.state import WorkbenchState

    s = WorkbenchState(structure="1orc", spacing=1.0).snapshot()
    r = compute.Pipeline().run(s)
    xyz = r.atoms.xyz
    geometry = compute.region_geometry(r.grid, xyz, 3.0, clip=True)
    fresh = compute.region_volume(r.rho, r.grid, xyz, 3.0)
    given = compute.region_volume(r.rho, r.grid, xyz, 3.0, geometry=geometry)
    assert given.ccp4 == fresh.ccp4 and given.n_clipped == fresh.n_clipped > 0
    moved = xyz + 0.2 * torch.randn(xyz.shape, generator=torch.Generator().manual_seed(1), dtype=xyz.dtype)
    again = compute.region_volume(r.rho * 2, r.grid, moved, 3.0, geometry=geometry)
    assert (
        again.shape == fresh.shape and again.ccp4[:64] == fresh.ccp4[:64]
    )  # size, start, sampling, cell: the same box
    assert again.ccp4 != fresh.ccp4
