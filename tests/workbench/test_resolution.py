"""The Resolution tab: errors by shell against gemmi's exact factors, live with the settings; the resolution slider."""

from __future__ import annotations

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
    assert bytes(view.section.value).startswith(PNG) and "d ≥" in view.caption.value
    assert view.d.min == pytest.approx(round(kernels.reciprocal.finest_d_min(wb.result.grid) + 0.05, 1))
    assert view.d.max == 6.0


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


def test_resolution_slider_redraws_the_truncated_section_fast_on_1orc(make_wb):
    wb = make_wb(spacing=0.667)
    view = open_tab(wb)
    r = wb.result
    shown = []
    for d in (2.0, 3.5, 6.0):
        start = time.perf_counter()
        view.d.value = d
        shown.append((time.perf_counter() - start, bytes(view.section.value)))
    assert len({png for _, png in shown}) == 3
    # the same section the compute function gives: the map's factors with d ≥ 6 Å synthesised
    sec = compute.truncated_section(wb._resolution_cache, r.grid, 6.0, r.settings.axis, r.section.index)
    f = kernels.structure_factors(r.rho, r.grid, 6.0)
    want = kernels.fourier_synthesis(f, r.grid, f000=float(r.rho.double().sum()) * r.grid.voxel_volume)
    np.testing.assert_allclose(
        sec, want.select(r.settings.axis, r.section.index).numpy(), atol=1e-5 * float(r.rho.max())
    )
    # smoother at lower resolution
    high = compute.truncated_section(wb._resolution_cache, r.grid, 2.0, r.settings.axis, r.section.index)
    assert np.abs(np.diff(sec, axis=0)).mean() < 0.5 * np.abs(np.diff(high, axis=0)).mean()
    print("key press (s):", [round(t, 3) for t, _ in shown])


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


def test_the_3d_view_can_show_the_truncated_map_and_go_back(make_wb):
    wb = make_wb(spacing=0.667)
    view = open_tab(wb)
    r = wb.result
    full_bytes = bytes(wb.scene.view.map_bytes)
    view.d.value = 4.0
    assert bytes(wb.scene.view.map_bytes) == full_bytes  # the toggle is off
    view.in_3d.value = True
    truncated = bytes(wb.scene.view.map_bytes)
    assert truncated != full_bytes
    rho = compute.truncated_map(wb._resolution_cache, r.grid, 4.0)
    assert wb.scene.view.iso_level == pytest.approx(float(rho.mean()) + r.settings.iso_sigma * float(rho.std()))
    view.d.value = 2.5
    assert bytes(wb.scene.view.map_bytes) not in (full_bytes, truncated)
    view.in_3d.value = False
    assert bytes(wb.scene.view.map_bytes) == full_bytes
    assert wb.scene.view.iso_level == pytest.approx(r.iso_level)
