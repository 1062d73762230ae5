"""The Resolution tab: errors by shell against gemmi's exact factors, live with the settings; the resolution slider."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import kernels
from workbench import compute

PNG = b"\x89PNG\r\n\x1a\n"


def open_tab(wb):
    wb.tabs.selected_index = 4
    return wb.resolution


def test_opening_the_tab_draws_the_errors_by_shell_against_exact_factors(make_wb):
    wb = make_wb(spacing=0.667)
    view = wb.resolution
    assert view.drawn_for is None  # nothing computed while the tab is closed
    open_tab(wb)
    assert bytes(view.plot.value).startswith(PNG)
    assert "against exact (gemmi, direct sum)" in view.note.value and "to 2.00 Å" in view.note.value
    report = compute.resolution_report(wb.result, wb._resolution_cache)
    t = report.table
    # the default 0.667 Å grid without blur: 1ORC's aliasing, 8.6e-3 at 2 Å (docs/kernels.md)
    assert float(t.rel_error.max()) < 1e-2 and float(t.rel_error[-1]) > 5 * float(t.rel_error[0])
    # the slider: 6 Å down to the finest 0.1 Å stop the grid holds, then off (the map itself), off by default
    stops = [v for _, v in view.d.options]
    finest = kernels.reciprocal.finest_d_min(wb.result.grid)
    assert stops[0] == 6.0 and stops[-1] == 0.0 and view.d.value == 0.0 and view.d_min is None
    assert finest <= stops[-2] < finest + 0.1 and np.allclose(np.diff(stops[:-1]), -0.1)
    assert "map itself" in view.caption.value and "truncated" not in wb.slice.caption.value


def test_the_errors_follow_radius_and_blur(make_wb):
    wb = make_wb(spacing=0.667)
    open_tab(wb)
    first = compute.resolution_report(wb.result, wb._resolution_cache).table.rel_error.max()
    wb.set(radius_mode="radius", radius=2.5)  # a small fixed radius: percent errors
    small = compute.resolution_report(wb.result, wb._resolution_cache).table.rel_error.max()
    assert float(small) > 3 * float(first)
    note = wb.resolution.note.value
    wb.set(radius_mode="auto", blur=20.0)  # the blur is divided out: far below the unblurred map's error
    blurred = compute.resolution_report(wb.result, wb._resolution_cache).table.rel_error.max()
    assert float(blurred) < 0.1 * float(first)
    assert wb.resolution.note.value != note


def drawn(wb) -> tuple:
    """What the main section and the 3D view show: the section's raster, the 3D map box and its level."""
    return wb.slice.last.values.copy(), bytes(wb.scene.view.map_bytes), wb.scene.view.iso_level


def test_resolution_slider_redraws_the_main_section_and_3d_view_from_the_truncated_synthesis(make_wb):
    wb = make_wb(spacing=0.667)
    view = open_tab(wb)
    r = wb.result
    full = drawn(wb)
    times = {}
    for d in (2.0, 3.5, 6.0):
        start = time.perf_counter()
        view.d.value = d
        times[d] = time.perf_counter() - start
        section, box, level = drawn(wb)
        assert not np.allclose(section, full[0], equal_nan=True) and box != full[1]
        # labelled: both views say they show the map truncated at d, and the slider's caption says how to go back
        for caption in (wb.slice.caption.value, wb.scene.caption.value):
            assert f"map truncated at d = {d:.1f} Å" in caption and caption.count("wb-truncated") == 1
        assert f"truncated at d = {d:.1f} Å" in view.caption.value and "off: the map itself" in view.caption.value
        shown = compute.truncated_result(wb._resolution_cache, r, d)
        assert level == pytest.approx(shown.mean + r.settings.iso_sigma * shown.sigma)
    # the section drawn is the synthesis of the map's factors with d ≥ 6 Å (and its F(000)), cut at the section
    f = kernels.structure_factors(r.rho, r.grid, 6.0)
    want = kernels.fourier_synthesis(f, r.grid, f000=float(r.rho.double().sum()) * r.grid.voxel_volume)
    axis, index = r.section.axis, r.section.index
    np.testing.assert_allclose(shown.section.values, want.select(axis, index).numpy(), atol=1e-5 * float(r.rho.max()))
    np.testing.assert_allclose(
        shown.section.values,
        compute.truncated_section(wb._resolution_cache, r.grid, 6.0, axis, index),
        atol=1e-5 * float(r.rho.max()),
    )
    # smoother at lower resolution
    high = compute.truncated_result(wb._resolution_cache, r, 2.0).section.values
    assert np.abs(np.diff(shown.section.values, axis=0)).mean() < 0.5 * np.abs(np.diff(high, axis=0)).mean()
    # off: the map itself again, every label gone
    view.d.value = 0.0
    section, box, level = drawn(wb)
    np.testing.assert_array_equal(section, full[0])
    assert box == full[1] and level == pytest.approx(r.iso_level)
    assert "wb-truncated" not in wb.slice.caption.value + wb.scene.caption.value
    print("key press, control to drawn section and 3D box (s):", {d: round(t, 3) for d, t in times.items()})


