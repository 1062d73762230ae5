"""What a person sees of anisotropic ADPs and radiation types in the standalone app: the ADP
control only for a model with ANISOU, the 50 % ellipsoids drawn in the 3D canvas, and the
map's units following the radiation. Tests in this module share one page, in order.
"""

from __future__ import annotations

import re

import pytest

from tests.browser.conftest import open_workbench
from tests.browser.pages import WorkbenchUI, caption_text, image_stats, images_differ, screenshot

pytestmark = pytest.mark.browser

TRIANGLES_PER_ELLIPSOID = 80  # workbench.compute.unit_sphere(1)


@pytest.fixture(scope="module")
def app(browser, voila_server):
    op, ui = open_workbench(browser, voila_server, 1280, 900)
    yield op, ui
    op.close()


def _triangles(ui: WorkbenchUI) -> int:
    value = ui.page.evaluate(
        "() => document.querySelector('.wb-view3d[data-ellipsoid-triangles]')?.dataset.ellipsoidTriangles ?? '-1'"
    )
    return int(value)


def _button(op, css: str, text: str):
    """The toggle button of ``css`` whose label is exactly ``text`` ("isotropic" is inside "anisotropic")."""
    return op.page.locator(f"{css} button").filter(has_text=re.compile(rf"^\s*{re.escape(text)}\s*$")).first


def _open_structure(op, ui: WorkbenchUI, name: str) -> None:
    before = ui.status()[0]
    op.page.locator(".wb-structure select").select_option(name)
    op.page.wait_for_function("(old) => document.querySelector('.wb-status').textContent.trim() !== old", arg=before)
    ui.wait_ready()
    ui.wait_canvas_drawn()


def test_adp_control_appears_only_for_a_model_with_anisou(app):
    op, ui = app
    assert "559 atoms" in ui.status()[0], ui.status()  # 1ORC: no ANISOU records
    # the section folds away at first; opened, it offers radiation and blur but no ADP control
    assert not op.page.locator(".wb-radiation").first.is_visible()
    ui.reveal(".wb-radiation")
    for css in (".wb-radiation", ".wb-blur"):
        assert op.page.locator(css).first.is_visible(), css
    assert not op.page.locator(".wb-adp").first.is_visible()
    assert ui.controls_overflow() == []
    _open_structure(op, ui, "1pfe")
    assert "342 atoms" in ui.status()[0], ui.status()
    adp = op.page.locator(".wb-adp").first
    assert adp.is_visible() and adp.locator("button").count() == 2
    assert "mod-active" in (_button(op, ".wb-adp", "anisotropic").get_attribute("class") or "")
    screenshot(op.page.locator(".wb-section-adps"), "adp_controls_1pfe")


def test_ellipsoids_are_drawn_in_the_3d_canvas(app):
    op, ui = app
    label = ui.choose_region(index=4)
    ui.wait_ready()
    ui.wait_canvas_drawn()
    assert _triangles(ui) == 0
    before = ui.canvas_png()
    ui.reveal(".wb-ellipsoids")
    op.page.locator(".wb-ellipsoids input[type=checkbox]").check()
    op.page.wait_for_function(
        "() => /ADP ellipsoids at 50 %/.test(document.querySelector('.wb-view3d-caption').textContent)",
        timeout=60_000,
    )
    op.page.wait_for_function(
        "() => Number(document.querySelector('.wb-view3d')?.dataset.ellipsoidTriangles) > 0", timeout=60_000
    )
    ui.wait_ready()
    ui.wait_canvas_drawn()
    caption = ui.caption_3d()
    n_aniso, n_iso = (int(v) for v in re.search(r"(\d+) anisotropic, (\d+) isotropic", caption).groups())
    assert n_aniso > 0 and n_iso == 0, caption  # every 1PFE atom has an ANISOU record
    assert _triangles(ui) == TRIANGLES_PER_ELLIPSOID * n_aniso
    after = ui.canvas_png()
    screenshot(op.page.locator(".wb-view3d"), "adp_ellipsoids_region")
    changed = images_differ(before, after)
    assert changed > 0.01, f"the ellipsoids of {label} changed {changed:.3%} of the canvas"
    assert image_stats(after)["colours"] > 50
    assert not ui.page.evaluate("() => document.querySelector('.wb-view3d')?.textContent.includes('3D view:')")


def test_isotropic_adps_draw_spheres_and_a_new_map(app):
    op, ui = app
    before = ui.status()[0]
    ui.reveal(".wb-adp")  # one control section is open at a time: the 3D one was
    _button(op, ".wb-adp", "isotropic").click()
    op.page.wait_for_function(
        "() => /0 anisotropic/.test(document.querySelector('.wb-view3d-caption').textContent)", timeout=60_000
    )
    ui.wait_ready()
    assert "error" not in ui.status()[1], (before, ui.status())
    caption = ui.caption_3d()
    n_iso = int(re.search(r"(\d+) isotropic \(spheres\)", caption).group(1))
    assert n_iso > 0 and _triangles(ui) == TRIANGLES_PER_ELLIPSOID * n_iso
    ui.wait_canvas_drawn()
    screenshot(op.page.locator(".wb-view3d"), "adp_spheres_region")
    _button(op, ".wb-adp", "anisotropic").click()
    op.page.wait_for_function(
        "() => !/ 0 anisotropic/.test(document.querySelector('.wb-view3d-caption').textContent)", timeout=60_000
    )
    ui.wait_ready()


def test_neutron_radiation_labels_the_map_in_fm_per_cubic_angstrom(app):
    op, ui = app
    slice_before = ui.slice_png()
    ui.reveal(".wb-radiation")
    _button(op, ".wb-radiation", "neutron").click()
    op.page.wait_for_function(
        "() => /fm\\/Å³/.test(document.querySelector('.wb-slice-caption').textContent)", timeout=60_000
    )
    ui.wait_ready()
    assert "fm/Å³" in op.page.locator(".wb-cutoff").first.inner_text()
    assert "fm/Å³" in ui.caption_3d() and "e/Å³" not in caption_text(op.page, ".wb-slice-caption")
    assert images_differ(slice_before, ui.slice_png()) > 0.01
    screenshot(op.page.locator(".wb-slice"), "adp_neutron_slice")
    _button(op, ".wb-radiation", "X-ray").click()
    op.page.wait_for_function(
        "() => /e\\/Å³/.test(document.querySelector('.wb-slice-caption').textContent)", timeout=60_000
    )
    ui.wait_ready()
    assert "e/Å³" in op.page.locator(".wb-cutoff").first.inner_text()
