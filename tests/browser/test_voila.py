"""The quickstart as a standalone Voilà app (``workbench app``), in headless Chromium, offline."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from tests.browser.conftest import OfflinePage
from tests.browser.pages import (
    CAPTION_TEXT_JS,
    SCREENSHOTS,
    WorkbenchUI,
    image_stats,
    images_differ,
    median_latency,
    screenshot,
    summary,
    wait_caption_change,
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app(browser, voila_server):
    op = OfflinePage(browser)
    # Voilà executes the whole notebook before it sends the page: allow for a slow runner.
    op.page.goto(voila_server.url, timeout=180_000)
    op.page.wait_for_selector(".wb-status", timeout=120_000)
    yield op, WorkbenchUI(op.page)
    op.close()


def test_app_renders_offline(app):
    op, ui = app
    text = ui.wait_ready()
    assert "559 atoms" in text, text
    ui.wait_canvas_drawn()
    # Voilà strips the code cells: a person sees the narration and the app only.
    body = op.page.inner_text("body")
    assert "from workbench import Workbench" not in body and "Quickstart" in body
    stats = image_stats(ui.canvas_png())
    screenshot(op.page, "voila_app")
    assert stats["colours"] > 50 and stats["non_background"] > 0.02, f"3D canvas looks blank: {stats}"
    # Voilà's own "lab" template links Font Awesome from a CDN; its JS bundle carries the
    # same CSS, so the icons render offline anyway (checked below). Anything else blocked
    # would be the app depending on the internet.
    voila_template_cdn = ("https://cdn.jsdelivr.net/npm/@fortawesome/fontawesome-free@",)
    assert [u for u in op.blocked if not u.startswith(voila_template_cdn)] == [], op.blocked
    icon = op.page.evaluate(
        "() => getComputedStyle(document.querySelector('.wb-cancel i'), '::before').getPropertyValue('content')"
    )
    assert icon not in ("", "none", "normal"), f"button icons do not render offline: {icon!r}"


def test_app_bfactor_slider_changes_slice(app):
    op, ui = app
    ui.wait_ready()
    middle = ui.go_to_middle_slice()
    ui.wait_ready()
    before = ui.slice_png()
    latencies = median_latency(ui, moves=10)
    ui.wait_ready()
    changed = images_differ(before, ui.slice_png())
    assert changed > 0.01, f"slice image barely changed: {changed:.2%}"
    print(f"\nslider-to-new-image latency (Voilà, B-factor slider, section {middle}): {summary(latencies)}")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "latency_voila.json").write_text(
        json.dumps({"where": "voila", "latencies_ms": latencies, "median_ms": statistics.median(latencies)})
    )
    screenshot(op.page, "voila_after_bfactor")


def test_app_region_and_distortion(app):
    """The view a crystallographer wants first: one residue, its density, the restraint's arrows."""
    op, ui = app
    ui.choose_region(index=10)
    ui.wait_ready()
    before = ui.caption_3d()
    ui.type_into_readout(".wb-distort", "0.5")
    wait_caption_change(op.page, ".wb-view3d-caption", before)
    # the caption changes as the region's map comes, then again with the distorted model's arrows
    op.page.wait_for_function(
        f"() => /[1-9]\\d* of \\d+ atoms/.test(({CAPTION_TEXT_JS})(document.querySelector('.wb-view3d-caption')))",
        timeout=60_000,
    )
    ui.wait_ready()
    ui.wait_canvas_drawn()
    assert re.search(r"[1-9]\d* of \d+ atoms", ui.caption_3d()), ui.caption_3d()
    assert ui.arrows_drawn() > 0 and image_stats(ui.canvas_png())["magenta"] > 2e-4, ui.caption_3d()
    assert image_stats(ui.canvas_png())["colours"] > 50
    op.page.locator(".wb-status").scroll_into_view_if_needed()
    screenshot(op.page, "voila_region_distorted")
    screenshot(op.page.locator(".wb-app"), "voila_app_distorted")  # the app alone (docs/workbench.png)


def test_app_bad_file_shows_error(app, voila_server):
    op, ui = app
    ui.load_path(str(voila_server.notebooks / "no_such_model.cif"))
    op.page.wait_for_selector(".wb-status.wb-status-error", timeout=60_000)
    text, _ = ui.status()
    assert "no_such_model.cif" in text and "no such file" in text, text
