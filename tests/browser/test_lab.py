"""The quickstart notebook in JupyterLab, in headless Chromium, offline: what a person sees.

``workbench lab`` is started as a user starts it (conftest); the page runs every cell,
then the tests move controls with the keyboard and compare pixels. Screenshots go to
``artifacts/screenshots/`` (kept by CI). Tests in this module share one page, in order.
"""

from __future__ import annotations

import json
import re
import statistics

import pytest

from tests.browser.conftest import OfflinePage
from tests.browser.pages import (
    SCREENSHOTS,
    WorkbenchUI,
    caption_text,
    image_stats,
    images_differ,
    median_latency,
    open_lab,
    screenshot,
    summary,
    wait_caption_change,
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def lab(browser, lab_server):
    op = OfflinePage(browser)
    page = op.page
    open_lab(page, lab_server.url)
    ui = WorkbenchUI(page)
    yield op, ui
    op.close()


def test_quickstart_runs_offline(lab):
    op, ui = lab
    text = ui.wait_ready()
    assert "559 atoms" in text, text
    # The last cell prints what the app computed: it ran after the app was ready.
    op.page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-OutputArea-output')].some(e => /density\\s+max/.test(e.textContent))",
        timeout=60_000,
    )
    ui.wait_canvas_drawn()
    screenshot(op.page, "lab_quickstart")
    screenshot(op.page.locator(".wb-app"), "lab_workbench")
    assert op.blocked == [], f"the page tried to reach the internet: {op.blocked}"
    assert not [e for e in op.console_errors if "3Dmol" in e or "wb" in e], op.console_errors


def test_bfactor_slider_changes_slice(lab):
    op, ui = lab
    # The app opens on the section through the middle of the molecule, not the empty cell edge.
    middle = int(float(op.page.locator(".wb-slice-index .noUi-handle").get_attribute("aria-valuenow")))
    caption = caption_text(op.page, ".wb-slice-caption")
    marked = int(re.search(r"\+ (\d+) atoms within", caption).group(1))
    assert middle > 0 and marked >= 20, f"opened on section {middle} with {marked} atoms near it: {caption}"
    before = ui.slice_png()
    b0 = ui.bfactor_value()
    latencies = median_latency(ui, moves=10)
    ui.wait_ready()
    after = ui.slice_png()
    assert ui.bfactor_value() > b0, "the key presses did not move the B-factor slider"
    changed = images_differ(before, after)
    assert changed > 0.01, f"slice image barely changed after moving B from {b0} to {ui.bfactor_value()}: {changed:.2%}"
    line = summary(latencies)
    print(f"\nslider-to-new-image latency (JupyterLab, B-factor slider, section {middle}): {line}")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "latency_lab.json").write_text(
        json.dumps({"where": "jupyterlab", "latencies_ms": latencies, "median_ms": statistics.median(latencies)})
    )
    screenshot(op.page, "lab_after_bfactor")
    text, classes = ui.status()
    assert "wb-status-error" not in classes, text


def test_controls_fit_their_column_with_the_file_browser_open(lab):
    op, ui = lab
    assert op.page.locator(".jp-DirListing").first.is_visible(), "the file browser should be open (the narrow case)"
    assert ui.controls_overflow() == []
    ui.type_into_readout(".wb-bfactor", "40")
    ui.wait_ready()
    assert ui.controls_overflow() == [], "typing into a readout scrolled or clipped the controls"


def test_3d_canvas_is_not_blank(lab):
    op, ui = lab
    ui.wait_canvas_drawn()
    png = ui.canvas_png()
    stats = image_stats(png)
    screenshot(op.page.locator(".wb-view3d"), "lab_view3d")
    assert stats["colours"] > 50 and stats["non_background"] > 0.02, f"3D canvas looks blank: {stats}"
    js_error = op.page.evaluate("() => document.querySelector('.wb-view3d').textContent")
    assert "could not load" not in js_error, js_error


def test_distortion_draws_planarity_arrows(lab):
    op, ui = lab
    # Zoom the 3D view to one residue (a person cannot see arrows on the whole model).
    region = ui.choose_region(index=10)
    ui.wait_ready()
    ui.wait_canvas_drawn()
    canvas_before = ui.canvas_png()
    caption_before = ui.caption_3d()
    grad_before = gradient_max(caption_before)
    # Undistorted, the model's residual non-planarity is below the drawing threshold.
    assert ui.arrows_drawn() == 0, caption_before
    assert image_stats(canvas_before)["magenta"] < 1e-4
    ui.type_into_readout(".wb-distort", "0.5")
    assert ui.controls_overflow() == [], "typing into a readout moved or clipped the controls"
    wait_caption_change(op.page, ".wb-view3d-caption", caption_before)
    ui.wait_ready()
    ui.wait_canvas_drawn()
    caption = ui.caption_3d()
    canvas_after = ui.canvas_png()
    screenshot(op.page.locator(".wb-view3d"), "lab_view3d_distorted")
    screenshot(op.page, "lab_distorted")
    print(f"\n3D caption ({region}) before: {caption_before}\n3D caption after a 0.5 Å distortion: {caption}")
    drawn = re.search(r"(\d+) of \d+ atoms", caption)
    assert "planarity" in caption and drawn and int(drawn.group(1)) > 0, caption
    # The widget reports the arrow shapes it built, and they show: magenta pixels appear.
    op.page.wait_for_function(
        "(n) => document.querySelector('.wb-view3d[data-arrows]')?.dataset.arrows === String(n)",
        arg=int(drawn.group(1)),
        timeout=30_000,
    )
    magenta = image_stats(canvas_after)["magenta"]
    assert magenta > 1e-3, f"no arrows visible in the 3D canvas ({magenta:.2%} magenta pixels)"
    # The restraint's pull grows by orders of magnitude once the groups are bent.
    assert gradient_max(caption) > 5 * grad_before, (caption_before, caption)
    assert images_differ(canvas_before, canvas_after) > 0.01, "the 3D view did not change after the distortion"
    assert image_stats(canvas_after)["colours"] > 50
    # Nothing (a numpy or matplotlib warning) was printed into the notebook on the way.
    stderr = op.page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert stderr.all_inner_texts() == [], stderr.all_inner_texts()


def gradient_max(caption: str) -> float:
    """The largest gradient the 3D caption reports ("… largest |∇| 1.01e+03 1/Å")."""
    m = re.search(r"largest \|∇\| ([0-9.]+(?:e[+-]?\d+)?)", caption)
    assert m, f"no gradient scale in the 3D caption: {caption!r}"
    return float(m.group(1))


def test_bad_file_shows_error_in_status_line(lab, lab_server):
    op, ui = lab
    bad = lab_server.notebooks / "broken.pdb"
    bad.write_text("this is not a PDB file\nATOM  garbage\n")
    ui.load_path(str(bad))
    op.page.wait_for_selector(".wb-status.wb-status-error", timeout=60_000)
    text, _ = ui.status()
    screenshot(op.page.locator(".wb-app"), "lab_bad_file")
    assert "broken.pdb" in text and text.startswith("error"), text
    # No traceback in the notebook: the error is in the status line only.
    tracebacks = op.page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert all("Traceback" not in t for t in tracebacks.all_inner_texts())
