"""The relax control in the standalone app (``workbench app``, 1ORC): start moves the atoms in the
3D canvas, stop stops them at the step on screen, and what the app says of the picked atom is the
state shown (issue 46)."""

from __future__ import annotations

import re

import pytest

from tests.browser.conftest import open_workbench
from tests.browser.pages import WorkbenchUI, images_differ, screenshot

pytestmark = pytest.mark.browser

# The progress line names the step the views show: "step k/N: L = …".
_STEP = r"/step (\d+)\/(\d+)/"


@pytest.fixture(scope="module")
def app(browser, voila_server):
    op, ui = open_workbench(browser, voila_server, 1500, 1100)
    yield op, ui
    op.close()


def _progress(ui: WorkbenchUI) -> str:
    return ui.page.locator(".wb-relax-progress").inner_text().strip()


def _rendered(ui: WorkbenchUI) -> int:
    return int(ui.page.evaluate("() => document.querySelector('.wb-view3d').dataset.rendered || '0'"))


def _numbers(label: str) -> tuple[float, float]:
    """ρ and |∇| of a picked atom's label ("… ρ 1.47 e/Å³, |∇| 11.4 1/Å (planarity)")."""
    rho = float(re.search(r"ρ (-?[\d.e+-]+) ", label)[1])
    grad = float(re.search(r"\|∇\| ([\d.e+-]+) ", label)[1])
    return rho, grad


def test_relax_moves_the_atoms_and_stop_stops_at_the_step_on_screen(app):
    op, ui = app
    page = op.page
    ui.type_into_readout(".wb-distort", "0.3")
    page.wait_for_timeout(500)
    ui.wait_ready()
    ui.wait_canvas_drawn()
    # pick an atom (a click on its row in the atom table, as a person would)
    ui.open_tab("density at atoms")
    row = page.locator(".wb-atom-table tr[data-atom]").first
    row.wait_for(timeout=30_000)
    atom = row.get_attribute("data-atom")
    row.click()
    page.wait_for_function(
        "(a) => (document.querySelector('.wb-view3d').dataset.label || '').startsWith(`#${a} `)", arg=atom
    )
    ui.wait_ready()
    picked_before = page.evaluate("() => document.querySelector('.wb-view3d').dataset.label")
    ui.reveal(".wb-relax-steps")
    steps = page.locator(".wb-relax-steps input")
    steps.fill("10000")
    steps.press("Enter")
    page.locator(".wb-view3d").scroll_into_view_if_needed()
    before = ui.canvas_png()
    rendered = _rendered(ui)
    start_ms = page.evaluate(
        "() => { window.__t0 = performance.now(); document.querySelector('button.wb-relax-start').click(); "
        "return window.__t0; }"
    )
    # the first frame: the progress line names step 1 and the canvas is drawn again
    page.wait_for_function(f"() => {_STEP}.test(document.querySelector('.wb-relax-progress').textContent)")
    page.wait_for_function(
        "(n) => Number(document.querySelector('.wb-view3d').dataset.rendered || 0) > n", arg=rendered, timeout=30_000
    )
    first_ms = page.evaluate("() => performance.now()") - start_ms
    # a few frames drawn
    page.wait_for_function(
        f"() => {{ const m = {_STEP}.exec(document.querySelector('.wb-relax-progress').textContent);"
        " return m && Number(m[1]) >= 5; }",
        timeout=60_000,
    )

    # stop, reading the step on screen in the same page task as the click
    on_screen, clicked_ms = page.evaluate(
        """() => { const m = /step (\\d+)\\//.exec(document.querySelector('.wb-relax-progress').textContent);
            document.querySelector('button.wb-relax-stop').click();
            return [Number(m[1]), performance.now()]; }"""
    )
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "() => /relax stopped after/.test(document.querySelector('.wb-relax-progress').textContent)",
            timeout=60_000,
        )
    except PlaywrightTimeout as exc:
        raise AssertionError(
            f"no 'relax stopped' 60 s after stop at step {on_screen}: progress {_progress(ui)!r}, status {ui.status()}"
        ) from exc
    stopped_ms = page.evaluate("() => performance.now()") - clicked_ms
    text = _progress(ui)
    done = int(re.search(r"stopped after (\d+) step", text)[1])
    print(
        f"\nfirst frame drawn {first_ms:.0f} ms after start; stop pressed at step {on_screen}, run "
        f"ended after {done} steps, confirmed {stopped_ms:.0f} ms after the click"
    )
    assert 0 <= done - on_screen <= 1, f"stop pressed at step {on_screen}, the run went on to step {done}"
    assert f"The views show step {done};" in text, text
    start, end = (float(v) for v in re.search(r"RMSD to the model ([\d.]+) → ([\d.]+) Å", text).groups())
    assert start > 0.4 and end < start, text  # from the distorted model (0.3 Å per coordinate) towards the model
    ui.wait_canvas_drawn()
    stopped = ui.canvas_png()
    changed = images_differ(before, stopped)
    assert changed > 0.002, f"relax changed {changed:.3%} of the 3D canvas"
    screenshot(page.locator(".wb-view3d"), "relax_stopped")
    page.wait_for_timeout(1500)
    later = ui.canvas_png()
    assert images_differ(stopped, later) == 0.0, "the atoms moved after stop"
    assert _progress(ui) == text
    # R and correlation against the true model's factors, a point for each frame drawn
    plot = page.locator(".wb-relax-plot svg")
    assert plot.is_visible(), "no R-factor plot in the relax panel"
    for css in ("wb-relax-r", "wb-relax-cc"):
        line = plot.locator(f"polyline.{css}")
        assert int(line.get_attribute("data-points")) == done, (css, done)
        assert len(line.get_attribute("points").split()) == done
    box = plot.bounding_box()
    assert box["width"] >= 250 and box["height"] >= 100, box
    assert re.search(r"R 0\.\d{3}\s+CC 0\.\d{3} at step " + str(done), plot.text_content()), plot.text_content()
    assert page.locator("button.wb-relax-start").is_enabled() and not page.locator("button.wb-relax-stop").is_enabled()
    # the timing tab is for the step shown
    ui.open_tab("timing")
    assert f"relax step {done}:" in page.locator(".wb-timing").first.inner_text()
    # the picked atom's label is the shown state's: its ρ is the table's, its |∇| at most the largest
    label = page.evaluate("() => document.querySelector('.wb-view3d').dataset.label")
    assert label.startswith(f"#{atom} ") and label != picked_before, (label, picked_before)
    rho, grad = _numbers(label)
    ui.open_tab("density at atoms")
    row = page.locator(f".wb-atom-table tr[data-atom='{atom}']").first.locator("td").all_inner_texts()
    assert float(row[2]) == pytest.approx(rho, abs=0.0051), (row, label)
    caption = page.locator(".wb-view3d-caption").text_content()  # its details are closed
    largest = float(re.search(r"largest \|∇\| ([\d.e+-]+)", caption)[1])
    assert grad <= largest * 1.001, (label, caption)
    assert label.split(" · ")[0] in page.locator(".wb-picked-atom").inner_text()
    # the relax frames raised nothing in the 3D widget (Voilà's template font from a CDN is blocked: see test_voila)
    assert not [e for e in op.console_errors if "3Dmol" in e or "wb" in e], op.console_errors
    assert page.locator(".wb-view3d").evaluate("e => e.textContent.includes('3D view:')") is False


