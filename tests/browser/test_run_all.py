"""Every notebook, Run All in JupyterLab (issue 34): each widget a notebook displays is still
alive and shows something once the last cell has run.

A widget closed by a later cell (notebook 04 closed its workbench, leaving an empty output
and "no comm channel defined") shows as an empty output area. One page; each notebook is
opened, run, checked, then closed with its kernel shut down. Screenshots of each widget
output go to ``artifacts/screenshots/`` (``WORKBENCH_SCREENSHOTS``).
"""

from __future__ import annotations

import pytest

from tests.browser.conftest import ROOT, OfflinePage
from tests.browser.pages import open_lab, screenshot

pytestmark = pytest.mark.browser

NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
# Run All of the slowest (notebook 04) takes about a minute on a 2-core machine.
RUN_TIMEOUT_MS = 600_000


@pytest.fixture(scope="module")
def lab(browser, lab_server):
    op = OfflinePage(browser, width=1440, height=900)
    page = op.page
    open_lab(page, lab_server.url, run_quickstart=False)
    # the quickstart opens at start: close it (and its kernel) so that each test opens its own
    page.evaluate(_CLOSE)
    yield op
    op.close()


# Shut the current notebook's kernel down and close it without the "save your work?"
# dialog (close-and-shutdown asks first and would wait for a click).
_CLOSE = """async () => {
    const panel = window.jupyterapp.shell.currentWidget;
    if (!panel || !panel.sessionContext) return;
    await panel.sessionContext.shutdown();
    panel.context.model.dirty = false;
    panel.close();
}"""

# What the page does: open the notebook, Run All once its kernel is idle, wait for every
# code cell to have run (or for an error to stop the run).
_RUN = """async (path) => {
    const app = window.jupyterapp;
    const panel = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
    await panel.context.ready;
    await panel.sessionContext.ready;
    const idle = () => panel.sessionContext.session?.kernel?.status === 'idle';
    for (let i = 0; i < 600 && !idle(); i++) await new Promise(r => setTimeout(r, 200));
    await app.commands.execute('notebook:run-all-cells');
    return panel.id;
}"""

_DONE = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const cells = panel.content.widgets.filter(c => c.model.type === 'code' && c.model.sharedModel.getSource().trim());
    const failed = cells.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
    const ran = cells.every(c => c.model.executionCount !== null && c.promptNode.textContent.indexOf('*') < 0);
    return failed || (ran && panel.sessionContext.session.kernel.status === 'idle');
}"""

# Each output of a widget view: its cell, whether it rendered, its size and text.
_WIDGETS = """async () => {
    const panel = window.jupyterapp.shell.currentWidget;
    const out = [];
    const errors = [];
    for (const [i, cell] of panel.content.widgets.entries()) {
        if (cell.model.type !== 'code') continue;
        const outputs = cell.model.outputs.toJSON();
        outputs.forEach((o, j) => {
            if (o.output_type === 'error') errors.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
        });
        for (const [j, o] of outputs.entries()) {
            const data = o.data || {};
            if (!data['application/vnd.jupyter.widget-view+json']) continue;
            const node = cell.outputArea.widgets[j]?.node;
            if (!node) { out.push({cell: i, j, missing: true}); continue; }
            node.scrollIntoView({block: 'center'});
            await new Promise(r => requestAnimationFrame(() => setTimeout(r, 150)));
            const view = node.querySelector('.jupyter-widgets, .widget-box, .lm-Widget.jupyter-widgets');
            const r = (view || node).getBoundingClientRect();
            out.push({cell: i, j, rendered: !!view, width: r.width, height: r.height,
                      text: node.innerText.slice(0, 200), id: data['application/vnd.jupyter.widget-view+json'].model_id});
        }
    }
    return {widgets: out, errors};
}"""


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_all_leaves_every_displayed_widget_alive(lab, lab_server, name):
    op = lab
    page = op.page
    path = name  # the server's notebook folder holds the shipped notebooks
    assert (lab_server.notebooks / name).is_file(), f"{name} was not installed into {lab_server.notebooks}"
    page.evaluate(_RUN, path)
    page.wait_for_function(_DONE, timeout=RUN_TIMEOUT_MS, polling=1000)
    page.wait_for_timeout(2000)  # the last widget messages and renders
    found = page.evaluate(_WIDGETS)
    assert found["errors"] == [], f"{name}: Run All stopped on an error: {found['errors']}"
    widgets = found["widgets"]
    print(f"\n{name}: {len(widgets)} widget views: " + ", ".join(f"cell {w['cell']}" for w in widgets))
    for w in widgets:
        where = f"{name} cell {w['cell']} (widget {w.get('id')})"
        assert not w.get("missing"), f"{where}: no output node"
        assert w["rendered"], f"{where}: the widget view is gone (closed?); output text: {w['text']!r}"
        assert w["height"] > 20 and w["width"] > 20, f"{where}: the widget view is empty: {w}"
        assert "comm" not in w["text"].lower() and "error" not in w["text"].lower()[:40], f"{where}: {w['text']!r}"
    stem = name.removesuffix(".ipynb")
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
    for w in widgets:
        screenshot(cells.nth(w["cell"]).locator(".jp-OutputArea").first, f"run_all_{stem}_cell{w['cell']}")
    page.evaluate(_CLOSE)
