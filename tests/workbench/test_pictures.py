"""Pictures people trust: the resampled section, its contours and atom marks, the 3D focus
and map box, picking, and the exported map — computed without a browser."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from workbench.compute import (
    ELEMENT_COLOURS,
    atom_marks,
    atoms_near_section,
    render_section,
    sample_section,
    section,
    section_fractions,
)
from workbench.views.slice import SliceView, bar_ticks


def _blob_map(cell: kernels.Cell, shape, centre_frac, width: float = 1.2) -> tuple[torch.Tensor, kernels.GridSpec]:
    """A periodic Gaussian blob (σ = ``width`` Å, peak 1) at fractional ``centre_frac``."""
    grid = kernels.GridSpec(cell, tuple(shape))
    idx = np.meshgrid(*[np.arange(n) / n for n in shape], indexing="ij")
    d = np.stack([f - c for f, c in zip(idx, centre_frac)], axis=-1)
    d -= np.round(d)
    cart = d @ cell.orth.numpy().T
    rho = np.exp(-0.5 * (cart**2).sum(-1) / width**2).astype(np.float32)
    return torch.from_numpy(rho), grid


MONOCLINIC = kernels.Cell.from_parameters(30.0, 24.0, 36.0, 90.0, 105.0, 90.0)
HEXAGONAL = kernels.Cell.from_parameters(32.0, 32.0, 20.0, 90.0, 90.0, 120.0)


# --------------------------------------------------------------------------- the resampled section


def test_resampled_section_equals_the_voxels_at_grid_nodes_and_is_smooth_between():
    rng = np.random.default_rng(0)
    rho = torch.from_numpy(rng.normal(size=(20, 18, 16)).astype(np.float32))
    grid = kernels.GridSpec(MONOCLINIC, (20, 18, 16))
    sec = section(rho, grid, 1, 5)  # ⊥ b: the a–c face, 105°
    n_u, n_v = sec.values.shape
    p, q = np.meshgrid(np.arange(n_u), np.arange(n_v), indexing="ij")
    at_nodes = sample_section(sec, p / n_u, q / n_v)
    np.testing.assert_allclose(at_nodes, rho[:, 5, :].numpy(), atol=2e-6)
    # between nodes: the 3-D tricubic kernel on the whole map at the same plane
    fu, fv = rng.uniform(0, 1, 500), rng.uniform(0, 1, 500)
    frac = np.stack([fu, np.full(500, 5 / 18), fv], axis=1)
    cart = torch.from_numpy(frac @ MONOCLINIC.orth.numpy().T)
    expected = kernels.tricubic_sample(rho, grid, cart.float(), backend="reference").numpy()
    np.testing.assert_allclose(sample_section(sec, fu, fv), expected, atol=2e-5)


def test_rendered_raster_samples_the_face_on_square_pixels_at_display_resolution():
    rho, grid = _blob_map(MONOCLINIC, (30, 24, 36), (0.3, 0.5, 0.6))
    sec = section(rho, grid, 1, 12)
    img = render_section(sec, pixels=200)
    ny, nx = img.values.shape
    assert max(nx, ny) == 200 and img.pixel == pytest.approx(float(np.ptp(sec.corners, axis=0).max()) / 200)
    # far more pixels than voxels: drawn smooth, not as 30 × 36 blocks
    assert nx * ny > 10 * sec.values.size
    x0, x1, y0, y1 = img.extent
    assert (x1 - x0) == pytest.approx(nx * img.pixel) and (y1 - y0) == pytest.approx(ny * img.pixel)
    x = x0 + (np.arange(nx) + 0.5) * img.pixel
    y = y0 + (np.arange(ny) + 0.5) * img.pixel
    xx, yy = np.meshgrid(x, y)
    fu, fv = section_fractions(sec, xx, yy)
    inside = (fu >= 0) & (fu < 1) & (fv >= 0) & (fv < 1)
    assert np.isnan(img.values[~inside]).all() and np.isfinite(img.values[inside]).all()
    np.testing.assert_allclose(img.values[inside], sample_section(sec, fu[inside], fv[inside]), atol=1e-6)


@pytest.mark.parametrize(
    ("cell", "axis", "centre", "angle"),
    [(MONOCLINIC, 1, (0.3, 0.5, 0.6), 105.0), (HEXAGONAL, 2, (0.7, 0.25, 0.5), 120.0)],
)
def test_section_keeps_the_true_cell_angles(cell, axis, centre, angle):
    shape = tuple(int(round(n)) for n in np.linalg.norm(cell.orth.numpy(), axis=0) / 0.5)
    rho, grid = _blob_map(cell, shape, centre)
    index = int(round(centre[axis] * shape[axis]))
    sec = section(rho, grid, axis, index)
    assert sec.in_plane_angle == pytest.approx(angle)
    img = render_section(sec, pixels=300)
    # The blob's peak lands where the cell's true geometry puts it, in Å of the section frame.
    u, v = sec.in_plane
    expected = centre[u] * sec.e_u + centre[v] * sec.e_v
    r, c = np.unravel_index(np.nanargmax(img.values), img.values.shape)
    x0, _, y0, _ = img.extent
    found = np.array([x0 + (c + 0.5) * img.pixel, y0 + (r + 0.5) * img.pixel])
    np.testing.assert_allclose(found, expected, atol=1.5 * img.pixel)
    # and the blob is round in Å (not squashed into a square grid): equal widths along x and y
    half = np.nan_to_num(img.values) > 0.5
    widths = [half.any(axis=0).sum() * img.pixel, half.any(axis=1).sum() * img.pixel]
    assert widths[0] == pytest.approx(widths[1], rel=0.1)
    assert widths[0] == pytest.approx(2 * 1.2 * np.sqrt(2 * np.log(2)), rel=0.15)  # FWHM of σ = 1.2 Å


# --------------------------------------------------------------------------- contours at σ levels


def test_contours_are_drawn_at_sigma_levels_of_the_whole_map():
    rho, grid = _blob_map(MONOCLINIC, (60, 48, 72), (0.4, 0.5, 0.5), width=1.5)
    mean, sigma = float(rho.mean()), float(rho.std())
    sec = section(rho, grid, 1, 24)
    img = render_section(sec, mean=mean, sigma=sigma, contour_sigmas=(1.0, 3.0, 1000.0))
    assert [c.sigma for c in img.contours] == [1.0, 3.0, 1000.0]
    for c in img.contours:
        assert c.level == pytest.approx(mean + c.sigma * sigma)
    one, three, never = img.contours
    assert never.lines == []  # a level the section never reaches draws nothing
    for c in (one, three):
        assert len(c.lines) == 1  # one closed ring around the blob
        ring = c.lines[0]
        np.testing.assert_allclose(ring[0], ring[-1], atol=1e-9)
        # every point of the line lies on the level of the interpolated section
        fu, fv = section_fractions(sec, ring[:, 0], ring[:, 1])
        np.testing.assert_allclose(sample_section(sec, fu % 1, fv % 1), c.level, atol=0.02 * c.level)
        # a ring of the analytic radius around the blob: exp(-r²/2w²) = level
        centre = 0.4 * sec.e_u + 0.5 * sec.e_v
        radius = 1.5 * np.sqrt(-2 * np.log(c.level))
        np.testing.assert_allclose(np.linalg.norm(ring - centre, axis=1), radius, rtol=0.05)
    # the higher level lies inside the lower one
    assert np.ptp(three.lines[0][:, 0]) < np.ptp(one.lines[0][:, 0])


def test_contours_need_the_map_statistics():
    rho, grid = _blob_map(MONOCLINIC, (30, 24, 36), (0.4, 0.5, 0.5))
    sec = section(rho, grid, 1, 12)
    from workbench.compute import WorkbenchError

    with pytest.raises(WorkbenchError, match="mean and σ"):
        render_section(sec, contour_sigmas=(1.0,))


def test_slice_view_draws_the_contours_and_says_their_levels():
    rho, grid = _blob_map(MONOCLINIC, (30, 24, 36), (0.4, 0.5, 0.5))
    mean, sigma = float(rho.mean()), float(rho.std())
    sec = section(rho, grid, 1, 12, (float(rho.min()), float(rho.max())))
    view = SliceView()
    view.update(sec, mean=mean, sigma=sigma, contour_sigmas=(1.0, 2.0))
    assert len(view.contours.get_segments()) == view.last.n_lines >= 2
    assert "contours at 1 σ" in view.caption.value and "2 σ" in view.caption.value
    assert "tricubic" in view.caption.value
    view.update(sec, mean=mean, sigma=sigma, contour_sigmas=())
    assert len(view.contours.get_segments()) == 0 and "contours" not in view.caption.value


def _png_rgb(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize(("cell", "axis"), [(MONOCLINIC, 1), (HEXAGONAL, 2)])
def test_section_pixels_are_the_display_pixels_in_their_colours(cell, axis):
    rho, grid = _blob_map(cell, (30, 24, 36) if axis == 1 else (40, 40, 24), (0.4, 0.5, 0.5), width=2.5)
    sec = section(rho, grid, axis, 12, (float(rho.min()), float(rho.max())))
    view = SliceView()
    png = _png_rgb(view.update(sec))
    img = view.last
    # one raster pixel per display pixel: the raster's width is the face's width on screen
    to_display = view.ax.transData
    (ax0, _), (ax1, _) = to_display.transform([(img.extent[0], 0.0), (img.extent[1], 0.0)])
    assert ax1 - ax0 == pytest.approx(img.values.shape[1], abs=1e-6)
    lo, hi = view.im.get_clim()
    cmap = view.im.get_cmap()
    height = png.shape[0]
    ny, nx = img.values.shape
    rng = np.random.default_rng(1)
    checked = 0
    for r, c in zip(rng.integers(0, ny, 400), rng.integers(0, nx, 400)):
        v = img.values[r, c]
        # away from the face's edge, where the outline is drawn over the image
        if not np.isfinite(img.values[max(r - 3, 0) : r + 4, max(c - 3, 0) : c + 4]).all() or not 3 <= r < ny - 3:
            continue
        x = img.extent[0] + (c + 0.5) * img.pixel
        y = img.extent[2] + (r + 0.5) * img.pixel
        px, py = to_display.transform((x, y))
        drawn = png[height - 1 - int(np.floor(py)), int(np.floor(px))]
        expected = np.asarray(cmap((v - lo) / (hi - lo), bytes=True)[:3])
        assert np.abs(drawn.astype(int) - expected).max() <= 1, (r, c, drawn, expected)
        checked += 1
    assert checked > 100


def test_a_section_sweep_draws_the_frame_once_and_each_colour_bar_once():
    rho, grid = _blob_map(MONOCLINIC, (30, 24, 36), (0.4, 0.5, 0.5), width=2.5)
    mean, sigma = float(rho.mean()), float(rho.std())
    view = SliceView()
    draws = []
    view.fig.canvas.mpl_connect("draw_event", lambda event: draws.append(event))
    for _sweep in range(2):
        for i in range(24):
            sec = section(rho, grid, 1, i, (float(rho.min()), float(rho.max())))
            view.update(sec, mean=mean, sigma=sigma, contour_sigmas=(1.0,))
            lo, hi = view.im.get_clim()
            assert next(reversed(view._bars)) == (lo, hi)  # the bar shown is this range's
            ticks = bar_ticks(lo, hi)
            assert ticks[0] == pytest.approx(lo) and ticks[-1] == pytest.approx(hi)  # labelled at both ends
    assert len(draws) == 1  # full-figure draws: the frame and labels, once for this geometry
    assert 1 < len(view._bars) <= 8  # the colour ranges met, each drawn once and kept


# --------------------------------------------------------------------------- atoms near the plane


def test_atoms_near_the_plane_are_marked_by_element_and_distance():
    cell = HEXAGONAL
    grid = kernels.GridSpec(cell, (64, 64, 40))
    frac = np.array([[0.5, 0.5, 0.50], [0.2, 0.3, 0.52], [0.1, 0.9, 0.60], [0.5, 0.5, 0.0], [0.99, 0.5, 1.49]])
    xyz = torch.from_numpy(frac @ cell.orth.numpy().T)
    sec = section(torch.zeros(grid.shape), grid, 2, 20)  # plane at c = 0.5 (10 Å)
    near = atoms_near_section(xyz, grid, sec)
    # 0 on the plane, 1 at 0.4 Å, 4 a periodic image 0.2 Å off it; 2 (2 Å) and 3 (10 Å) are not near
    assert near[0].tolist() == [0, 1, 4]
    np.testing.assert_allclose(near[2], [0.0, 0.4, 0.2], atol=1e-9)
    np.testing.assert_allclose(near[1][2], 0.99 * sec.e_u + 0.5 * sec.e_v, atol=1e-9)
    marks = atom_marks(near, ["N", "O", "C", "S", "fe"])
    assert marks.colours == [ELEMENT_COLOURS["N"], ELEMENT_COLOURS["O"], "#ff80ff"]
    assert marks.sizes[0] > marks.sizes[2] > marks.sizes[1]  # larger the closer to the plane
    view = SliceView()
    view.update(sec, marks=marks)
    np.testing.assert_allclose(view.markers.get_offsets(), marks.uv)
    assert "+ 3 atoms within 1 Å" in view.caption.value


# --------------------------------------------------------------------------- in the app


def test_app_draws_smooth_contoured_sections_and_follows_the_contour_setting(make_wb):
    wb = make_wb()
    r = wb.result
    assert wb.state.contour_sigmas == (1.0,)
    img = wb.slice.last
    assert img.values.size > 20 * r.section.values.size
    assert [c.level for c in img.contours] == [pytest.approx(r.mean + r.sigma)]
    assert len(wb.slice.contours.get_segments()) > 0
    assert len(wb.slice.markers.get_offsets()) == len(r.near[0]) > 0
    wb.state.contour_sigmas = (3.0, 1.0, 1.0)
    assert wb.state.contour_sigmas == (1.0, 3.0)
    assert [c.sigma for c in wb.slice.last.contours] == [1.0, 3.0]
    assert "3 σ" in wb.slice.caption.value
    wb.state.contour_sigmas = ()
    assert wb.slice.last.contours == [] and len(wb.slice.contours.get_segments()) == 0


# --------------------------------------------------------------------------- the 3D view


def test_near_atoms_mask_is_exact_in_an_oblique_cell():
    from workbench.compute import near_atoms_mask

    cell = kernels.Cell.from_parameters(20.0, 24.0, 18.0, 80.0, 105.0, 95.0)
    box_grid = kernels.GridSpec(cell, (30, 26, 22), (-4, 3, 5), (40, 48, 36))
    rng = np.random.default_rng(3)
    frac = (np.array(box_grid.origin) + rng.uniform(0, 1, (6, 3)) * np.array(box_grid.shape)) / box_grid.sampling
    xyz = torch.from_numpy(frac @ cell.orth.numpy().T)
    mask = near_atoms_mask(box_grid, xyz, 3.0)
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in box_grid.shape], indexing="ij"), -1).reshape(-1, 3)
    pos = ((ijk + box_grid.origin) / np.array(box_grid.sampling)) @ cell.orth.numpy().T
    brute = (np.linalg.norm(pos[:, None, :] - xyz.numpy()[None], axis=-1) <= 3.0).any(1)
    np.testing.assert_array_equal(mask.ravel(), brute)


def _volume_from_view(view, tmp_path):
    path = tmp_path / "box.ccp4"
    path.write_bytes(view.map_bytes)
    return kernels.read_map(path)


def test_3d_view_is_centred_on_the_region_and_its_box_covers_it_with_margin(make_wb, tmp_path):
    from workbench.compute import VIEW_MARGIN, atoms_within, region_atoms

    wb = make_wb()
    view = wb.scene.view
    xyz = wb.result.atoms.xyz.numpy()
    # whole model: the sphere holds every atom plus the margin
    cx, cy, cz, r = view.view_sphere
    centre = np.array([cx, cy, cz])
    np.testing.assert_allclose(centre, 0.5 * (xyz.min(0) + xyz.max(0)), atol=1e-9)
    assert r == pytest.approx(np.linalg.norm(xyz - centre, axis=1).max() + VIEW_MARGIN)
    zoom = view.zoom_key
    region = "A/12"
    wb.state.region = region
    assert view.zoom_key == zoom + 1 and view.focus == {"chain": "A", "resi": 12}
    sel = region_atoms(wb.result.model, region)
    shown = atoms_within(wb.result.atoms.xyz, sel, wb.state.region_padding)
    cx, cy, cz, r = view.view_sphere
    centre = np.array([cx, cy, cz])
    pts = xyz[shown]
    # centred on the residue itself (its neighbours may lie to one side), holding all shown
    np.testing.assert_allclose(centre, 0.5 * (xyz[sel].min(0) + xyz[sel].max(0)), atol=1e-9)
    assert np.linalg.norm(pts - centre, axis=1).max() + VIEW_MARGIN == pytest.approx(r)
    assert r < 0.5 * np.linalg.norm(xyz.max(0) - xyz.min(0))  # zoomed in on the residue
    # the map box covers the residue plus the padding ...
    rho, grid = _volume_from_view(view, tmp_path)
    frac = xyz[sel] @ wb.result.grid.cell.frac.numpy().T
    lo = np.array(grid.origin) / grid.sampling
    hi = (np.array(grid.origin) + np.array(grid.shape) - 1) / grid.sampling
    pad = wb.state.region_padding * np.asarray(grid.cell.reciprocal_lengths)
    assert (lo <= frac.min(0) - pad + 1e-9).all() and (hi >= frac.max(0) + pad - 1e-9).all()
    # ... and nothing of the map farther than the padding from the residue is above the level
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in grid.shape], indexing="ij"), -1).reshape(-1, 3)
    pos = ((ijk + grid.origin) / np.array(grid.sampling)) @ grid.cell.orth.numpy().T
    far = np.linalg.norm(pos[:, None, :] - xyz[sel][None], axis=-1).min(1) > wb.state.region_padding + 1e-6
    assert far.any() and (rho.numpy().ravel()[far] < view.iso_level).all()
    near_values = rho.numpy().ravel()[~far]
    assert (near_values >= view.iso_level).any()  # the residue's own density is there
    # a new model re-centres too
    wb.state.structure = "1pfe"
    assert view.zoom_key == zoom + 2 and view.focus == {}


def test_3d_map_payload_scales_with_the_region_not_the_cell():
    from workbench.compute import region_volume

    small = kernels.Cell.from_parameters(40.0, 40.0, 40.0)
    large = kernels.Cell.from_parameters(160.0, 160.0, 160.0)
    xyz = torch.tensor([[20.0, 20.0, 20.0], [21.5, 20.0, 20.0], [22.0, 21.4, 20.3]], dtype=torch.float64)
    sizes = {}
    for name, cell in (("small", small), ("large", large)):
        grid = kernels.GridSpec.for_spacing(cell, 1.0)
        rho = torch.rand(grid.shape)
        vol = region_volume(rho, grid, xyz, 5.0)
        sizes[name] = (len(vol.ccp4), vol.n_voxels, grid.n_voxels)
        assert len(vol.ccp4) <= 1024 + 4 * vol.n_voxels + 4096  # a header and float32 voxels, no text
    assert sizes["large"][2] == 64 * sizes["small"][2]  # 64× the cell …
    assert abs(sizes["large"][0] - sizes["small"][0]) < 0.1 * sizes["small"][0]  # … the same payload
    assert sizes["large"][0] < 0.002 * 4 * sizes["large"][2]


def test_picking_an_atom_in_3d_selects_its_residue_and_a_profile_endpoint(make_wb):
    wb = make_wb()
    view = wb.scene.view
    labels = wb.result.model.atoms.labels
    a = wb.state.profile_atoms[1]
    k = 40
    view._handle_custom_msg({"type": "pick", "serial": k + 1}, [])  # what view3d.js sends on a click
    lab = labels[k]
    assert wb.state.region == f"{lab.chain}/{lab.seq_num}{lab.icode.strip()}"
    assert wb.state.profile_atoms == (a, k) and wb.controls.profile_b.value == k
    assert wb.result.settings.profile_atoms == (a, k)
    dist = wb.result.profile[0][-1]
    xyz = wb.result.atoms.xyz.numpy()
    assert dist == pytest.approx(np.linalg.norm(xyz[k] - xyz[a]), rel=1e-6)
    assert view.focus == {"chain": lab.chain, "resi": lab.seq_num}
    view._handle_custom_msg({"type": "pick", "serial": 101}, [])
    assert wb.state.profile_atoms == (k, 100)
    view._handle_custom_msg({"type": "pick", "serial": 10**6}, [])  # not an atom: said, nothing changes
    assert wb.state.profile_atoms == (k, 100) and "not in the model" in wb.status.message
    # the serials in the PDB text the browser parses are the atom indices + 1
    serials = [int(line[6:11]) for line in view.model_text.splitlines() if line.startswith(("ATOM", "HETATM"))]
    assert serials == list(range(1, len(labels) + 1))


def test_a_picked_atom_is_labelled_in_3d_and_shown_in_the_atom_table(make_wb):
    # Issue 34: a pick showed no label, and the atom table listed only its first 25 rows.
    from kernels.adp import U_TO_B

    wb = make_wb("1pfe", distort_amplitude=0.3, gradient_kind="density")
    r = wb.result
    aniso = r.atoms.aniso.numpy()
    order = list(wb.table.order)
    # an anisotropic atom far down the table
    k = next(int(i) for i in order[100:] if aniso[i])
    assert f"data-atom='{k}'" not in wb.table.html.value
    wb.scene.view._handle_custom_msg({"type": "pick", "serial": k + 1}, [])
    r = wb.result
    view = wb.scene.view
    assert view.label_xyz == pytest.approx(r.atoms.xyz[k].tolist())
    name, adp, values = view.label_lines
    assert name == f"#{k} {r.model.atoms.labels[k]}"
    b_eq = float(r.atoms.u_aniso[k, :3].mean()) * U_TO_B
    assert f"B_eq {b_eq:.1f} Å²" in adp and f"occupancy {float(r.atoms.occ[k]):.2f}" in adp
    grad = float(np.linalg.norm(r.gradient.grad[k]))
    assert f"ρ {r.atom_rho[k]:.3g} e/Å³" in values and f"|∇| {grad:.3g} {r.gradient.units} (density)" in values
    assert grad > 0 and "picked:" in wb.scene.picked.value
    # the table shows and highlights its row, after the first 25, and a click on it is accepted
    assert f"<tr data-atom='{k}' class='wb-picked'>" in wb.table.html.value and k in wb.table.html.rows
    assert "wb-gap" in wb.table.html.value
    # the label follows the values: a new B changes ρ at the atom
    wb.controls.b_offset.value = 20.0
    assert wb.scene.view.label_lines[2] != values and f"ρ {wb.result.atom_rho[k]:.3g}" in wb.scene.view.label_lines[2]
    # an isotropic atom says B, not B_eq
    wb.controls.adp.value = "isotropic"
    assert wb.scene.view.label_lines[1].startswith(f"B {float(wb.result.atoms.b_iso[k]):.1f} Å²")
    # another model: the label (an index of the old one) is gone
    wb.controls.structure.value = "1orc"
    assert wb.scene.view.label_lines == [] and wb.scene.picked.value == ""


def test_export_map_writes_a_ccp4_map_on_the_server(make_wb, tmp_path):
    wb = make_wb()
    out = wb.export_map(tmp_path / "m.ccp4")
    rho, grid = kernels.read_map(out)
    assert grid.shape == wb.result.grid.shape and grid.sampling == wb.result.grid.sampling
    np.testing.assert_allclose(grid.cell.orth.numpy(), wb.result.grid.cell.orth.numpy(), atol=1e-3)
    np.testing.assert_array_equal(rho.numpy(), wb.result.rho.float().numpy())


def test_clicking_an_atom_table_row_picks_its_atom(make_wb):
    wb = make_wb()
    table = wb.table.html
    labels = wb.result.model.atoms.labels
    a = wb.state.profile_atoms[1]
    k = int(wb.table.order[3])  # the 4th row shown
    assert f"<tr data-atom='{k}'" in table.value and "click a row" in table.value
    table._handle_custom_msg({"type": "pick", "index": k}, [])  # what table.js sends on a click
    lab = labels[k]
    assert wb.state.region == f"{lab.chain}/{lab.seq_num}{lab.icode.strip()}"
    assert wb.state.profile_atoms == (a, k) and wb.result.settings.profile_atoms == (a, k)
    assert f"<tr data-atom='{k}' class='wb-picked'>" in table.value  # the picked row stands out
    assert wb.scene.view.focus == {"chain": lab.chain, "resi": lab.seq_num}
    hidden = int(wb.table.order[-1])  # not a row on show: a stale or forged message changes nothing
    for msg in ({"type": "pick", "index": hidden}, {"type": "pick", "index": "3"}, {"type": "pick", "index": True}):
        table._handle_custom_msg(msg, [])
        assert wb.state.profile_atoms == (a, k)