def test_a_default_run_draws_its_frames_before_it_ends(app):
    """With the default step count (50), frames are on the canvas while the run goes: the first frame's
    step is named and a frame is drawn before the progress line says the run finished (issue 46: the
    run used to end before the 3D view drew a frame)."""
    op, ui = app
    page = op.page
    ui.reveal(".wb-relax-steps")
    steps = page.locator(".wb-relax-steps input")
    steps.fill("50")
    steps.press("Enter")
    page.wait_for_timeout(300)
    page.evaluate(
        """() => { const p = document.querySelector('.wb-relax-progress'), v = document.querySelector('.wb-view3d');
        window.__relaxLog = [];
        const stamp = () => window.__relaxLog.push([p.textContent, Number(v.dataset.rendered || 0)]);
        window.__relaxWatch = [new MutationObserver(stamp), new MutationObserver(stamp)];
        window.__relaxWatch[0].observe(p, {subtree: true, childList: true, characterData: true});
        window.__relaxWatch[1].observe(v, {attributes: true, attributeFilter: ['data-rendered']}); }"""
    )
    rendered = _rendered(ui)
    page.locator("button.wb-relax-start").click()
    page.wait_for_function(
        "() => /relax (finished|stopped) after/.test(window.__relaxLog.map(([t]) => t).join('|'))", timeout=120_000
    )
    log = page.evaluate("() => { window.__relaxWatch.forEach((w) => w.disconnect()); return window.__relaxLog; }")
    end = next(i for i, (text, _) in enumerate(log) if "relax finished after 50 steps" in text)
    running = [(int(m[1]), r) for text, r in log[:end] if (m := re.search(r"step (\d+)/50", text))]
    assert running and running[0][0] == 1, log[:5]  # the first frame (step 1 of 50) named while running
    drawn = [step for step, r in running if r > rendered]
    assert drawn and min(drawn) < 50, f"no frame drawn before the run ended: {running[:5]} … ({len(running)} named)"
    plot = page.locator(".wb-relax-plot polyline.wb-relax-r")
    assert int(plot.get_attribute("data-points")) == 50
