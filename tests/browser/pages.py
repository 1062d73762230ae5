"""Driving the workbench in a real page: what a person does (keys, typing) and sees (pixels).

Shared by the JupyterLab and Voilà tests; every locator uses the app's stable CSS
classes (see :class:`workbench.Workbench`).
"""

from __future__ import annotations

import io
import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(os.environ.get("WORKBENCH_SCREENSHOTS", ROOT / "artifacts" / "screenshots"))
# "ready: 559 atoms, …": the status line after a finished computation (it starts as plain "ready").
READY = r"/^ready: \d+ atoms/"


def screenshot(locator_or_page, name: str) -> Path:
    """Save a screenshot under artifacts/screenshots (kept by CI) and return its path."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    locator_or_page.screenshot(path=str(path))
    return path


def image_stats(png: bytes) -> dict[str, float]:
    """What a person would call blank or not: distinct colours, spread, share of non-background pixels."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int32)
    flat = rgb.reshape(-1, 3)
    background = np.bincount((flat[:, 0] << 16) | (flat[:, 1] << 8) | flat[:, 2]).argmax()
    bg = np.array([(background >> 16) & 255, (background >> 8) & 255, background & 255])
    off = np.abs(flat - bg).sum(axis=1) > 30
    red = (rgb[..., 0] > 170) & (rgb[..., 1] < 90) & (rgb[..., 2] < 90)
    # the gradient arrows' magenta (#e000e0, shaded): red and blue high, green low
    magenta = (rgb[..., 0] > 110) & (rgb[..., 2] > 110) & (rgb[..., 1] < 0.55 * np.minimum(rgb[..., 0], rgb[..., 2]))
    return {
        "colours": float(len(np.unique((flat[:, 0] << 16) | (flat[:, 1] << 8) | flat[:, 2]))),
        "std": float(rgb.std()),
        "non_background": float(off.mean()),
        "red": float(red.mean()),
        "magenta": float(magenta.mean()),
    }


def images_differ(a: bytes, b: bytes) -> float:
    """Fraction of pixels that differ by more than a little between two PNGs of one size."""
    import numpy as np
    from PIL import Image

    x = np.asarray(Image.open(io.BytesIO(a)).convert("RGB")).astype(np.int32)
    y = np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).astype(np.int32)
    if x.shape != y.shape:
        return 1.0
    return float((np.abs(x - y).sum(axis=-1) > 12).mean())


def open_lab(page, url: str, *, run_quickstart: bool = True) -> None:
    """Open JupyterLab at ``url`` (``workbench lab`` opens the quickstart) and wait until it is
    restored; with ``run_quickstart``, Run All once its kernel is idle and wait for the app."""
    page.goto(url)
    page.wait_for_function("() => window.jupyterapp !== undefined", timeout=60_000)
    page.evaluate("async () => { await window.jupyterapp.restored; }")
    page.wait_for_selector(".jp-NotebookPanel", timeout=60_000)
    if not run_quickstart:
        return
    # Run All from the menu is flaky; the command is what the menu runs, once the kernel is up.
    page.wait_for_function(
        """() => {
            const w = window.jupyterapp.shell.currentWidget;
            const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
            return k && k.status === 'idle';
        }""",
        timeout=90_000,
    )
    title = page.evaluate("() => window.jupyterapp.shell.currentWidget.title.label")
    assert title == "01_quickstart.ipynb", f"workbench lab opened {title!r}, not the quickstart"
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_selector(".wb-status", timeout=90_000)