def test_truncation_holds_across_new_settings_and_other_tabs(make_wb):
    wb = make_wb(spacing=0.667)
    view = open_tab(wb)
    view.d.value = 3.0
    wb.tabs.selected_index = 0  # the slider's tab closed: the views stay truncated
    wb.set(b_offset=5.0)
    r = wb.result
    shown = compute.truncated_result(wb._resolution_cache, r, 3.0)
    assert wb._resolution_cache._map[0][0] == r.map_key  # the new map's factors
    section, _, level = drawn(wb)
    assert level == pytest.approx(shown.mean + r.settings.iso_sigma * shown.sigma)
    assert "map truncated at d = 3.0 Å" in wb.slice.caption.value
    # a grid too coarse for 3 Å: the slider moves to the finest stop it holds, and the views say so
    wb.set(spacing=2.0)
    finest = kernels.reciprocal.finest_d_min(wb.result.grid)
    assert finest > 3.0
    d = view.d.value
    assert finest <= d < finest + 0.1 and f"map truncated at d = {d:.1f} Å" in wb.slice.caption.value
    view.d.value = 0.0
    assert "wb-truncated" not in wb.slice.caption.value


def test_anisotropic_atoms_alias_without_the_sampling_blur_and_the_tab_says_what_removes_it(make_wb):
    """1PFE carries U: unblurred on a 0.667 Å grid its sharpest atoms alias (percent errors by 2 Å); with the
    sampling blur (from U's smallest eigenvalue) every shell is below 1e-3 and the note is gone."""
    wb = make_wb("1pfe", spacing=0.667)
    open_tab(wb)
    need = kernels.sampling_blur(wb.result.atoms, wb.result.grid)
    assert wb.result.atoms.u_aniso is not None and need > 20.0
    plain = compute.resolution_report(wb.result, wb._resolution_cache)
    assert float(plain.table.rel_error.max()) > 1e-2
    assert f"sampling blur {need:.1f} Å²" in wb.resolution.note.value
    wb.set(blur=math.ceil(need * 2) / 2)  # the blur slider's 0.5 Å² step at or above it
    blurred = compute.resolution_report(wb.result, wb._resolution_cache)
    assert torch.all(blurred.table.rel_error < 1e-3), blurred.table.rel_error
    assert "sampling blur" not in wb.resolution.note.value


def test_a_comparison_adds_its_fsc(make_wb):
    wb = make_wb(spacing=1.0)
    wb.compare("cpu:cpu", "cpu:reference")
    wb.flush()
    open_tab(wb)
    assert "FSC 0.5: not crossed" in wb.resolution.note.value
    report = compute.resolution_report(wb.result, wb._resolution_cache, wb.difference_result)
    assert report.fsc is not None and torch.all(report.fsc.fsc > 0.9999)


def test_too_many_atoms_for_exact_factors_says_so(monkeypatch, make_wb):
    monkeypatch.setattr(compute.reciprocal, "EXACT_LIMIT", 10)
    wb = make_wb(spacing=1.0)
    open_tab(wb)
    assert "exact factors not summed live" in wb.resolution.note.value


@pytest.mark.parametrize("shape", [(12, 14, 10), (11, 13, 9)])
def test_truncated_section_is_the_synthesis_cut_at_the_section_on_every_axis(shape):
    grid = kernels.GridSpec(kernels.Cell.from_parameters(11.3, 13.7, 9.1, 79.0, 101.0, 94.0), shape)
    rho = torch.rand(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cache = compute.ResolutionCache()
    cache.map_factors(("map",), rho, grid, 0.0)
    f = kernels.structure_factors(rho, grid, 2.5)
    full = kernels.fourier_synthesis(f, grid, f000=float(rho.sum()) * grid.voxel_volume).numpy()
    for axis in range(3):
        for index in (0, 3):
            got = compute.truncated_section(cache, grid, 2.5, axis, index)
            np.testing.assert_allclose(got, np.take(full, index, axis=axis), atol=1e-12)
    with pytest.raises(ValueError, match="positive number of Å"):
        compute.truncated_section(cache, grid, float("nan"), 0, 0)
