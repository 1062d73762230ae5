"""The relax control in the standalone app (``workbench app``, 1ORC): start moves the atoms in the
3D canvas, stop stops them."""

from __future__ import annotations

import re

import pytest

from tests.browser.conftest import open_workbench
from tests.browser.pages import WorkbenchUI, images_differ, screenshot

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app(browser, voila_server):
    op, ui = open_workbench(browser, voila_server, 1500, 1100)
    yield op, ui
    op.close()


def _progress(ui: WorkbenchUI) -> str:
    return ui.page.locator(".wb-relax-progress").inner_text().strip()


def test_relax_moves_the_atoms_in_3d_and_stop_stops_them(app):
    op, ui = app
    page = op.page
    ui.type_into_readout(".wb-distort", "0.3")
    page.wait_for_timeout(500)
    ui.wait_ready()
    ui.wait_canvas_drawn()
    ui.reveal(".wb-relax-steps")
    steps = page.locator(".wb-relax-steps input")
    steps.fill("10000")
    steps.press("Enter")
    page.locator(".wb-view3d").scroll_into_view_if_needed()
    before = ui.canvas_png()
    page.locator("button.wb-relax-start").click()
    # a few frames drawn: the progress line names the step the views show
    page.wait_for_function(
        "() => { const m = /step (\\d+)\\/10000/.exec(document.querySelector('.wb-relax-progress').textContent);"
        " return m && Number(m[1]) >= 5; }",
        timeout=60_000,
    )
    page.wait_for_timeout(500)
    moving = ui.canvas_png()
    changed = images_differ(before, moving)
    assert changed > 0.002, f"relax changed {changed:.3%} of the 3D canvas"
    screenshot(page.locator(".wb-view3d"), "relax_moving")

    page.locator("button.wb-relax-stop").click()
    page.wait_for_function(
        "() => /relax stopped after/.test(document.querySelector('.wb-relax-progress').textContent)", timeout=30_000
    )
    text = _progress(ui)
    done = int(re.search(r"stopped after (\d+) step", text).group(1))
    assert 5 <= done < 10000, text
    start, end = (float(v) for v in re.search(r"RMSD to the model ([\d.]+) → ([\d.]+) Å", text).groups())
    assert start > 0.4 and end < start, text  # from the distorted model (0.3 Å per coordinate) towards the model
    ui.wait_canvas_drawn()
    stopped = ui.canvas_png()
    page.wait_for_timeout(1500)
    later = ui.canvas_png()
    assert images_differ(stopped, later) == 0.0, "the atoms moved after stop"
    assert _progress(ui) == text
    assert page.locator("button.wb-relax-start").is_enabled() and not page.locator("button.wb-relax-stop").is_enabled()
    # the relax frames raised nothing in the 3D widget (Voilà's template font from a CDN is blocked: see test_voila)
    assert not [e for e in op.console_errors if "3Dmol" in e or "wb" in e], op.console_errors
    assert page.locator(".wb-view3d").evaluate("e => e.textContent.includes('3D view:')") is False