class WorkbenchUI:
    """The workbench as seen in ``page`` (a Playwright page showing one Workbench)."""

    def __init__(self, page):
        self.page = page

    def status(self) -> tuple[str, str]:
        """Text and CSS classes of the status line."""
        loc = self.page.locator(".wb-status")
        return loc.inner_text().strip(), loc.get_attribute("class") or ""

    def wait_ready(self, timeout_ms: int = 120_000) -> str:
        """Wait until a computation has finished and the status line says so; its text."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_function(
                f"""() => {{
                    const s = document.querySelector('.wb-status');
                    return s && !s.classList.contains('wb-status-busy') && {READY}.test(s.textContent.trim());
                }}""",
                timeout=timeout_ms,
            )
        except PlaywrightTimeout as exc:
            text, classes = self.status()
            raise AssertionError(f"the app never said ready; status line [{classes}]: {text}") from exc
        return self.status()[0]

    def wait_idle(self, timeout_ms: int = 120_000) -> str:
        """Wait until no computation runs (the status line may still report something else, such as a
        download an earlier test started); its text."""
        self.page.wait_for_function(
            "() => { const s = document.querySelector('.wb-status'); return s && !s.classList.contains('wb-status-busy'); }",
            timeout=timeout_ms,
        )
        return self.status()[0]

    def slice_png(self) -> bytes:
        return self.page.locator(".wb-slice").screenshot()

    def canvas_png(self) -> bytes:
        return self.page.locator(".wb-view3d canvas").first.screenshot()

    def wait_canvas_drawn(self, timeout_ms: int = 60_000) -> None:
        """Wait until the 3D canvas holds more than a blank background."""
        self.page.locator(".wb-view3d canvas").first.wait_for(state="visible", timeout=timeout_ms)
        self.page.wait_for_timeout(500)  # one more frame after the last render call

    def watch_slice(self) -> None:
        """Record (performance.now()) every time the slice image gets new contents."""
        self.page.evaluate(
            """() => {
                const img = document.querySelector('.wb-slice');
                window.__wbSliceChanges = [];
                new MutationObserver(() => window.__wbSliceChanges.push(performance.now()))
                    .observe(img, { attributes: true, attributeFilter: ['src'] });
            }"""
        )

    def move_slider(self, css: str, key: str = "ArrowRight", timeout_ms: int = 60_000) -> float:
        """Press ``key`` on the handle of slider ``css``; ms until the slice image changed (after :meth:`watch_slice`)."""
        self.reveal(css)
        handle = self.page.locator(f"{css} .noUi-handle")
        handle.focus()
        before = self.page.evaluate("() => window.__wbSliceChanges.length")
        start = self.page.evaluate("() => performance.now()")
        self.page.keyboard.press(key)
        self.page.wait_for_function(f"() => window.__wbSliceChanges.length > {before}", timeout=timeout_ms)
        return self.page.evaluate(f"() => window.__wbSliceChanges[{before}]") - start

    def slider_value(self, css: str) -> float:
        return float(self.page.locator(f"{css} .noUi-handle").get_attribute("aria-valuenow"))

    def open_tab(self, title: str) -> None:
        """Show the views' tab ``title`` (line profile, density at atoms, difference, timing)."""
        tab = self.page.locator(".wb-app .lm-TabBar-tab, .wb-app .p-TabBar-tab").filter(has_text=title).first
        tab.click()
        self.page.wait_for_timeout(200)

    def box(self, css: str) -> dict[str, float]:
        """Bounding box of the first element matching ``css`` in viewport pixels (x, y, width, height, right, bottom)."""
        return self.page.evaluate(
            """(css) => { const r = document.querySelector(css).getBoundingClientRect();
                return {x: r.x, y: r.y, width: r.width, height: r.height, right: r.right, bottom: r.bottom}; }""",
            css,
        )

    def bfactor_value(self) -> float:
        return float(self.page.locator(".wb-bfactor .noUi-handle").get_attribute("aria-valuenow"))

    def move_bfactor(self, key: str = "ArrowRight", timeout_ms: int = 60_000) -> float:
        """Press ``key`` on the B-factor slider's handle; ms until the slice image changed."""
        handle = self.page.locator(".wb-bfactor .noUi-handle")
        handle.focus()
        before = self.page.evaluate("() => window.__wbSliceChanges.length")
        start = self.page.evaluate("() => performance.now()")
        self.page.keyboard.press(key)
        self.page.wait_for_function(f"() => window.__wbSliceChanges.length > {before}", timeout=timeout_ms)
        return self.page.evaluate(f"() => window.__wbSliceChanges[{before}]") - start

    def reveal(self, css: str) -> None:
        """Show the group of controls holding ``css`` (a click on its button, as a person would)."""
        target = self.page.locator(css).first
        if target.is_visible():
            return
        group = self.page.evaluate(
            """(css) => { const box = document.querySelector(css).closest('.wb-section');
                return [...box.classList].find(c => c.startsWith('wb-section-')).slice('wb-section-'.length); }""",
            css,
        )
        self.open_group(group)
        target.wait_for(state="visible", timeout=10_000)

    def open_group(self, name: str) -> None:
        """Click the button of the controls group ``name`` (density, adps, section, 3d, compute, profile, export, relax)."""
        self.page.locator(f".wb-section-tab-{name}").first.click()
        self.page.locator(f".wb-section-{name}").first.wait_for(state="visible", timeout=10_000)

    def type_into_readout(self, css: str, text: str) -> None:
        """Type a value into a slider's editable readout and press Enter (as a person would)."""
        self.reveal(css)
        readout = self.page.locator(f"{css} .widget-readout")
        readout.scroll_into_view_if_needed()
        readout.click()
        self.page.keyboard.press("Control+A")
        self.page.keyboard.type(text)
        self.page.keyboard.press("Enter")

    def load_path(self, path: str) -> None:
        """Type a model path into the path box and press Enter."""
        self.reveal(".wb-structure-path")
        box = self.page.locator(".wb-structure-path input")
        box.scroll_into_view_if_needed()
        box.fill(path)
        box.press("Enter")

    def go_to_middle_slice(self) -> int:
        """Type the middle section's index into the slice slider; the index."""
        last = int(float(self.page.locator(".wb-slice-index .noUi-handle").get_attribute("aria-valuemax")))
        middle = last // 2
        self.type_into_readout(".wb-slice-index", str(middle))
        self.page.wait_for_function(
            f"() => parseFloat(document.querySelector('.wb-slice-index .noUi-handle').getAttribute('aria-valuenow')) === {middle}",
            timeout=30_000,
        )
        return middle

    def choose_region(self, index: int) -> str:
        """Pick the ``index``-th entry of the 3D region dropdown (0 is the whole model); its label."""
        self.reveal(".wb-region")
        select = self.page.locator(".wb-region select")
        label = select.locator("option").nth(index).inner_text()
        select.select_option(index=index)
        self.page.wait_for_function(
            "() => /residue/.test(document.querySelector('.wb-view3d-caption').textContent)", timeout=60_000
        )
        return label.replace("\xa0", " ")

    def arrows_drawn(self) -> int:
        """Arrow shapes the 3D widget reports in its scene (its ``n_arrows_drawn`` trait, as ``data-arrows``)."""
        value = self.page.evaluate("() => document.querySelector('.wb-view3d[data-arrows]')?.dataset.arrows ?? '-1'")
        return int(value)

    def controls_overflow(self) -> list[str]:
        """Controls whose box runs past the controls panel's right edge, and the panel's sideways scroll."""
        return self.page.evaluate(
            """() => {
                const panel = document.querySelector('.wb-controls');
                const edge = panel.getBoundingClientRect().right + 1;
                const bad = [];
                for (const e of panel.querySelectorAll('input, select, button, .widget-readout, .widget-html-content')) {
                    const r = e.getBoundingClientRect();
                    if (r.width > 0 && r.right > edge) bad.push(`${e.className || e.tagName} ends at ${r.right.toFixed(0)} > ${edge.toFixed(0)}`);
                }
                let el = panel;
                while (el) {
                    if (el.scrollLeft > 0) bad.push(`${el.className} scrolled sideways by ${el.scrollLeft}px`);
                    el = el.parentElement;
                }
                return bad;
            }"""
        )

    def caption_3d(self) -> str:
        return caption_text(self.page, ".wb-view3d-caption")

    def caption_slice(self) -> str:
        return caption_text(self.page, ".wb-slice-caption")


