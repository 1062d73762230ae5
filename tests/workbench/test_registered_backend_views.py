"""A registered density backend in the workbench: the backend, compare and timing lists, and the
difference view marking where it departs from the reference (section and 3D)."""

from __future__ import annotations

import pytest
import torch

import kernels
from tests.kernels import user_backends as ub
from workbench import compute
from workbench.state import backend_choices, compare_choices


@pytest.fixture
def registered():
    names = ("mine", "mine_occ")
    kernels.register_backend("density", "mine", ub.correct, devices=("cpu",))
    kernels.register_backend("density", "mine_occ", ub.no_occupancy, devices=("cpu",))
    yield names
    for name in names:
        kernels.unregister_backend("density", name)


def test_registered_backend_is_in_the_backend_and_compare_lists_then_gone(registered):
    runnable, _ = backend_choices("cpu")
    assert runnable[-2:] == registered
    assert {"cpu:mine", "cpu:mine_occ"} <= set(compare_choices())
    kernels.unregister_backend("density", "mine")
    try:
        assert "mine" not in backend_choices("cpu")[0] and "cpu:mine" not in compare_choices()
    finally:
        kernels.register_backend("density", "mine", ub.correct, devices=("cpu",))


def test_widget_offers_it_and_runs_the_main_views_with_it(make_wb, registered):
    wb = make_wb("1orc", spacing=2.0)
    wb.refresh_backends()
    assert "mine" in wb.controls.backend.options
    assert "cpu:mine" in wb.difference.a.options
    wb.state.backend = "mine"  # density by the user's kernel; planarity and tricubic run auto
    r = wb.result
    assert r is not None and r.backend == "mine", wb.status.message
    assert r.gradient is not None  # the planarity gradient still runs (auto)


def test_difference_view_marks_voxels_over_tolerance_on_the_section_and_in_3d(make_wb, registered):
    wb = make_wb("1orc", spacing=2.0)
    wb.compare("cpu:mine_occ", "cpu:reference")
    d = wb.difference_result
    assert d is not None and not d.maps.ok
    assert int(d.over.sum()) == d.maps.n_over > 0
    # the marks on the section are exactly the over-tolerance voxels of that section
    plane = d.over.select(d.section.axis, d.section.index)
    assert wb.difference.n_marked == int(plane.sum())
    marks = wb.difference.slice.markers.get_offsets()
    assert len(marks) == wb.difference.n_marked
    # the caption counts what the marks are: voxels over tolerance, not atoms near the plane
    caption = wb.difference.slice.caption.value
    n = wb.difference.n_marked
    assert f"+ {n} voxel{'s' * (n != 1)} over tolerance here" in caption and "atoms within" not in caption, caption
    assert wb.difference.view3d.map_bytes and wb.difference.view3d.iso_level == 0.5
    # its own CSS class: page tests find the main scene's ".wb-view3d" alone
    assert wb.difference.view3d.css_class == "wb-diff-3d" and "wb-view3d" not in wb.difference.view3d._dom_classes
    assert "\nATOM  " in wb.difference.view3d.model_text  # the model drawn as sticks
    assert "voxels where cpu:mine_occ is outside" in wb.difference.caption3d.value
    # a correct kernel: nothing marked, no surface
    wb.compare("cpu:mine", "cpu:reference")
    d = wb.difference_result
    assert d.maps.ok and wb.difference.n_marked == 0 and wb.difference.view3d.map_bytes == b""


def test_planarity_gradient_is_not_compared_for_a_density_backend_and_says_why(make_wb, registered):
    wb = make_wb("1orc", spacing=2.0)
    wb.compare("cpu:mine", "cpu:reference")
    d = wb.difference_result
    assert d.gradients is None and "density backend" in d.gradient_note


def test_timing_tab_times_a_registered_backend(registered):
    model = ub.example_atoms()
    grid = kernels.GridSpec.for_spacing(model.cell, 1.5, "P 1")
    from workbench.state import WorkbenchState

    settings = WorkbenchState().snapshot()
    rows = compute.time_backends(model.atoms, grid, settings, target=torch.zeros(grid.shape), repeats=1)
    mine = [r for r in rows if r["backend"] == "mine"]
    assert mine and mine[0]["forward_ms"] is not None and not mine[0]["error"]


def _stats_pair(wb) -> str:
    """The pair the difference view's statistics are about ("" when it shows none)."""
    import re

    m = re.search(r"<b>(\S+) vs (\S+)</b>", wb.difference.stats.value)
    return f"{m[1]} vs {m[2]}" if m else ""


def test_a_difference_result_is_shown_only_under_the_pair_it_compares(make_wb, registered):
    """Notebook 4's sequence: compare a registered backend, unregister it, refresh the lists (the
    dropdown falls back to cpu:cpu); then a person changes the dropdowns away and back."""
    wb = make_wb("1orc", spacing=2.0)
    wb.compare("cpu:mine_occ", "cpu:reference")
    view = wb.difference
    assert _stats_pair(wb) == "cpu:mine_occ vs cpu:reference" and "✗ outside" in view.stats.value
    assert view.n_marked > 0 and view.slice.image.value
    kernels.unregister_backend("density", "mine_occ")
    try:
        wb.refresh_backends()
        assert view.a.value == "cpu:cpu"
        # no verdict of mine_occ under "run A = cpu:cpu": the result is hidden, the note says why
        assert _stats_pair(wb) == "" and "✗" not in view.stats.value and "✓" not in view.stats.value
        assert "press compare for cpu:cpu vs cpu:reference" in view.stats.value
        assert view.last is None and view.n_marked == 0 and view.view3d.layout.display == "none"
        # the slice moves meanwhile: the hidden result stays hidden
        wb.state.slice_depths = wb.state.with_depth(2.0)
        assert _stats_pair(wb) == "" and view.last is None
        wb.compare()  # what the dropdowns say now
        assert _stats_pair(wb) == "cpu:cpu vs cpu:reference" and "✓ within" in view.stats.value
        # a person moves B away and back: hidden, then the same result again (no recompute needed)
        shown = wb.difference_result
        view.b.value = "cpu:cpu"
        assert _stats_pair(wb) == "" and view.last is None
        view.b.value = "cpu:reference"
        assert _stats_pair(wb) == "cpu:cpu vs cpu:reference" and view.last is shown
    finally:
        kernels.register_backend("density", "mine_occ", ub.no_occupancy, devices=("cpu",))