#: JavaScript: the whole text of the caption element ``e`` (summary, " · ", the details), whitespace collapsed.
CAPTION_TEXT_JS = """(e) => { if (!e) return ''; const c = e.cloneNode(true);
    c.querySelectorAll('summary').forEach(x => x.append(' · '));
    return c.textContent.replace(/\\s+/g, ' ').trim(); }"""


def caption_text(page, selector: str) -> str:
    """The whole text of a caption: its one-line summary and the details behind the click, open or not."""
    return page.evaluate(f"(s) => ({CAPTION_TEXT_JS})(document.querySelector(s))", selector)


def wait_caption_change(page, selector: str, old: str, timeout: int = 60_000) -> None:
    """Wait until the caption's whole text (as :func:`caption_text` reads it) differs from ``old``."""
    page.wait_for_function(
        f"([s, old]) => ({CAPTION_TEXT_JS})(document.querySelector(s)) !== old", arg=[selector, old], timeout=timeout
    )


def median_latency(ui: WorkbenchUI, moves: int = 10) -> list[float]:
    """Slider-to-new-image latency of ``moves`` single key presses, each waited for (ms)."""
    ui.watch_slice()
    return [ui.move_bfactor() for _ in range(moves)]


def percentiles(latencies: list[float]) -> dict[str, float]:
    """Median and 90th percentile (ms) of a list of latencies."""
    ordered = sorted(latencies)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"median_ms": statistics.median(ordered), "p90_ms": p90, "n": len(ordered)}


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    return (
        f"median {statistics.median(ordered):.0f} ms over {len(ordered)} moves "
        f"(min {ordered[0]:.0f}, max {ordered[-1]:.0f}): " + ", ".join(f"{x:.0f}" for x in latencies)
    )
